"""The bf16/fp16 robustness study (MoreauPruner Table 1): its measures, its arithmetic, its CLI."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyprune
from pyprune import cli
from pyprune.runtime import engine
from pyprune.studies import robustness
from pyprune.evaluation.perplexity import perplexity
from pyprune.methods.moreau import moreau_diagnostics
from pyprune.methods.structured import gradients_for
from pyprune.patterns import Structured
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
    with pytest.raises(ValueError, match="arithmetic must be one of rounding, fp32-accumulate, native"):
        with robustness.linear_arithmetic("fp64"):
            pass


@pytest.mark.parametrize("dtype, small", [(torch.bfloat16, 2.0 ** -9), (torch.float16, 2.0 ** -12)])
def test_native_16bit_products_accumulate_in_fp32_as_the_fp32_accumulate_arithmetic(dtype, small):
    """One large term and 512 terms each below half the format's spacing at 1: summed in the format
    every small term rounds away (the sum stays 1); accumulated in fp32 they add up. torch's 16-bit
    linear layers (forward, and the weight gradient of the backward) give the fp32-accumulated sum,
    what the fp32-accumulate arithmetic computes: the two arithmetics differ by summation order only."""
    terms = torch.tensor([1.0] + [small] * 512, dtype=dtype)
    expected = 1.0 + 512 * small
    in_format = torch.zeros((), dtype=dtype)
    for term in terms:
        in_format = in_format + term
    assert float(in_format) == 1.0  # the small terms vanish when summed in the format
    for arithmetic in ("native", "fp32-accumulate"):
        with robustness.linear_arithmetic(arithmetic):
            assert float(F.linear(terms[None], torch.ones(1, 513, dtype=dtype))) == expected
            weight = torch.ones(1, 1, dtype=dtype, requires_grad=True)  # 513 tokens of one feature
            F.linear(terms[:, None], weight).sum().backward()
            assert weight.grad.dtype == dtype and float(weight.grad) == expected


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
    assert report["arithmetic"] == "rounding" and report["eval_format"] == "float32"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not changed


def test_robustness_cli_report_keys(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "robust.json"
    argv = ["robustness", "--model", str(model_dir), "--method", "moreau", "--ratio", "0.5", "--calib",
            str(text), "--nsamples", "4", "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16",
            "--steps", "2", "--report", str(report_path), "--quiet"]
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert {"ppl_bf16", "ppl_fp16", "ppl_diff", "agreement", "spearman", "ppl_cross"} <= set(report)
    assert report["arithmetic"] == "rounding" and report["eval_format"] == "float32"
    assert 0.0 <= report["noise_floor"]["agreement"] <= 1.0 and report["noise_floor"]["noise_seeds"] == [0, 1]
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


def _pruned_params(model):
    return [p for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2]


def test_rounding_prunes_the_rounded_weights_in_fp32_arithmetic(monkeypatch):
    """--arithmetic rounding: each run's weights are exactly the model's rounded to its format, held in
    fp32, and every linear layer gets fp32 inputs (fp32 arithmetic), in pruning and in evaluation."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    seen = []
    prune = robustness.pruning.prune

    def spy(pruned, *args, **kwargs):
        dtypes = set()
        hooks = [m.register_forward_hook(lambda m, inputs, out: dtypes.update({inputs[0].dtype, out.dtype}))
                 for m in pruned.modules() if isinstance(m, nn.Linear)]
        weights = {name: p.detach().clone() for name, p in pruned.named_parameters()}
        try:
            report = prune(pruned, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        seen.append((weights, dtypes))
        return report

    monkeypatch.setattr(robustness.pruning, "prune", spy)
    robustness.study(model, "taylor", 0.5, random_tokens((4, 16)), random_tokens((128,), seed=3), eval_seqlen=32,
                     progress=False, cross=False)
    original = dict(model.named_parameters())
    for (weights, dtypes), dtype in zip(seen, (torch.bfloat16, torch.float16)):
        assert dtypes == {torch.float32}
        for name, w in weights.items():
            assert w.dtype == torch.float32 and torch.equal(w, original[name].detach().to(dtype).float()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_format(dtype):
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    rounded = robustness.to_format(tiny_llama(hidden=64, heads=4, kv_heads=2), name, "rounding")
    stored = robustness.to_format(tiny_llama(hidden=64, heads=4, kv_heads=2), name, "fp32-accumulate")
    for (_, w), r, s in zip(model.named_parameters(), rounded.parameters(), stored.parameters()):
        assert r.dtype == torch.float32 and s.dtype == dtype
        assert torch.equal(r, w.detach().to(dtype).float()) and torch.equal(s, w.detach().to(dtype))
    with pytest.raises(ValueError, match="format must be one of float32, bfloat16, float16"):
        robustness.to_format(model, "int8", "rounding")


def test_loss_scaler_backs_off_and_grows():
    scaler = engine.LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 4.0 and scaler.backoffs == 1
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 4.0 and scaler.backoffs == 2  # a backoff restarts the growth count
    for kwargs, message in [({"init_scale": 0}, "init_scale"), ({"growth_factor": 1.0}, "growth_factor"),
                            ({"backoff_factor": 1.0}, "backoff_factor"), ({"growth_interval": 0}, "growth_interval")]:
        with pytest.raises(ValueError, match=message):
            engine.LossScaler(**kwargs)


def test_loss_scaled_fp16_gradients_match_fp32():
    """fp16 gradient passes with dynamic loss scaling: a scale that overflows fp16 is backed off
    (the overflowing passes are redone), and the unscaled fp32 gradients match the fp32 model's
    better than fp16 gradients without scaling, which flush more entries to zero."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    calib = random_tokens((16, 32))
    half = copy.deepcopy(model).to(torch.float16)
    fp32_params, half_params = _pruned_params(model), _pruned_params(half)
    with gradients_for(model, fp32_params):
        reference = [g.clone() for g in engine.loss_gradients(model, fp32_params, calib, batch_size=8)]
    scaler = engine.LossScaler(init_scale=2.0 ** 40)
    with gradients_for(half, half_params), robustness.linear_arithmetic("fp32-accumulate"):
        unscaled = [g.clone() for g in engine.loss_gradients(half, half_params, calib, batch_size=8)]
        scaled = engine.loss_gradients(half, half_params, calib, batch_size=8, scaler=scaler)
    assert scaler.backoffs > 0 and scaler.scale < 2.0 ** 40
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in scaled)
    assert all(p.grad is None for p in half_params)

    def error(grads):
        return float(torch.cat([(g.float() - r).flatten() for g, r in zip(grads, reference)]).norm()
                     / torch.cat([r.flatten() for r in reference]).norm())

    def zeros(grads):
        return sum(int((g == 0).sum()) for g in grads)

    assert error(scaled) < 2e-3 and error(scaled) < error(unscaled)
    assert zeros(scaled) < zeros(unscaled)


def test_common_format_evaluation():
    """ppl_bf16 / ppl_fp16 are the pruned models' perplexities in fp32, ppl_cross the 2 x 2 of pruned in x
    evaluated in, each recomputed here from an independent prune of the same settings."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    calib, tokens = random_tokens((4, 16)), random_tokens((128,), seed=3)
    report = robustness.study(model, "taylor", 0.5, calib, tokens, eval_seqlen=32, progress=False,
                              arithmetic="fp32-accumulate")
    assert report["noise_floor"] is None and report["options"]["loss_scaling"] is True
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        pruned = copy.deepcopy(model).to(dtype)
        with robustness.linear_arithmetic("fp32-accumulate"):
            pyprune.prune(pruned, "taylor", Structured(0.5), calib, progress=False, loss_scaling=True)
            cross = {other: perplexity(copy.deepcopy(pruned).to(o), tokens, 32, batch_size=8, progress=False)
                     for other, o in (("bfloat16", torch.bfloat16), ("float16", torch.float16))}
        assert report["ppl_" + {"bfloat16": "bf16", "float16": "fp16"}[name]] == \
            perplexity(pruned.float(), tokens, 32, batch_size=8, progress=False)
        assert report["ppl_cross"][name] == cross
    assert report["ppl_diff"] == abs(report["ppl_bf16"] - report["ppl_fp16"])


def test_noise_floor_and_rank_correlation():
    """The noise floor compares the bf16 run with an independent bf16 prune at the next noise seed:
    its agreement and rank correlation are recomputed here from such a prune, and two noise draws
    do not rank the groups identically."""
    model, calib = tiny_llama(hidden=64, heads=4, kv_heads=2), random_tokens((4, 16))
    report = robustness.study(model, "moreau", 0.5, calib, random_tokens((64,), seed=3),
                              eval_seqlen=32, progress=False, cross=False, keep_scores=True, steps=2)
    floor = report["noise_floor"]
    assert floor["noise_seeds"] == [0, 1] and 0.0 <= floor["agreement"] <= 1.0
    second = pyprune.methods.get("moreau", steps=2, noise_seed=1, loss_scaling=False)
    rounded = robustness.to_format(copy.deepcopy(model), "bfloat16", "rounding")
    other = pyprune.prune(rounded, second, Structured(0.5), calib, batch_size=8, progress=False)
    assert floor["agreement"] == robustness.agreement(report["groups"]["bfloat16"], robustness.pruned_groups(other))
    assert floor["spearman"] == robustness.rank_correlation(report["scores"]["bfloat16"], second.layer_scores)
    assert floor["spearman"]["channels"] < 1.0 and floor["spearman"]["heads"] < 1.0
    assert set(floor["spearman"]) == set(report["spearman"]) == {"heads", "channels"}
    assert report["ppl_cross"] is None
    moreau = report["runs"]["bfloat16"]["moreau"]
    assert moreau["decay"] == pytest.approx((1 - 1e-3 / 0.05) ** 2) and moreau["delta_to_noise"] > 0


def test_noise_floor_in_perplexity_in_each_format():
    """With noise_formats bf16 and fp16 each format is pruned once more at the next noise seed: the
    floor's ppl_diff is |perplexity of the run − perplexity of that second draw| of the same format
    (in the common format fp32), recomputed here from independent prunes; the top-level agreement
    stays the first format's."""
    model, calib, tokens = tiny_llama(hidden=64, heads=4, kv_heads=2), random_tokens((4, 16)), random_tokens((64,), seed=3)
    report = robustness.study(model, "moreau", 0.5, calib, tokens, eval_seqlen=32, progress=False, cross=False,
                              noise_formats=("bfloat16", "float16"), steps=2)
    floor = report["noise_floor"]
    assert set(floor["ppl_diff"]) == set(floor["formats"]) == {"bfloat16", "float16"}
    for name in ("bfloat16", "float16"):
        second = pyprune.methods.get("moreau", steps=2, noise_seed=1, loss_scaling=False)
        rounded = robustness.to_format(copy.deepcopy(model), name, "rounding")
        pyprune.prune(rounded, second, Structured(0.5), calib, batch_size=8, progress=False)
        ppl = perplexity(rounded, tokens, 32, batch_size=8, progress=False)
        assert floor["formats"][name]["perplexity"] == ppl
        assert floor["ppl_diff"][name] == abs(report["runs"][name]["perplexity"] - ppl)
    assert floor["agreement"] == floor["formats"]["bfloat16"]["agreement"] and floor["format"] == "bfloat16"
    assert max(floor["ppl_diff"].values()) > 0  # two noise draws do not prune to the same perplexity
    with pytest.raises(ValueError, match="noise_formats must be one or more of bfloat16, float16; got .'fp8'."):
        robustness.study(model, "moreau", 0.5, calib, tokens, noise_formats=("fp8",), progress=False)


def test_spearman():
    assert robustness.spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([30.0, 20.0, 10.0])) == -1.0
    # ties share their mean rank: ranks (0.5, 0.5, 2) against (0, 1, 2) -> 1.5 / sqrt(1.5 * 2)
    assert robustness.spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == \
        pytest.approx(1.5 / 3 ** 0.5)
    scores = {0: {"heads": torch.tensor([1.0, 2.0]), "channels": torch.tensor([1.0, 2.0, 3.0])},
              1: {"heads": torch.tensor([2.0, 1.0]), "channels": torch.tensor([1.0, 2.0, 3.0])}}
    flipped = {0: scores[0], 1: {"heads": torch.tensor([1.0, 2.0]), "channels": torch.tensor([3.0, 2.0, 1.0])}}
    assert robustness.rank_correlation(scores, flipped) == {"heads": 0.0, "channels": 0.0}


def test_moreau_gs_diagnostics():
    """The -GS fractions from δ_T: a zeroed row, a row the threshold shrank by 1/3 and one by 1/101."""
    weights = [torch.ones(3, 4)]
    deltas = [torch.tensor([[0.0] * 4, [1.0, 0, 0, 0], [0, 50.0, 0, 0]])]  # row norms 0, 1, 50
    out = moreau_diagnostics(weights, deltas, rho=0.1, gamma=0.01, steps=3, eta=50.0, group_dim=0, noise_std=0.5)
    # threshold γη = 0.5: pre-threshold norms ≤ 0.5, 1.5, 50.5
    assert out["gs_zeroed"] == pytest.approx(1 / 3)
    assert out["gs_shrunk_1pct"] == pytest.approx(2 / 3)  # 0.5/50.5 < 1%
    assert out["gs_shrink_median"] == pytest.approx((1 / 3 + 0.5 / 50.5) / 2)
    assert out["decay"] == pytest.approx(0.9 ** 3) and out["decay_per_step"] == pytest.approx(0.9)
    assert out["delta_to_noise"] == pytest.approx((1 + 2500) ** 0.5 / (0.5 * 12 ** 0.5))
    assert "gs_zeroed" not in moreau_diagnostics(weights, deltas, rho=0.1, gamma=0.01, steps=3, eta=0.0,
                                                 group_dim=0, noise_std=0.5)
