"""Structured pruning (Taylor; MoreauPruner shares the path) on every dense decoder family: the
compacted model gives the logits of the dense model with the pruned heads and channels masked,
and reloads with identical logits; MoE families are refused in one line before anything changes."""
import copy

import pytest
import torch

import pyprune
from pyprune.methods.taylor import Taylor
from pyprune.nn import layout
from pyprune.patterns import Structured
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_decoder

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "exaone4", "cohere", "opt",
         "gpt_neox")


def tiny(family, **kwargs):
    return tiny_decoder(family, layers=3, attn_implementation="eager" if family == "gemma2" else "sdpa", **kwargs)


def _masked(model, structure):
    """``model`` (a dense copy) with the report's pruned heads (their output-linear columns) and
    pruned MLP channels (their MLP-output columns) zeroed."""
    with torch.no_grad():
        for block, entry in zip(engine.decoder_blocks(model), structure):
            family = layout.check_block(block)
            hd = layout.head_counts(family, block)[2]
            out = block.get_submodule(family.attention_output).weight
            for h in entry.get("pruned_heads", []):
                out[:, h * hd:(h + 1) * hd] = 0
            down = block.get_submodule(family.mlp_out).weight
            down[:, entry.get("pruned_channels", [])] = 0
    return model


#: Taylor on every dense family; MoreauPruner (the same grouping and compaction) on one model of
#: each anatomy.
CASES = [(family, "taylor", {}) for family in DENSE] + [("phi3", "moreau", {"steps": 2}), ("opt", "moreau", {"steps": 2}),
                                 ("gemma3", "moreau", {"steps": 2})]


@pytest.mark.parametrize("family,method,options", CASES)
def test_compacted_model_is_the_masked_model_and_reloads(family, method, options, tmp_path):
    model = tiny(family)
    dense = copy.deepcopy(model)
    calib, tokens = random_tokens((4, 16), seed=1), random_tokens((2, 20), seed=5)
    report = pyprune.prune(model, method, Structured(0.5), calib, progress=False, **options)
    structure = report["structure"]
    assert all(e["pruned_heads"] and e["pruned_channels"] for e in structure)
    sizes = [layout.block_layout(block) for block in engine.decoder_blocks(model)]
    assert [(s["heads"], s["intermediate"]) for s in sizes] == [(e["heads"], e["channels"]) for e in structure]
    logits = model(input_ids=tokens).logits
    torch.testing.assert_close(logits, _masked(dense, structure)(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    pyprune.save(model, None, str(tmp_path / "pruned"), report)
    loaded, _ = pyprune.load(str(tmp_path / "pruned"))
    if family == "gemma2":
        loaded.config._attn_implementation = "eager"
    assert torch.equal(loaded(input_ids=tokens).logits, logits)


@pytest.mark.parametrize("family", ("phi3", "gemma3", "opt"))
def test_uniform_pruning_states_its_sizes_in_the_family_config(family):
    model = tiny(family)
    report = pyprune.prune(model, "taylor", Structured(0.5, uniform=True), random_tokens((4, 16)), progress=False)
    tokens = random_tokens((2, 12), seed=3)
    assert report["config_compatible"] is True
    config = model.config
    if family == "opt":  # its config derives head_dim = hidden // heads: heads stay, fc1/fc2 lose channels
        assert (config.num_attention_heads, config.ffn_dim) == (4, 64)
    else:
        assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 64)
    rebuilt = type(model)(copy.deepcopy(config)).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(rebuilt(input_ids=tokens).logits, model(input_ids=tokens).logits)


@pytest.mark.parametrize("family", ("mixtral", "qwen2_moe"))
def test_moe_families_refuse_head_pruning_before_the_model_is_touched(family):
    """An MoE model's expert channels are pruned (tests/methods/test_expert_channels.py), its heads not yet."""
    model = tiny_decoder(family, layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="mixture-of-experts"):  # from the config alone, before loading
        Taylor().check_config(model.config, Structured(0.5))
    with pytest.raises(ValueError, match="expert channels only: pass heads=False") as info:  # the model itself
        pyprune.prune(model, "taylor", Structured(0.5), random_tokens((4, 16)), progress=False)
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
