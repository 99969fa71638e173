"""REAP (pyprune.methods.reap) on tiny random MoE models of the four expert layouts' families: its
saliency equals a direct computation from the fused weights (Mixtral's softmax-renormalised top-k,
Llama 4's sigmoid-prescaled tokens), the pruned model equals a model built from a config with fewer
experts holding the kept experts' slices and router rows, and it saves, loads and reads with plain
from_pretrained to the same logits. SLEB removes whole blocks of an MoE model."""
import copy

import pytest
import torch
import torch.nn.functional as F

import pyprune
from pyprune.nn.anatomy import decoder_blocks
from pyprune.nn.experts import routers
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder

FAMILIES = ("mixtral", "qwen2_moe", "gpt_oss", "llama4")
MOE = {"llama4": "feed_forward"}  #: where a family's block keeps its experts and router (default: mlp)
TOKENS = random_tokens((4, 24))



def _moe(model, index, family):
    return decoder_blocks(model)[index].get_submodule(MOE.get(family, "mlp"))


def _moe_inputs(model, family):
    """The hidden states entering each block's MoE module ([tokens, H]) in the dense model's forward."""
    seen = {}
    handles = [_moe(model, i, family).register_forward_pre_hook(
        lambda module, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i in range(len(decoder_blocks(model)))]
    with torch.no_grad():
        model(input_ids=TOKENS, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


def _expert(x, gate_up, down):
    """Mixtral's expert by hand: down(silu(gate) · up), gate_up [2I, H], down [H, I]."""
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


@pytest.mark.parametrize("family", ["mixtral", "llama4"])
def test_saliency_is_the_mean_routed_gate_times_the_expert_output_norm(family, tiny_copy):
    """S_j = mean over the tokens routed to j of g_j(x)·‖f_j(x)‖ (Mixtral: softmax, top-2, renormalised);
    Llama 4: ‖f_j(σ(logit)·x)‖ over the tokens whose top-1 is j (its experts see prescaled tokens)."""
    model = tiny_copy(family)
    inputs = _moe_inputs(model, family)
    report = pyprune.prune(copy.deepcopy(model), "reap", Structured(0.25), TOKENS, batch_size=2, progress=False)
    for entry in report["experts_modules"]:
        moe, x = _moe(model, entry["layer"], family), inputs[entry["layer"]].double()
        router = moe.gate.weight if family == "mixtral" else moe.router.weight
        logits = x @ router.double().t()
        if family == "mixtral":
            weights, chosen = torch.topk(logits.softmax(dim=-1), 2, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            weights, chosen = torch.topk(logits, 1, dim=-1)
            weights = torch.sigmoid(weights)
        sums, counts = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        for j in range(4):
            token, position = torch.where(chosen == j)
            weight = weights[token, position, None]
            gate_up, down = moe.experts.gate_up_proj[j].double(), moe.experts.down_proj[j].double()
            if family == "mixtral":
                norms = weight[:, 0] * _expert(x[token], gate_up, down).norm(dim=-1)
            else:  # stored [H, 2I] and [I, H]; the token enters scaled
                norms = _expert(weight * x[token], gate_up.t(), down.t()).norm(dim=-1)
            sums[j], counts[j] = norms.sum(), token.numel()
        expected = sums / counts.clamp(min=1)
        assert entry["routed_tokens"] == counts.long().tolist()
        torch.testing.assert_close(torch.tensor(entry["saliency"], dtype=torch.float64), expected,
                                   rtol=1e-4, atol=1e-7)
        lowest = torch.sort(expected, stable=True).indices[:1].tolist()
        assert entry["removed_experts"] == lowest


def _hand_removed(dense, family, removed):
    """A model built from the dense config with one expert fewer per block, holding the dense weights
    with each block's removed expert (``removed[layer]``) cut out of the fused experts and the router."""
    config = copy.deepcopy(dense.config)
    field = "num_experts" if family == "qwen2_moe" else "num_local_experts"
    setattr(config, field, getattr(config, field) - 1)
    reference = type(dense)(config).eval()
    state = dense.state_dict()
    for name, tensor in list(state.items()):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and (".experts." in name or any(
                f".{router}." in name for router in ("gate", "router"))) and "shared_expert" not in name:
            kept = [e for e in range(tensor.shape[0]) if e != removed[int(parts[2])]]
            state[name] = tensor[kept]
    reference.load_state_dict(state, strict=True)
    return reference


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pruned_model_equals_the_model_with_those_experts_cut_by_hand(family, tiny_copy, tmp_path):
    """25% of 4 experts: one per block goes; the logits equal a from-config model holding the kept
    slices (so the router's top-k and renormalisation run over the kept experts), and pyprune.save ->
    pyprune.load and plain from_pretrained give them again."""
    from transformers import AutoModelForCausalLM
    dense = tiny_copy(family)
    model = copy.deepcopy(dense)
    report = pyprune.prune(model, "reap", Structured(0.25), TOKENS, batch_size=2, progress=False)
    removed = {entry["layer"]: entry["removed_experts"][0] for entry in report["experts_modules"]}
    assert report["experts"] == [4, 3] and sorted(removed) == [0, 1]
    assert all(len(entry["removed_experts"]) == 1 for entry in report["experts_modules"])
    reference = _hand_removed(dense, family, removed)
    with torch.no_grad():
        logits = model(input_ids=TOKENS, use_cache=False).logits
        torch.testing.assert_close(logits, reference(input_ids=TOKENS, use_cache=False).logits, rtol=1e-5,
                                   atol=1e-5)
        for block in decoder_blocks(model):
            router = next(iter(routers(block).values()))
            assert router.weight.shape[0] == 3 and getattr(router, "num_experts", 3) == 3
        assert report["parameters_after"] < report["parameters_before"]
        pyprune.save(model, None, str(tmp_path / "reap"), report)
        loaded, _ = pyprune.load(str(tmp_path / "reap"))
        assert torch.equal(loaded(input_ids=TOKENS, use_cache=False).logits, logits)
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "reap")).eval()
        torch.testing.assert_close(plain(input_ids=TOKENS, use_cache=False).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio,refusal", [
    (0.75, r"ratio 0.75 of the 4 experts of MixtralConfig keeps 1; .*top-2 \(ratio in \(0.125, 0.625\]\)"),
    (0.1, r"ratio 0.1 of the 4 experts of MixtralConfig keeps 4"),
])
def test_a_ratio_that_keeps_all_experts_or_fewer_than_top_k_is_refused_untouched(ratio, refusal, tiny_copy):
    model = tiny_copy("mixtral")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=refusal) as info:
        pyprune.prune(model, "reap", Structured(ratio), TOKENS, progress=False)
    assert "\n" not in str(info.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_dense_model_is_refused():
    with pytest.raises(ValueError, match=r"method 'reap' removes experts of MoE blocks; LlamaConfig has none"):
        pyprune.prune(tiny_decoder("llama", layers=1), "reap", Structured(0.25), TOKENS, progress=False)


def test_sleb_removes_whole_blocks_of_an_moe_model(tmp_path):
    """SLEB's blocks carry their experts: on a 3-block Llama 4 it removes one, and plain from_pretrained
    reads the result (its config lists its MoE blocks by index, renumbered)."""
    from transformers import AutoModelForCausalLM
    model = tiny_decoder("llama4", layers=3)
    report = pyprune.prune(model, "sleb", Structured(0.34), TOKENS, batch_size=2, progress=False)
    assert len(report["removed_blocks"]) == 1 and len(decoder_blocks(model)) == 2
    assert model.config.moe_layers == [0, 1]
    pyprune.save(model, None, str(tmp_path / "sleb"), report)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sleb")).eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=TOKENS).logits, model(input_ids=TOKENS).logits)
