"""Block anatomy per dense family (pyprune.nn.families): matched by the modules a block has, its
linears agree with transformers' own tensor-parallel plan, and removing attention heads and MLP
channels physically gives the logits of the model with them masked (zeroed)."""
import copy

import pytest
import torch

from pyprune.nn import compact, layout
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_decoder

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "exaone4", "cohere", "opt",
         "gpt_neox")
FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma2": "gemma",
          "gemma3": "gemma", "phi3": "phi3", "glm4": "glm4", "exaone4": "olmo2", "cohere": "cohere", "opt": "opt",
          "gpt_neox": "gpt_neox"}


def tiny(family, **kwargs):
    return tiny_decoder(family, **kwargs)


@pytest.mark.parametrize("family", DENSE)
def test_each_dense_family_is_described(family):
    model = tiny(family, layers=1)
    block = engine.decoder_blocks(model)[0]
    described = layout.check_block(block)
    assert described.name == FAMILY[family]
    sizes = layout.block_layout(block)
    config = model.config
    assert sizes["heads"] == config.num_attention_heads
    assert sizes["kv_heads"] == getattr(config, "num_key_value_heads", config.num_attention_heads)
    assert sizes["head_dim"] == getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert sizes["intermediate"] == getattr(config, "intermediate_size", getattr(config, "ffn_dim", None))
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if plan:  # transformers' own plan: colwise linears read the hidden stream, rowwise ones write it
        linears = {key.split("layers.*.", 1)[1]: style for key, style in plan.items() if "layers.*." in key
                   and style.startswith(("colwise", "rowwise"))}
        assert {n for n, s in linears.items() if s.startswith("colwise")} == set(described.hidden_readers)
        assert {n for n, s in linears.items() if s.startswith("rowwise")} == set(described.hidden_writers)


@pytest.mark.parametrize("family", ("mixtral", "qwen2_moe"))
def test_moe_blocks_are_refused_in_one_line(family):
    block = engine.decoder_blocks(tiny(family, layers=1))[0]
    with pytest.raises(ValueError, match="mixture-of-experts") as info:
        layout.check_block(block, "block 0")
    assert "\n" not in str(info.value)


def test_a_block_of_no_family_names_what_it_misses():
    block = engine.decoder_blocks(tiny("llama", layers=1))[0]
    del block.mlp.up_proj
    with pytest.raises(ValueError, match=r"nearest family llama misses mlp.up_proj \(") as info:
        layout.check_block(block)
    assert "\n" not in str(info.value)


