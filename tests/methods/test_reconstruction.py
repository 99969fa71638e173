"""The masked-reconstruction control of SAFE: MaskedAdam moves only kept entries; on a block, the
control keeps its start's mask exactly (Wanda's, magnitude's, SparseGPT's), trains the kept weights
and lowers the reconstruction error; the whole method prunes every block exactly."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyprune
from pyprune.methods import get
from pyprune.methods.reconstruction import MaskedReconstruction
from pyprune.patterns import NM, Unstructured
from pyprune.runtime import engine
from pyprune.runtime.optim import MaskedAdam
from tests.helpers import random_tokens, tiny_llama


def test_masked_adam_moves_only_the_kept_entries_and_the_pruned_stay_exactly_zero():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8, bias=False)
    keep = torch.rand(8, 16) < 0.5
    with torch.no_grad():
        layer.weight.mul_(keep)
    before = layer.weight.detach().clone()
    optimizer = MaskedAdam([layer.weight], {layer.weight: keep}, lr=1e-2, betas=(0.9, 0.95))
    x, y = torch.randn(64, 16), torch.randn(64, 8)

    def closure():
        optimizer.zero_grad()
        loss = F.mse_loss(layer(x), y)
        loss.backward()
        return loss

    first = float(closure().detach())
    for _ in range(20):
        optimizer.step(closure)
    w = layer.weight.detach()
    assert torch.equal(w[~keep], torch.zeros_like(w[~keep]))  # exactly zero, not small
    assert (w[keep] != before[keep]).all()
    assert float(F.mse_loss(layer(x), y)) < first
    with pytest.raises(ValueError, match="masks must map"):
        MaskedAdam([layer.weight], {layer.weight: keep.float()}, lr=1e-2)


def _first_block(seed=0, tokens=(8, 32)):
    model = tiny_llama(seed=seed)
    calib = random_tokens(tokens, seed=1)
    inputs, kwargs = engine.capture_block_inputs(model, calib, 4)
    block = engine.decoder_blocks(model)[0]
    return block, inputs, kwargs[0]


def _relative_error(block, dense_block, inputs, kwargs):
    with torch.no_grad():
        wanted = engine.first_tensor(dense_block(inputs, **kwargs))
        got = engine.first_tensor(block(inputs, **kwargs))
    return float((got - wanted).square().sum() / wanted.square().sum())


@pytest.mark.parametrize("start, pattern", [("wanda", Unstructured(0.5, "row")), ("magnitude", NM(2, 4)),
                                            ("sparsegpt", Unstructured(0.5, "tensor"))])
def test_control_keeps_its_starts_mask_and_trains_only_the_kept_weights(start, pattern):
    dense_block, inputs, kwargs = _first_block()
    one_shot = copy.deepcopy(dense_block)  # the start alone on the same inputs
    method = get(start)
    ctx = engine.BlockContext(0, "block", one_shot, inputs, kwargs, 4)
    if start == "magnitude":
        with torch.no_grad():
            for linear in ctx.linears().values():
                linear.weight.mul_(pattern.weight_mask(linear.weight))
    else:
        stats = {name: method.new_stats(name, linear) for name, linear in ctx.linears().items()}
        ctx.capture(lambda name, linear, x, y: method.update(stats[name], x, y))
        with torch.no_grad():
            for name, linear in ctx.linears().items():
                method.prune_layer(linear, stats[name], pattern)

    trained = copy.deepcopy(dense_block)
    control = MaskedReconstruction(start=start, epochs=10, train_batch=4, lr=2e-3)
    ctx = engine.BlockContext(0, "block", trained, inputs, kwargs, 4)
    report = control.prune_block(ctx, pattern, steps=20, warmup=2, progress=False)
    for name, linear in ctx.linears().items():
        w, start_w = linear.weight.detach(), engine.block_linears(one_shot)[name].weight.detach()
        assert torch.equal(w != 0, start_w != 0), name  # the start's mask, unchanged
        kept = start_w != 0
        assert (w[kept] != start_w[kept]).float().mean() > 0.99, name  # the kept weights trained
    assert report["kept"] == pytest.approx(0.5, abs=0.01)
    assert report["loss_last"] < report["loss_first"]
    assert _relative_error(trained, dense_block, inputs, kwargs) < _relative_error(one_shot, dense_block, inputs,
                                                                                   kwargs)


def test_control_prunes_every_block_exactly_with_the_starts_scope():
    calib = random_tokens((8, 32), seed=1)
    model = tiny_llama(seed=0)
    report = pyprune.prune(model, "masked-recon", "2:4", calib, progress=False, epochs=2, train_batch=4)
    assert report["steps_per_block"] == 4 and len(report["blocks"]) == len(engine.decoder_blocks(model))
    for block in engine.decoder_blocks(model):
        for linear in engine.block_linears(block).values():
            assert ((linear.weight.reshape(-1, 4) != 0).sum(dim=1) == 2).all()
            assert linear.weight.requires_grad
    assert MaskedReconstruction(start="sparsegpt").resolve(Unstructured(0.5)).scope == "tensor"
    assert MaskedReconstruction(start="wanda").resolve(Unstructured(0.5)).scope == "row"
    with pytest.raises(ValueError, match="start"):
        MaskedReconstruction(start="safe")
