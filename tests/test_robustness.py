"""The bf16/fp16 robustness study (MoreauPruner Table 1): its measures, its arithmetic, its CLI."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyprune import cli, robustness
from tests.helpers import random_tokens, tiny_llama


def test_pruned_groups_and_agreement():
    report = {"structure": [
        {"layer": 0, "pruned_heads": [1], "pruned_channels": [3, 4]},
        {"layer": 1, "pruned": False},
        {"layer": 2, "pruned_heads": [], "pruned_channels": [0]},
    ]}
    groups = robustness.pruned_groups(report)
    assert groups == {(0, "head", 1), (0, "channel", 3), (0, "channel", 4), (2, "channel", 0)}
    other = {(0, "head", 1), (0, "channel", 3), (0, "channel", 5), (2, "channel", 0)}
    assert robustness.agreement(groups, other) == 0.75
    assert robustness.agreement(groups, groups) == 1.0
    assert robustness.agreement(set(), set()) == 1.0
    assert robustness.agreement(groups, set()) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_accumulate_linear(dtype):
    """Inside the block a 16-bit linear is the fp32 product rounded once; nn.Linear is never patched."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(512, 64).to(dtype)
    x = torch.randn(3, 512, generator=gen).to(dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
    original = nn.Linear.forward
    with robustness.linear_arithmetic("fp32-accumulate"):
        got = layer(x)
        assert nn.Linear.forward is original
    assert nn.Linear.forward is original
    assert got.dtype == dtype and torch.equal(got, expected)
    with robustness.linear_arithmetic("native"):
        assert nn.Linear.forward is original
    with pytest.raises(ValueError, match="arithmetic must be one of fp32-accumulate, native"):
        with robustness.linear_arithmetic("fp64"):
            pass


def test_study_on_a_tiny_llama():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calib, tokens = random_tokens((4, 16)), random_tokens((256,), seed=3)
    report = robustness.study(model, "taylor", 0.5, calib, tokens, eval_seqlen=32, progress=False)
    for key in ("method", "ppl_bf16", "ppl_fp16", "ppl_diff", "agreement"):
        assert key in report
    assert report["ppl_diff"] == abs(report["ppl_bf16"] - report["ppl_fp16"])
    assert 0.0 <= report["agreement"] <= 1.0
    assert report["runs"]["bfloat16"]["pruned_groups"] == report["runs"]["float16"]["pruned_groups"] > 0
    assert report["arithmetic"] == "fp32-accumulate"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not changed


def test_robustness_cli_report_keys(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "robust.json"
    argv = ["robustness", "--model", str(model_dir), "--method", "moreau", "--ratio", "0.5", "--calib",
            str(text), "--nsamples", "4", "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16",
            "--steps", "2", "--report", str(report_path), "--quiet"]
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert {"ppl_bf16", "ppl_fp16", "ppl_diff", "agreement"} <= set(report)
    assert report["method"] == "moreau" and report["options"]["steps"] == 2
    assert report["options"]["rho"] == 0.05 and report["nsamples"] == 4


@pytest.mark.parametrize("args,message", [
    (["--method", "wanda"], "--method for robustness must be one of moreau, moreau-gs, smoothgrad, taylor; got .wanda."),
    (["--method", "moreau", "--ratio", "1.5"], "ratio"),
    (["--method", "moreau", "--gamma", "0.1"], "must be < rho"),
    (["--method", "moreau", "--rho", "-1"], "option rho of method 'moreau' must be > 0"),
    (["--method", "moreau-gs", "--eta", "-1"], "option eta of method 'moreau-gs' must be >= 0"),
    (["--method", "moreau", "--steps", "0"], "option steps of method 'moreau' must be >= 1"),
    (["--method", "taylor", "--rho", "0.1"], "method 'taylor' has no option rho"),
    (["--method", "moreau", "--calib", "nowhere.txt"], "source='nowhere.txt' is neither"),
])
def test_robustness_bad_arguments_fail_before_loading(tmp_path, capsys, args, message):
    argv = ["robustness", "--model", str(tmp_path / "never-loaded"), "--calib", "emma",
            "--eval", "pride_and_prejudice", "--report", str(tmp_path / "r.json")] + args
    if "--ratio" not in args:
        argv += ["--ratio", "0.2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err
    assert not (tmp_path / "r.json").exists()
