"""Fused MoE experts held as one SparseLinear per expert matrix (pyprune.nn.sparse.SparseExperts):
sparsify_ converts an N:M-pruned experts module and only such a one, the kernel forward gives the
masked dense model's logits, densify_ gives the fused module back to the bit, and the dense 3-D
parameters are gone."""
import copy

import pytest
import torch
from torch import nn

import pyprune
from pyprune.nn import SparseLinear, densify_, densify_slower_, dispatch, sparsify_
from pyprune.nn.anatomy import decoder_blocks
from pyprune.nn.sparse import SparseExperts, sparse_layers
from tests.helpers import assert_close, kernel_dispatch_cache, random_tokens, tiny_decoder

MOE = ["mixtral", "qwen2_moe"]


def _pruned(family, dtype=torch.float32, pattern="2:4"):
    model = tiny_decoder(family, layers=2).to(dtype)
    pyprune.prune(model, "magnitude", pattern, progress=False)
    return model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=random_tokens((2, 12), seed=5)).logits


def _bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", MOE)
def test_sparse_experts_run_the_kernel_with_the_masked_model_s_logits_and_less_memory(family, dtype):
    model = _pruned(family, dtype)
    dense = copy.deepcopy(model)
    expected, dense_bytes = _logits(model), _bytes(model)
    replaced = sparsify_(model, implementation="kernel")  # the sparse kernel on every machine, whatever the table says
    experts = [f"model.layers.{i}.mlp.experts.{e}.{m}" for i in range(2) for e in range(4)
               for m in ("gate_up_proj", "down_proj")]
    assert set(experts) <= set(replaced) and set(replaced.values()) == {"2:4"}
    for block, dense_block in zip(decoder_blocks(model), decoder_blocks(dense)):
        assert isinstance(block.mlp.experts, SparseExperts)
        layers = dict(block.mlp.experts.layers())
        assert len(layers) == 8 and all(isinstance(layer, SparseLinear) and layer.implementation == "kernel"
                                        for layer in layers.values())
        assert torch.equal(layers["3.down_proj"].weight, dense_block.mlp.experts.down_proj[3])
        assert type(block.mlp.gate) is type(dense_block.mlp.gate)  # routers stay as they are
        if family == "qwen2_moe":
            assert type(block.mlp.shared_expert_gate) is nn.Linear
    assert not any(p.dim() == 3 for p in model.parameters())  # no dense fused tensor kept beside
    fused = sum(p.numel() * p.element_size() for p in dense.parameters() if p.dim() == 3)
    assert _bytes(model) < dense_bytes - fused // 3  # 2:4 values + metadata: 9/16 of 16-bit, 5/8 of fp32
    # hidden states large enough that the experts' outputs are O(1), where the dtype's tolerance means something
    hidden = (50 * torch.randn(20, 64, generator=torch.Generator().manual_seed(3))).to(dtype)
    top_k_index = torch.randint(0, 4, (20, 2), generator=torch.Generator().manual_seed(4))
    top_k_weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():  # one experts module against the fused one: the dtype's op tolerance
        for block, dense_block in zip(decoder_blocks(model), decoder_blocks(dense)):
            want = dense_block.mlp.experts(hidden, top_k_index, top_k_weights)
            assert want.abs().max() > 1
            assert_close(block.mlp.experts(hidden, top_k_index, top_k_weights), want, dtype)
    if dtype == torch.float32:  # in bf16 two blocks of rounding differences exceed any op tolerance
        assert_close(_logits(model), expected, dtype)


@pytest.mark.parametrize("family", MOE)
def test_densify_gives_the_fused_experts_back_bit_for_bit(family):
    model = _pruned(family)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fused_type = type(model.model.layers[0].mlp.experts)
    replaced = sparsify_(model)
    assert densify_(model) == replaced
    assert type(model.model.layers[0].mlp.experts) is fused_type
    got = model.state_dict()
    assert list(got) == list(state) and all(torch.equal(got[name], tensor) for name, tensor in state.items())
    assert _logits(model).isfinite().all()


def test_an_experts_module_that_is_not_n_m_stays_dense_and_is_not_reported():
    """One nonzero too many in one expert of block 1: that block's experts stay fused, block 0's
    are converted; unstructured pruning converts no experts at all."""
    model = _pruned("mixtral")
    with torch.no_grad():
        weights = model.model.layers[1].mlp.experts.down_proj
        weights[2, 0, :4] = 1.0
    replaced = sparsify_(model)
    assert isinstance(model.model.layers[0].mlp.experts, SparseExperts)
    assert not isinstance(model.model.layers[1].mlp.experts, SparseExperts)
    assert any(".layers.0.mlp.experts." in name for name in replaced)
    assert not any(".layers.1.mlp.experts" in name for name in replaced)
    unstructured = _pruned("qwen2_moe", pattern="0.5")
    assert not any("experts" in name for name in sparsify_(unstructured))


def test_faster_at_converts_experts_whose_matrices_all_pay_and_densify_slower_turns_them_back(tmp_path, monkeypatch):
    """With ``faster_at=1`` experts become SparseExperts only where this machine's measurements name
    the kernel for both expert shapes; densify_slower_ gives the fused module back where one shape
    has none."""
    model = _pruned("mixtral")
    expected = _logits(model)
    experts = model.model.layers[0].mlp.experts
    gate_up, down = (tuple(getattr(experts, matrix).shape[1:]) for matrix in ("gate_up_proj", "down_proj"))
    assert dispatch.shape_bucket(*gate_up) != dispatch.shape_bucket(*down)
    gate_up_only = kernel_dispatch_cache(monkeypatch, tmp_path / "gate-up", [gate_up])
    assert not any("experts" in name for name in sparsify_(model, faster_at=1))
    kernel_dispatch_cache(monkeypatch, tmp_path / "both", [gate_up, down])
    converted = {name for name in sparsify_(model, faster_at=1) if "experts" in name}
    assert len(converted) == 2 * 4 * 2 and isinstance(model.model.layers[1].mlp.experts, SparseExperts)
    monkeypatch.setattr(dispatch, "cache_root", lambda: gate_up_only)
    assert {name for name in densify_slower_(model, 1) if "experts" in name} == converted
    assert not any(isinstance(block.mlp.experts, SparseExperts) for block in decoder_blocks(model))
    assert not sparse_layers(model) and torch.equal(_logits(model), expected)  # every layer back, same weights
