"""Structured methods (Taylor, MoreauPruner) on MoE models, per-expert channel pruning
(pyprune.methods.structured): on tiny Mixtral, Qwen2-MoE, gpt-oss and Llama 4 models each expert keeps
the channels of highest Taylor score |W ⊙ ∇W| (its gate and up entries plus its down entry, computed
here by hand from the fused parameters' gradients), the same number in every expert; the pruned model
equals a from-config model of the smaller sizes holding the hand-sliced weights, and saves, loads and
reads with plain from_pretrained to the same logits. What is not supported yet is refused in one line."""
import copy

import pytest
import torch

import pyprune
from pyprune.nn.anatomy import decoder_blocks
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder

FAMILIES = ("mixtral", "qwen2_moe", "gpt_oss", "llama4")
MOE = {"llama4": "feed_forward"}
#: the config fields of the experts' and the shared expert's channels
FIELDS = {"mixtral": ("intermediate_size", None), "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
          "gpt_oss": ("intermediate_size", None), "llama4": ("intermediate_size", "intermediate_size")}
TOKENS = random_tokens((4, 24))



def _positions(family, matrix, kept, intermediate):
    """Where expert channels ``kept`` sit along the channel axis of ``matrix``, written out per family:
    gpt-oss interleaves gate and up (2c, 2c+1), the others stack the gate half over the up half."""
    if matrix == "down_proj":
        return kept
    if family == "gpt_oss":
        return torch.stack((2 * kept, 2 * kept + 1), dim=-1).flatten()
    return torch.cat((kept, intermediate + kept))


def _channel_axis(family, matrix):
    """The axis of an expert's [.., ..] matrix (or bias) that indexes the channels."""
    transposed = family in ("gpt_oss", "llama4")
    return {"gate_up_proj": 1 if transposed else 0, "down_proj": 0 if transposed else 1, "gate_up_proj_bias": 0}[matrix]


def _moe(block, family):
    return block.get_submodule(MOE.get(family, "mlp"))


