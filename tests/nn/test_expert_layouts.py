"""Fused expert layouts beyond Mixtral's (pyprune.nn.experts.LAYOUTS), on tiny random models:
gpt-oss (matrices stored [E, in, out], biases, gate and up interleaved and clamped by its own
_apply_gate) and Llama 4 ([E, in, out], every token handed to every expert pre-scaled by its routing
score, a shared expert beside). Each expert matrix is one linear whose hooks see the tokens routed to
that expert; Wanda equals a reference that hooks the original fused module; every expert matrix gets
the pattern along its inputs; SparseExperts run them and save -> load gives the same logits."""
import copy

import pytest
import torch

import pyprune
from pyprune import ops
from pyprune.nn import densify_, sparsify_
from pyprune.nn.anatomy import block_linears, decoder_blocks
from pyprune.nn.experts import ExpertLinears, expert_layout, expert_linears
from pyprune.nn.sparse import SparseExperts
from tests.helpers import random_tokens, tiny_decoder

FAMILIES = ("gpt_oss", "llama4")
MOE = {"gpt_oss": "mlp", "llama4": "feed_forward"}  #: where each family's block keeps its experts and router
TOKENS = random_tokens((5, 24))


@pytest.fixture(scope="module")
def tiny():
    """A copy of the family's 2-block model (each built once per module)."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = tiny_decoder(family, layers=2)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():  # transformers initialises biases to zero: give them values to carry
                for name, bias in built[family].named_parameters():
                    if name.endswith("_bias") or name.endswith("router.bias"):
                        bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))
        return copy.deepcopy(built[family])
    return get


def _experts(block, family):
    return block.get_submodule(f"{MOE[family]}.experts")


def _weights(experts, matrix):
    """Every expert's ``matrix`` as [E, out, in] (the fused parameter is [E, in, out] in both layouts)."""
    return getattr(experts, matrix).detach().transpose(1, 2)


@pytest.mark.parametrize("family,mixtral_like", [("gpt_oss", False), ("llama4", False), ("mixtral", True),
                                                 ("qwen2_moe", True)])
def test_each_fused_module_has_its_layout(family, mixtral_like, tiny):
    model = tiny(family) if family in FAMILIES else tiny_decoder(family, layers=1)
    experts = next(m for n, m in decoder_blocks(model)[0].named_modules() if n.endswith("experts"))
    layout, problem = expert_layout(experts)
    assert problem == "" and layout.name == ("mixtral" if mixtral_like else family)
    assert (layout.transposed, layout.biases, layout.prescaled) == {
        "gpt_oss": (True, True, False), "llama4": (True, False, True)}.get(family, (False, False, False))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_expert_view_reproduces_the_model_and_its_linears_are_views(family, tiny):
    """gpt-oss's view runs the fused module's own loop, to the bit; Llama 4's runs each expert on its
    routed rows only (its fused module multiplies every row, the unrouted zero rows too), to float
    rounding. A view linear's weight (a contiguous [out, in] copy) or bias zeroed in place is zeroed in
    the fused parameter once the view is gone."""
    model = tiny(family)
    with torch.no_grad():
        dense = model(input_ids=TOKENS, use_cache=False).logits
        block = decoder_blocks(model)[1]
        experts = _experts(block, family)
        with expert_linears(block):
            viewed = model(input_ids=TOKENS, use_cache=False).logits
            view = _experts(block, family)
            assert isinstance(view, ExpertLinears)
            linears = block_linears(block)
            names = [f"{MOE[family]}.experts.{e}.{m}" for e in range(4) for m in ("gate_up_proj", "down_proj")]
            assert [n for n in linears if ".experts." in n] == names
            assert not any(n.endswith("router") for n in linears)
            gate_up = linears[f"{MOE[family]}.experts.2.gate_up_proj"]
            assert gate_up.weight.shape == (64, 64) and gate_up.in_features == 64
            gate_up.weight[3, :5] = 0
            if family == "gpt_oss":
                gate_up.bias[7] = 0
    if family == "gpt_oss":
        assert torch.equal(viewed, dense)
        assert float(experts.gate_up_proj_bias[2, 7]) == 0.0 and bool((experts.gate_up_proj_bias[2, :7] != 0).all())
    else:
        torch.testing.assert_close(viewed, dense, rtol=1e-5, atol=1e-5)
    assert _experts(block, family) is experts
    assert bool((experts.gate_up_proj[2, :5, 3] == 0).all()) and bool((experts.gate_up_proj[2, 5:, 3] != 0).all())


