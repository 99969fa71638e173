"""Fused MoE experts seen as one nn.Linear per expert matrix (pyprune.nn.experts)."""
import pytest
import torch

from pyprune.nn.anatomy import block_linears, decoder_blocks, unpruned_parameters
from pyprune.nn.experts import ExpertLinears, expert_linears, fused_experts
from tests.helpers import random_tokens, tiny_decoder

MOE = ["mixtral", "qwen2_moe"]


@pytest.mark.parametrize("family", MOE)
def test_the_expert_view_reproduces_every_block_output_exactly(family):
    """Inside the view each block's outputs (and the logits) are bit-identical to the fused module's;
    after it the original module is back and the state dict keys are unchanged."""
    model = tiny_decoder(family)
    tokens = random_tokens((3, 24))
    keys = list(model.state_dict())
    fused = [block.mlp.experts for block in decoder_blocks(model)]
    with torch.no_grad():
        dense = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
        for block in decoder_blocks(model):
            with expert_linears(block):
                assert isinstance(block.mlp.experts, ExpertLinears)
                viewed = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
            for got, want in zip(viewed.hidden_states, dense.hidden_states):
                assert torch.equal(got, want)
            assert torch.equal(viewed.logits, dense.logits)
    assert [block.mlp.experts for block in decoder_blocks(model)] == fused
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("family", MOE)
def test_expert_linears_are_views_of_the_fused_weights(family):
    """Every expert matrix is a linear named ``mlp.experts.<e>.<matrix>`` whose weight is the fused
    tensor's slice: zeroing it in place zeroes the fused parameter; a weight a method replaces is
    copied back. The fused tensors are no longer left dense inside the view, the routers are."""
    block = decoder_blocks(tiny_decoder(family))[0]
    experts = block.mlp.experts
    with expert_linears(block):
        linears = block_linears(block)
        names = [f"mlp.experts.{e}.{m}" for e in range(4) for m in ("gate_up_proj", "down_proj")]
        assert [name for name in linears if name.startswith("mlp.experts.")] == names
        assert linears["mlp.experts.2.gate_up_proj"].weight.shape == experts.gate_up_proj.shape[1:]
        routers = {"mlp.gate.weight"} | ({"mlp.shared_expert_gate.weight"} if family == "qwen2_moe" else set())
        assert set(unpruned_parameters(block)) == routers
        with torch.no_grad():
            linears["mlp.experts.2.gate_up_proj"].weight[0, :5] = 0
            replacement = torch.full_like(experts.down_proj[1], 7.0)
            linears["mlp.experts.1.down_proj"].weight = torch.nn.Parameter(replacement)
    assert block.mlp.experts is experts
    assert bool((experts.gate_up_proj[2, 0, :5] == 0).all()) and bool((experts.gate_up_proj[2, 0, 5:] != 0).all())
    assert bool((experts.down_proj[1] == 7.0).all()) and bool((experts.down_proj[0] != 7.0).all())


def test_a_fused_layout_pyprune_does_not_reproduce_is_refused_in_one_line():
    """An experts module whose computation differs (here: transformers' has_bias flag) is refused
    with its name, or left out (and so reported dense) when not strict."""
    block = decoder_blocks(tiny_decoder("mixtral"))[1]
    block.mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"^model.layers.1.mlp.experts \(MixtralExperts\) is a fused experts module "
                                         r"pyprune cannot prune: its parameters .*'has_bias': True.* match no layout; supported: "):
        fused_experts(block, where="model.layers.1")
    assert fused_experts(block, strict=False) == {}
    with expert_linears(block, strict=False):
        assert set(unpruned_parameters(block)) >= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


def test_the_expert_view_refuses_a_call_in_another_order():
    """A family calling its experts as (hidden, weights, indices) would be misrouted: refused instead."""
    view = ExpertLinears(decoder_blocks(tiny_decoder("mixtral"))[0].mlp.experts)
    hidden, indices, weights = torch.randn(5, 64), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    assert view(hidden, indices, weights).shape == (5, 64)
    with pytest.raises(TypeError, match="integer expert indices and float routing weights in that order"):
        view(hidden, weights, indices)
