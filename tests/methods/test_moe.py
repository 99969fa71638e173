"""Pruning MoE experts: every expert matrix pruned to the pattern from the tokens routed to it,
routers never, experts without tokens by magnitude; structured methods refuse MoE models."""
import copy

import pytest
import torch

import pyprune
from pyprune import ops
from pyprune.nn.anatomy import block_linears, decoder_blocks
from pyprune.patterns import NM, Structured
from tests.helpers import random_tokens, tiny_decoder

MOE = ["mixtral", "qwen2_moe"]
MATRICES = ("gate_up_proj", "down_proj")


def _routers(model):
    """Every router weight by qualified name, copied."""
    return {name: weight.detach().clone() for name, weight in model.named_parameters()
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))}


@pytest.mark.parametrize("pattern", ["0.5", "2:4"])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("family", MOE)
def test_every_expert_matrix_gets_exactly_the_pattern_and_routers_are_untouched(family, method, pattern):
    model = tiny_decoder(family)
    routers = _routers(model)
    calib = None if method == "magnitude" else random_tokens((4, 24))
    report = pyprune.prune(model, method, pattern, calib, batch_size=2, progress=False)
    for block in decoder_blocks(model):
        for matrix in MATRICES:
            for weight in getattr(block.mlp.experts, matrix):
                if pattern == "2:4":
                    assert bool(((weight.reshape(-1, 4) == 0).sum(dim=1) == 2).all())
                else:
                    assert int((weight == 0).sum()) == weight.numel() // 2
    for name, weight in routers.items():
        assert torch.equal(model.get_parameter(name), weight), name
    assert set(report["left_dense"]["tensors"]) == set(routers)
    names = {layer["name"] for layer in report["layers"]}
    assert {f"model.layers.{i}.mlp.experts.{e}.{m}" for i in range(4) for e in range(4) for m in MATRICES} <= names
    assert report["sparsity"] == 0.5 and report["nm_valid"]["2:4"] == (pattern == "2:4")
    if method != "magnitude":
        assert report["magnitude_fallback"] == {"layers": 0, "names": []}


@pytest.mark.parametrize("family", MOE)
def test_wanda_expert_statistics_are_those_of_the_tokens_the_router_sends_to_the_expert(family):
    """Wanda 2:4 equals a reference that hooks the original fused experts module: block after block
    the whole (partly pruned) reference model runs, and each expert's input norms are summed over
    the tokens whose top-k routing names it (its down_proj input: act(gate)·up of those tokens)."""
    model = tiny_decoder(family)
    reference = copy.deepcopy(model)
    tokens = random_tokens((5, 24))
    report = pyprune.prune(model, "wanda", "2:4", tokens, batch_size=2, progress=False)
    assert report["magnitude_fallback"]["layers"] == 0
    with torch.no_grad():
        for block in decoder_blocks(reference):
            linears = block_linears(block)  # attention (and the shared expert): fused experts are no nn.Linear
            stats = {name: torch.zeros(linear.in_features) for name, linear in linears.items()}
            experts = block.mlp.experts
            count, intermediate2, hidden = experts.gate_up_proj.shape
            gate_up = torch.zeros(count, hidden)
            down = torch.zeros(count, intermediate2 // 2)

            def route(module, args):
                states, top_k_index, _ = args
                for e in range(count):
                    x = states[(top_k_index == e).any(dim=-1)]
                    if x.shape[0] == 0:  # no token of this batch routed to e
                        continue
                    ops.accumulate_sqnorm_(gate_up[e], x)
                    gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
                    ops.accumulate_sqnorm_(down[e], module.act_fn(gate) * up)

            def observe(name, x):  # returns None: the output stays
                ops.accumulate_sqnorm_(stats[name], x)

            handles = [linear.register_forward_hook(lambda m, a, o, name=name: observe(name, a[0]))
                       for name, linear in linears.items()]
            handles.append(experts.register_forward_pre_hook(route))
            for start in range(0, 5, 2):
                reference(input_ids=tokens[start:start + 2], use_cache=False)
            for handle in handles:
                handle.remove()
            assert bool((gate_up.sum(dim=1) > 0).all())  # every expert saw tokens
            for name, linear in linears.items():
                linear.weight.mul_(ops.score_nm_mask(linear.weight, 2, 4, stats[name]))
            for e in range(count):
                experts.gate_up_proj[e].mul_(ops.score_nm_mask(experts.gate_up_proj[e], 2, 4, gate_up[e]))
                experts.down_proj[e].mul_(ops.score_nm_mask(experts.down_proj[e], 2, 4, down[e]))
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got == 0, want == 0), name


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("family", MOE)
def test_an_expert_no_token_reaches_is_pruned_by_magnitude_and_counted(family, method):
    """With every router sending all tokens to experts 0 and 1, experts 2 and 3 get the magnitude
    2:4 mask of their weights, and the report counts and names their 16 matrices."""
    model = tiny_decoder(family)
    dense = copy.deepcopy(model)

    def only_first_two(module, args, output):
        logits, scores, indices = output
        return logits, scores, torch.tensor([0, 1]).expand_as(indices)

    for block in decoder_blocks(model):
        block.mlp.gate.register_forward_hook(only_first_two)
    report = pyprune.prune(model, method, "2:4", random_tokens((4, 24)), batch_size=2, progress=False)
    unreached = [f"model.layers.{i}.mlp.experts.{e}.{m}" for i in range(4) for e in (2, 3) for m in MATRICES]
    assert report["magnitude_fallback"] == {"layers": 16, "names": unreached}
    for got, want in zip(decoder_blocks(model), decoder_blocks(dense)):
        for matrix in MATRICES:
            for e in range(4):
                weight, original = getattr(got.mlp.experts, matrix)[e], getattr(want.mlp.experts, matrix)[e]
                by_magnitude = original * NM(2, 4).weight_mask(original)
                assert torch.equal(weight, by_magnitude) == (e >= 2), (matrix, e)