def _reference_wanda(model, family, pattern):
    """Wanda by hand, hooking the original fused experts: block after block the whole (partly pruned)
    model runs, and each expert's input norms are summed over the tokens routed to it: gpt-oss's top-k
    indices name it; Llama 4's router left its share of the pre-scaled rows nonzero. Its down_proj
    input is computed here from the fused weights (and biases) with the family's gate."""
    with torch.no_grad():
        for block in decoder_blocks(model):
            linears = block_linears(block)  # attention, Llama 4's shared expert: fused experts are no nn.Linear
            stats = {name: torch.zeros(linear.in_features) for name, linear in linears.items()}
            experts = _experts(block, family)
            count, hidden, double = experts.gate_up_proj.shape
            norms = {"gate_up_proj": torch.zeros(count, hidden), "down_proj": torch.zeros(count, double // 2)}

            def route(module, args):
                if family == "gpt_oss":
                    states, indices, _ = args
                    routed = [states[(indices == e).any(dim=-1)] for e in range(count)]
                else:
                    shares = args[0].view(count, -1, hidden)
                    routed = [share[share.any(dim=-1)] for share in shares]
                for e, x in enumerate(routed):
                    if x.shape[0]:
                        ops.accumulate_sqnorm_(norms["gate_up_proj"][e], x)
                        gate_up = x @ module.gate_up_proj[e]
                        if family == "gpt_oss":
                            gate_up = gate_up + module.gate_up_proj_bias[e]
                            inner = module._apply_gate(gate_up)
                        else:
                            gate, up = gate_up.chunk(2, dim=-1)
                            inner = module.act_fn(gate) * up
                        ops.accumulate_sqnorm_(norms["down_proj"][e], inner)

            def observe(name, x):  # returns None: the output stays
                ops.accumulate_sqnorm_(stats[name], x)

            handles = [linear.register_forward_hook(lambda m, a, o, name=name: observe(name, a[0]))
                       for name, linear in linears.items()]
            handles.append(experts.register_forward_pre_hook(route))
            for start in range(0, TOKENS.shape[0], 2):
                model(input_ids=TOKENS[start:start + 2], use_cache=False)
            for handle in handles:
                handle.remove()
            assert bool((norms["gate_up_proj"].sum(dim=1) > 0).all())  # every expert saw tokens
            for name, linear in linears.items():
                linear.weight.mul_(pattern.weight_mask(linear.weight, stats[name]))
            for matrix, norm in norms.items():
                for e in range(count):
                    weight = getattr(experts, matrix)[e].t()  # [out, in]
                    weight.mul_(pattern.weight_mask(weight, norm[e]))


@pytest.mark.parametrize("pattern", ["2:4", "0.5"])
@pytest.mark.parametrize("family", FAMILIES)
def test_wanda_per_expert_statistics_equal_a_reference_on_the_fused_module(family, pattern, tiny):
    from pyprune.methods import get
    from pyprune.patterns import parse
    model = tiny(family)
    reference = copy.deepcopy(model)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." in n}
    report = pyprune.prune(model, "wanda", pattern, TOKENS, batch_size=2, progress=False)
    assert report["magnitude_fallback"]["layers"] == 0
    _reference_wanda(reference, family, get("wanda").resolve(parse(pattern)))
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got == 0, want == 0), name
    for block in decoder_blocks(model):
        for matrix in ("gate_up_proj", "down_proj"):
            kept = (_weights(_experts(block, family), matrix) != 0).reshape(-1, 4).sum(dim=1)
            assert bool((kept == 2).all()) if pattern == "2:4" else int(kept.sum()) == kept.numel() * 2
    assert all(torch.equal(model.get_parameter(n), p) for n, p in routers.items())
    assert set(routers) <= set(report["left_dense"]["tensors"])
    assert report["sparsity"] == 0.5 and report["nm_valid"]["2:4"] == (pattern == "2:4")


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_experts_run_both_layouts_and_save_load_gives_the_same_logits(family, tiny, tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny(family)
    report = pyprune.prune(model, "magnitude", "2:4", progress=False)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
        pyprune.save(model, None, str(tmp_path / "dense-form"), report)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-form", dtype=torch.float32).eval()
        assert torch.equal(plain(input_ids=TOKENS).logits, logits)
        replaced = sparsify_(model)
        assert {f"model.layers.{i}.{MOE[family]}.experts.{e}.{m}" for i in range(2) for e in range(4)
                for m in ("gate_up_proj", "down_proj")} <= set(replaced)
        assert all(isinstance(_experts(block, family), SparseExperts) for block in decoder_blocks(model))
        assert not any(p.dim() == 3 for p in model.parameters())
        sparse_logits = model(input_ids=TOKENS).logits
        torch.testing.assert_close(sparse_logits, logits, rtol=1e-4, atol=1e-4)
        pyprune.save(model, None, str(tmp_path / "sparse-form"), report)
        loaded, _ = pyprune.load(str(tmp_path / "sparse-form"))
        assert isinstance(_experts(decoder_blocks(loaded)[0], family), SparseExperts)
        assert torch.equal(loaded(input_ids=TOKENS).logits, sparse_logits)
    assert densify_(model) == replaced
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_block_training_trains_the_kept_expert_weights_and_keeps_exact_2_4(family, tiny):
    """SAFE⁺ (an optimiser over each block's weights, the expert matrices among them) runs through both
    layouts: every expert matrix is exactly 2:4 after, and its kept weights moved."""
    model = tiny(family)
    dense = {e: _weights(_experts(block, family), "down_proj").clone() for e, block in enumerate(decoder_blocks(model))}
    report = pyprune.prune(model, "safe+", "2:4", TOKENS[:4], batch_size=2, progress=False, epochs=1)
    assert report["nm_valid"]["2:4"]
    for index, block in enumerate(decoder_blocks(model)):
        down = _weights(_experts(block, family), "down_proj")
        assert bool(((down != 0).reshape(-1, 4).sum(dim=1) == 2).all())
        assert not torch.equal(down[down != 0], dense[index][down != 0])