def _taylor_by_hand(model, family):
    """Per block: each expert's channel scores [E, I] and the shared expert's [I], from |W ⊙ ∇W| of the
    mean loss over TOKENS (one batch)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    model(input_ids=TOKENS, labels=TOKENS, use_cache=False).loss.backward()
    scores = []
    for block in decoder_blocks(model):
        moe = _moe(block, family)
        experts = moe.experts
        intermediate = experts.down_proj.shape[1 if family in ("gpt_oss", "llama4") else 2]
        per_expert = torch.zeros(experts.gate_up_proj.shape[0], intermediate, dtype=torch.float64)
        matrices = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias",) if family == "gpt_oss" else ())
        for matrix in matrices:
            param = getattr(experts, matrix)
            axis = _channel_axis(family, matrix)
            score = (param * param.grad).abs().double()  # [E, ...]: summed over the other axis of each expert
            totals = score.sum(dim=2 - axis) if score.dim() == 3 else score
            for c in range(intermediate):
                at = _positions(family, matrix.replace("_bias", ""), torch.tensor([c]), intermediate)
                per_expert[:, c] += totals[:, at].sum(dim=1)
        shared = None
        if hasattr(moe, "shared_expert"):
            mlp = moe.shared_expert
            shared = sum(((lin.weight * lin.weight.grad).abs().double().sum(dim=dim))
                         for lin, dim in ((mlp.gate_proj, 1), (mlp.up_proj, 1), (mlp.down_proj, 0)))
        scores.append((per_expert, shared))
    return scores


def _top(scores, ratio):
    keep = round((1 - ratio) * scores.numel())
    return torch.sort(scores, descending=True, stable=True).indices[:keep].sort().values


def _hand_pruned(dense, family, kept, shared_kept):
    """A from-config model of the smaller sizes loaded with the dense weights sliced by hand."""
    config = copy.deepcopy(dense.config)
    expert_field, shared_field = FIELDS[family]
    setattr(config, expert_field, kept[0].shape[1])
    if shared_field:
        setattr(config, shared_field, shared_kept[0].numel())
    reference = type(dense)(config).eval()
    state = dense.state_dict()
    moe = MOE.get(family, "mlp")
    for layer in range(len(kept)):
        prefix = f"model.layers.{layer}.{moe}"
        intermediate = dense.get_submodule(f"{prefix}.experts").down_proj.shape[
            1 if family in ("gpt_oss", "llama4") else 2]
        for matrix in ("gate_up_proj", "down_proj", "gate_up_proj_bias"):
            name = f"{prefix}.experts.{matrix}"
            if name not in state:
                continue
            axis = _channel_axis(family, matrix)
            state[name] = torch.stack([state[name][e].index_select(
                axis, _positions(family, matrix.replace("_bias", ""), kept[layer][e], intermediate))
                for e in range(kept[layer].shape[0])])
        if shared_field:
            for matrix, axis in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                name = f"{prefix}.shared_expert.{matrix}.weight"
                state[name] = state[name].index_select(axis, shared_kept[layer])
    reference.load_state_dict(state, strict=True)
    return reference


@pytest.mark.parametrize("family", FAMILIES)
def test_taylor_keeps_each_experts_best_channels_and_equals_the_hand_sliced_model(family, tiny_copy, tmp_path):
    from transformers import AutoModelForCausalLM
    dense = tiny_copy(family)
    model = copy.deepcopy(dense)
    report = pyprune.prune(model, "taylor", Structured(0.25), TOKENS, batch_size=4, progress=False, heads=False)
    kept, shared_kept = [], []
    for layer, (per_expert, shared) in enumerate(_taylor_by_hand(dense, family)):
        expected = torch.stack([_top(row, 0.25) for row in per_expert])
        entry = report["structure"][layer]
        assert entry["layer"] == layer and entry["channels"] == expected.shape[1]
        assert entry["pruned_channels"] == [sorted(set(range(per_expert.shape[1])) - set(row.tolist()))
                                            for row in expected]
        assert len({tuple(row) for row in entry["pruned_channels"]}) > 1  # the experts keep different channels
        kept.append(expected)
        if shared is not None:
            shared_kept.append(_top(shared, 0.25))
            assert entry["pruned_shared_channels"] == sorted(set(range(shared.numel())) - set(shared_kept[-1].tolist()))
    reference = _hand_pruned(dense, family, kept, shared_kept)
    assert report["config_compatible"] and report["parameters_after"] < report["parameters_before"]
    with torch.no_grad():
        logits = model(input_ids=TOKENS, use_cache=False).logits
        assert torch.equal(logits, reference(input_ids=TOKENS, use_cache=False).logits)
        pyprune.save(model, None, str(tmp_path / "pruned"), report)
        loaded, _ = pyprune.load(str(tmp_path / "pruned"))
        assert torch.equal(loaded(input_ids=TOKENS, use_cache=False).logits, logits)
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pruned")).eval()
        assert torch.equal(plain(input_ids=TOKENS, use_cache=False).logits, logits)


def test_moreau_prunes_expert_channels_to_the_same_sizes(tiny_copy):
    """MoreauPruner scores through the same grouping: every expert keeps 3/4 of its channels."""
    model = tiny_copy("qwen2_moe")
    report = pyprune.prune(model, "moreau", Structured(0.25), TOKENS, batch_size=4, progress=False, heads=False)
    experts = decoder_blocks(model)[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 96, 64) and experts.down_proj.shape == (4, 64, 48)
    assert model.config.moe_intermediate_size == 48 and model.config.shared_expert_intermediate_size == 48
    assert all(entry["channels"] == 48 for entry in report["structure"])


@pytest.mark.parametrize("options,refusal", [
    ({}, r"^method 'taylor' prunes an MoE model's expert channels only: pass heads=False"),
    ({"heads": False, "structure": "hidden"}, None),  # refused by the option check first (structure='hidden' ...)
    ({"heads": False, "first_layer": 1}, r"^method 'taylor' prunes the expert channels of every layer of an MoE "
                                         r"model .*first_layer=1"),
])
def test_what_is_not_supported_on_an_moe_model_is_refused_untouched(options, refusal, tiny_copy):
    model = tiny_copy("mixtral")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=refusal or r"structure='hidden'") as info:
        pyprune.prune(model, "taylor", Structured(0.25), TOKENS, progress=False, **options)
    assert "\n" not in str(info.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_hybrid_moe_model_with_heads_is_refused_by_its_mixer():
    with pytest.raises(ValueError, match=r"model.layers.0 .*mixes tokens with linear_attn .*pass heads=False"):
        pyprune.prune(tiny_decoder("qwen3_next", layers=2), "taylor", Structured(0.25), TOKENS, progress=False)