@pytest.mark.parametrize("method", ["slicegpt", "dress"])
@pytest.mark.parametrize("family", MOE)
def test_hidden_slicing_refuses_an_moe_model_before_touching_it(family, method):
    """SliceGPT and DReSS slice the hidden stream of dense blocks (Taylor and MoreauPruner prune an MoE
    model's expert channels: tests/methods/test_expert_channels.py)."""
    model = tiny_decoder(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"^method '{method}' cannot prune an MoE model "
                                         r"\(model.layers.0.mlp.experts\): its structured pruning acts on dense "
                                         "blocks"):
        pyprune.prune(model, method, Structured(0.25), random_tokens((2, 16)), progress=False)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_an_unsupported_fused_layout_is_refused_before_pruning():
    model = tiny_decoder("mixtral")
    decoder_blocks(model)[2].mlp.experts.is_transposed = True
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^model.layers.2.mlp.experts \(MixtralExperts\) is a fused experts module "
                                         "pyprune cannot prune"):
        pyprune.prune(model, "wanda", "2:4", random_tokens((2, 16)), progress=False)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("method,options", [("safe", {"epochs": 1}), ("copal", {})])
def test_the_other_block_wise_methods_prune_every_expert_matrix_through_the_engine(method, options):
    """SAFE (trained on the block's outputs) and COPAL see the expert linears with no code of their own."""
    model = tiny_decoder("mixtral")
    routers = _routers(model)
    report = pyprune.prune(model, method, "2:4", random_tokens((4, 16)), progress=False, **options)
    for block in decoder_blocks(model):
        for matrix in MATRICES:
            weight = getattr(block.mlp.experts, matrix)
            assert bool(((weight.reshape(-1, 4) == 0).sum(dim=1) == 2).all())
    assert all(torch.equal(model.get_parameter(name), weight) for name, weight in routers.items())
    assert report["nm_valid"]["2:4"] and report["sparsity"] == 0.5


def test_accumulated_statistics_of_an_expert_outlive_a_call_that_does_not_reach_it():
    """Wanda accumulating across calls: the second call routes every token to experts 0 and 1, so
    experts 2 and 3 keep the statistics of the first call (no magnitude fallback) and their masks."""
    from pyprune.methods.wanda import Wanda
    model = tiny_decoder("mixtral")
    wanda = Wanda().accumulate_across_calls()
    pyprune.prune(model, wanda, "2:4", random_tokens((4, 24)), batch_size=2, progress=False)
    first = {i: [block.mlp.experts.gate_up_proj[e].clone() for e in range(4)]
             for i, block in enumerate(decoder_blocks(model))}

    def only_first_two(module, args, output):
        logits, scores, indices = output
        return logits, scores, torch.tensor([0, 1]).expand_as(indices)

    for block in decoder_blocks(model):
        block.mlp.gate.register_forward_hook(only_first_two)
    report = pyprune.prune(model, wanda, "2:4", random_tokens((4, 24), seed=1), batch_size=2, progress=False)
    assert report["magnitude_fallback"]["layers"] == 0
    for i, block in enumerate(decoder_blocks(model)):
        assert all(torch.equal(block.mlp.experts.gate_up_proj[e], first[i][e]) for e in (2, 3))
        assert not all(torch.equal(block.mlp.experts.gate_up_proj[e], first[i][e]) for e in (0, 1))
