"""Every format pyprune writes stays what it is: plain transformers refuses the non-standard ones
(saying to use pyprune.load) instead of loading wrong shapes or random weights, pyprune.load reads
them all exactly, and every CLI tool that takes a model takes each of them."""
import json

import pytest
import torch
import transformers

import pyprune
from pyprune import cli
from pyprune.io.manifest import MARKED_MODEL_TYPE
from pyprune.nn import keep_mlp_channels_, sparsify_
from tests.helpers import WORDS, random_tokens, tiny_llama, tiny_tokenizer


def _nm_pruned():
    """The tiny Llama with the 2 largest |w| of every 4 kept in each block linear."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                groups = module.weight.view(-1, 4)
                mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.abs().topk(2, dim=1).indices, True)
                groups.mul_(mask)
    return model


def _sparse_layers():
    model = _nm_pruned()
    assert sparsify_(model, "2:4")
    return model


def _non_uniform():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    keep_mlp_channels_(model.model.layers[0], torch.arange(0, 128, 2))  # block 0 keeps half its channels
    return model


def _uniform():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    for block in model.model.layers:
        keep_mlp_channels_(block, torch.arange(0, 128, 2))
    return model


def _residual_rotations():
    """SliceGPT's output: a sliced hidden stream with a shortcut rotation per residual."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    calib = random_tokens((4, 16))
    pyprune.prune(model, "slicegpt", pyprune.patterns.Structured(0.25), calib, batch_size=4, progress=False)
    return model


#: name -> (build, whether plain from_pretrained reads it as saved)
FORMATS = {"sparse-layers": (_sparse_layers, False), "non-uniform-structured": (_non_uniform, False),
           "residual-rotations": (_residual_rotations, False),
           "uniform-structured": (_uniform, True), "nm-dense": (_nm_pruned, True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("formats")
    for name, (build, _) in FORMATS.items():
        pyprune.save(build(), tiny_tokenizer(), base / name)
    (base / "text.txt").write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    (base / "text2.txt").write_text(" ".join(WORDS[i * 5 % len(WORDS)] for i in range(600)))
    return base


def _logits(model):
    with torch.no_grad():
        return model(random_tokens((2, 12))).logits


@pytest.mark.parametrize("name", FORMATS)
def test_plain_from_pretrained_refuses_every_non_standard_format(saved, name):
    build, compatible = FORMATS[name]
    directory = saved / name
    expected = _logits(build())
    loaded, _ = pyprune.load(directory)
    assert torch.equal(_logits(loaded), expected)
    assert json.loads((directory / "pyprune.json").read_text())["config_compatible"] is compatible
    if compatible:
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
        assert torch.equal(_logits(plain), expected)
        return
    assert json.loads((directory / "config.json").read_text())["model_type"] == MARKED_MODEL_TYPE
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoConfig):
        with pytest.raises(ValueError, match=r"model type `pyprune-checkpoint: load it with pyprune.load\(directory\)`"):
            auto.from_pretrained(directory)


def _run(argv, capsys):
    code = cli.main([str(arg) for arg in argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize("name", ["sparse-layers", "non-uniform-structured", "residual-rotations"])
def test_every_tool_takes_every_format(saved, name, tmp_path, capsys):
    model, text = saved / name, saved / "text.txt"
    small = ["--nsamples", "2", "--seqlen", "16", "--quiet"]
    code, out = _run(["prune", "--model", model, "--method", "magnitude", "--pattern", "2:4", "--output",
                      tmp_path / "pruned", "--quiet"], capsys)
    assert code == 0, out.err
    pruned, _ = pyprune.load(tmp_path / "pruned")
    assert pyprune.nn.measure.sparsity_report(pruned)["nm_valid"]["2:4"]
    code, out = _run(["eval", "--model", model, "--data", text, "--seqlen", "16", "--max-tokens", "64", "--quiet"],
                     capsys)
    assert code == 0 and "perplexity" in out.out, out.err
    code, out = _run(["generate", "--model", model, "--prompt", "the house", "--max-new-tokens", "2"], capsys)
    assert code == 0, out.err
    code, out = _run(["recover", "--model", model, "--calib", text, "--steps", "1", *small, "--batch-size", "2",
                      "--output", tmp_path / "recovered"], capsys)
    assert code == 0, out.err
    code, out = _run(["continual", "--model", model, "--method", "wanda", "--pattern", "2:4", "--datasets", text,
                      saved / "text2.txt", "--eval", text, saved / "text2.txt", "--eval-seqlen", "16", *small, "--report",
                      tmp_path / "continual.json"], capsys)
    assert code == 0, out.err


def test_compare_refuses_a_robustness_report_in_one_line(tmp_path, capsys):
    report = tmp_path / "robust.json"
    report.write_text(json.dumps({"method": "moreau", "eval": "emma", "ppl_bf16": 20.0, "ppl_fp16": 21.0}))
    code, out = _run(["compare", report, "--output", tmp_path / "cmp"], capsys)
    assert code == 2
    assert out.err.strip() == (f"pyprune compare: error: {report} is not a prune or eval report: its eval/tasks "
                               "fields are not perplexity entries and zero-shot results (a robustness or continual "
                               "report?)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["robust.json"]


@pytest.mark.parametrize("name", FORMATS)
def test_config_compatible_says_what_the_saved_directory_says(saved, name):
    """The report's ``config_compatible`` (pyprune.io.config_compatible, what the CLI records) and the
    saved pyprune.json agree for every format, SliceGPT's rotated width included."""
    build, compatible = FORMATS[name]
    assert pyprune.io.config_compatible(build()) is compatible
    assert json.loads((saved / name / "pyprune.json").read_text())["config_compatible"] is compatible