def _masked(model, kept):
    """Copy of ``model`` whose removed query heads (their output-linear columns) and MLP channels
    (their MLP-output columns) are zeroed: what they contribute to the hidden stream is gone."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for block, (q_kept, _, ch_kept) in zip(engine.decoder_blocks(model), kept):
            family = layout.check_block(block)
            heads, _, hd = layout.head_counts(family, block)
            out = block.get_submodule(family.attention_output).weight
            for h in set(range(heads)) - set(q_kept):
                out[:, h * hd:(h + 1) * hd] = 0
            down = block.get_submodule(family.mlp_out).weight
            for c in set(range(down.shape[1])) - set(ch_kept):
                down[:, c] = 0
    return model


def _selection(family, channels=128):
    """Per layer (query heads, key/value heads, MLP channels) to keep: GQA-valid, down to one KV head."""
    if family in ("opt", "gpt_neox"):
        heads_kept = [([0, 2, 3], [0, 2, 3]), ([1], [1]), ([0, 1, 2, 3], [0, 1, 2, 3])]
    else:
        heads_kept = [([0, 2], [0, 1]), ([2, 3], [1]), ([0, 1, 2, 3], [0, 1])]
    g = torch.Generator().manual_seed(3)
    chans = [sorted(torch.randperm(channels, generator=g)[:n].tolist()) for n in (100, 7, channels)]
    return [(q, kv, ch) for (q, kv), ch in zip(heads_kept, chans)]


@pytest.mark.parametrize("family", DENSE)
def test_removing_heads_and_channels_equals_masking(family):
    model = tiny(family, layers=3)
    kept = _selection(family)
    reference = _masked(model, kept)
    for block, (q, kv, ch) in zip(engine.decoder_blocks(model), kept):
        compact.keep_attention_heads_(block, q, kv)
        compact.keep_mlp_channels_(block, ch)
    sizes = [layout.block_layout(block) for block in engine.decoder_blocks(model)]
    assert [(s["heads"], s["kv_heads"], s["intermediate"]) for s in sizes] == \
        [(len(q), len(kv), len(ch)) for q, kv, ch in kept]
    tokens = random_tokens((2, 20), seed=5)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in reference.parameters())
    torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits,
                               rtol=1e-5, atol=1e-5)


def test_fused_interleaved_qkv_keeps_whole_heads():
    """GPT-NeoX's query_key_value holds [q k v] per head: keeping heads 1 and 3 keeps those rows."""
    block = engine.decoder_blocks(tiny("gpt_neox", layers=1))[0]
    weight = block.attention.query_key_value.weight.detach().clone()
    compact.keep_attention_heads_(block, [1, 3], [1, 3])
    torch.testing.assert_close(block.attention.query_key_value.weight,
                               torch.cat([weight[48:96], weight[144:192]]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="key/value heads \\[0\\], which are not kept"):
        compact.keep_attention_heads_(block, [0], [1])  # a head is its own key/value head


def test_fused_stacked_qkv_and_gate_up_keep_their_parts():
    """Phi-3's qkv_proj is [q | k | v] and gate_up_proj [gate | up]: each part loses the same heads/channels."""
    block = engine.decoder_blocks(tiny("phi3", layers=1))[0]
    qkv = block.self_attn.qkv_proj.weight.detach().clone()
    gate_up = block.mlp.gate_up_proj.weight.detach().clone()
    compact.keep_attention_heads_(block, [2, 3], [1])
    compact.keep_mlp_channels_(block, [5, 0])
    torch.testing.assert_close(block.self_attn.qkv_proj.weight,
                               torch.cat([qkv[32:64], qkv[64 + 16:64 + 32], qkv[96 + 16:96 + 32]]), rtol=0, atol=0)
    torch.testing.assert_close(block.mlp.gate_up_proj.weight, gate_up[[5, 0, 133, 128]], rtol=0, atol=0)


@pytest.mark.parametrize("family", ("phi3", "opt", "gpt_neox"))
def test_sliced_mlp_views_equal_the_compacted_mlp(family):
    """slice_mlp_channels_ (views, weights shared) computes what keep_mlp_channels_ (copies) makes."""
    from pyprune.nn import slice_mlp_channels_, unslice_
    model = tiny(family, layers=1)
    compacted = copy.deepcopy(model)
    keep = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:50]
    compact.keep_mlp_channels_(engine.decoder_blocks(compacted)[0], keep)
    slice_mlp_channels_(engine.decoder_blocks(model)[0], keep)
    tokens = random_tokens((2, 10), seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, compacted(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    assert unslice_(model) == 2


def test_a_q_norm_over_the_whole_projection_keeps_the_heads_and_loses_channels():
    """OLMo 2's q_norm and k_norm normalise every head at once: removing heads is refused naming them
    (by keep_attention_heads_ and, in one line, by a structured method), MLP channels go as in any
    family: the compacted model equals the masked one."""
    import pyprune
    from pyprune.patterns import Structured
    model = tiny("olmo2", layers=2)
    block = engine.decoder_blocks(model)[0]
    assert layout.check_block(block).name == "olmo2"
    with pytest.raises(ValueError, match=r"self_attn.q_norm has weight \(64,\) over the whole projection"):
        compact.keep_attention_heads_(block, [0, 1], [0])
    calib = random_tokens((4, 16), seed=1)
    with pytest.raises(ValueError, match="removing heads would change what it does to the others") as info:
        pyprune.prune(copy.deepcopy(model), "taylor", Structured(0.3), calib, progress=False)
    assert "\n" not in str(info.value)
    dense = copy.deepcopy(model)
    report = pyprune.prune(model, "taylor", Structured(0.3), calib, progress=False, heads=False)
    kept = [(range(4), None, sorted(set(range(128)) - set(entry["pruned_channels"]))) for entry in report["structure"]]
    assert all(entry["pruned_channels"] and not entry.get("pruned_heads") for entry in report["structure"])
    tokens = random_tokens((2, 20), seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, _masked(dense, kept)(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
