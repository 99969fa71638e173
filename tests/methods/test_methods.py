"""Baseline methods on a tiny random Llama: exact patterns, the scores they claim, and errors."""
import pytest
import torch

import pyprune
from pyprune.runtime import engine
from pyprune.ops import reference as R
from pyprune.methods.sparsegpt import SparseGPT, _Hessian
from pyprune.patterns import NM, Unstructured
from tests.helpers import random_tokens, tiny_llama

METHODS = ["magnitude", "wanda", "sparsegpt"]


def _linears(model):
    for block in model.model.layers:
        yield from engine.block_linears(block).values()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pattern", ["2:4", "4:8", NM(1, 4)])
def test_nm_patterns_are_exact(method, pattern):
    model = tiny_llama()
    report = pyprune.prune(model, method, pattern, random_tokens((4, 16)), progress=False)
    n, m = (int(v) for v in str(pattern).split(":"))
    pruned = list(_linears(model))
    assert len(pruned) == len(report["layers"]) == 2 * 7
    for linear in pruned:
        nonzero = (linear.weight != 0).reshape(-1, m).sum(dim=1)
        assert bool((nonzero == n).all()), "random weights have no zeros, so exactly n survive"
    assert report["nm_valid"][f"{n}:{m}"] is True
    assert all(layer["nm_valid"][f"{n}:{m}"] is True for layer in report["layers"])
    assert report["sparsity"] == pytest.approx(1 - n / m)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.8])
def test_unstructured_counts_are_exact(method, sparsity):
    model = tiny_llama()
    pyprune.prune(model, method, Unstructured(sparsity, "row"), random_tokens((4, 16)), progress=False)
    for linear in _linears(model):
        kept = (linear.weight != 0).sum(dim=1)
        assert bool((kept == R.kept_count(linear.in_features, sparsity)).all())


def test_tensor_scope_keeps_the_layer_share():
    model = tiny_llama()
    pyprune.prune(model, "magnitude", Unstructured(0.6, "tensor"), progress=False)
    for linear in _linears(model):
        assert int((linear.weight != 0).sum()) == R.kept_count(linear.weight.numel(), 0.6)


def test_wanda_masks_are_the_wanda_score_of_the_block_inputs():
    model = tiny_llama()
    dense = tiny_llama()
    tokens = random_tokens((6, 16))
    pyprune.prune(model, "wanda", "2:4", tokens, batch_size=4, progress=False)
    # block 0 sees the embeddings unchanged, so its statistics come from the dense model
    hidden = dense(input_ids=tokens, output_hidden_states=True).hidden_states[0]
    x = dense.model.layers[0].input_layernorm(hidden).detach()
    sqnorm = x.reshape(-1, x.shape[-1]).double().square().sum(0).float()
    q_dense = dense.model.layers[0].self_attn.q_proj.weight.detach()
    expected = R.score_nm_mask(q_dense, 2, 4, sqnorm)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight != 0, expected)


def test_sparsegpt_reconstructs_better_than_magnitude_and_wanda():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(512, 64) @ torch.randn(64, 64)  # correlated inputs, where OBS updates help
    target = linear(x).detach()
    errors = {}
    for name in METHODS:
        layer = torch.nn.Linear(64, 32, bias=False)
        layer.weight.data.copy_(linear.weight.data)
        pattern = NM(2, 4)
        if name == "magnitude":
            keep = pattern.weight_mask(layer.weight)
            layer.weight.data.mul_(keep)
        elif name == "wanda":
            keep = pattern.weight_mask(layer.weight, x.square().sum(0))
            layer.weight.data.mul_(keep)
        else:
            stats = _Hessian(64, "cpu")
            stats.add(x[:256])
            stats.add(x[256:])
            SparseGPT(blocksize=16).prune_layer(layer, stats, pattern)
        assert bool(((layer.weight != 0).reshape(-1, 4).sum(1) <= 2).all())
        errors[name] = float((layer(x) - target).square().mean().detach())
    assert errors["sparsegpt"] < 0.8 * min(errors["wanda"], errors["magnitude"])


def test_sparsegpt_hessian_is_the_running_mean_of_2xxT():
    x1, x2 = torch.randn(3, 5, 8), torch.randn(7, 8)
    stats = _Hessian(8, "cpu")
    stats.add(x1)
    stats.add(x2)
    all_x = torch.cat([x1.reshape(-1, 8), x2])
    torch.testing.assert_close(stats.H, 2 * all_x.T @ all_x / all_x.shape[0])


@pytest.mark.parametrize("call,message", [
    (lambda m, t: pyprune.prune(m, "obs", "2:4", t), "method must be one of"),
    (lambda m, t: pyprune.prune(m, "wanda", "2:5:1", t), "pattern must look like N:M"),
    (lambda m, t: pyprune.prune(m, "wanda", 1.5, t), "pattern must look like N:M"),
    (lambda m, t: pyprune.prune(m, "wanda", "3:3", t), r"1 <= N < M <= 32"),
    (lambda m, t: pyprune.prune(m, "wanda", "2:24", t), "needs M=24 to divide the input features"),
    (lambda m, t: pyprune.prune(m, "wanda", "2:4", None), "needs calibration tokens"),
    (lambda m, t: pyprune.prune(m, "sparsegpt", "2:4", t, blocksize=0), "option blocksize of method 'sparsegpt' must be >= 1; got 0"),
    (lambda m, t: pyprune.prune(m, "wanda", "2:4", t, damp=1), "method 'wanda' has no option damp; its options: owl, owl_m, owl_lambda, dsnot, dsnot_cycles, dsnot_threshold, dsnot_var_power, dsnot_layers, checkpoint"),
])
def test_bad_input_raises_and_leaves_the_model_untouched(call, message):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        call(model, random_tokens((2, 8)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
