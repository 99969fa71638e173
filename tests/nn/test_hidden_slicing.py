"""keep_hidden_channels_ (DReSS's slice step) and model_cost, on tiny random Llamas and SmolLM2-135M.

The exactness tests rest on one identity. An RMSNorm over d channels whose input is zero on the
removed channels computes w·x / sqrt(Σ_K x²/d + eps); the sliced norm computes
w·x / sqrt(Σ_K x²/d' + eps) = (w·sqrt(d'/d))·x / sqrt(Σ_K x²/d + eps·d'/d). So the sliced model
equals the unsliced one after zeroing what writes to the removed channels (embedding columns,
o/down_proj rows and biases), scaling every norm's weight by sqrt(d'/d) and its eps by d'/d.
What reads the removed channels (q/k/v/gate/up/lm_head columns) then multiplies zeros.
"""
import copy
import math

import pytest
import torch
from torch import nn

import pyprune
from pyprune.nn.measure import model_cost, parameter_count
from pyprune.nn import keep_hidden_channels_, slice_mlp_channels_, sparsify_
from tests.helpers import random_tokens, tiny_llama

D = 64
CONFIGS = {
    "gqa-untied": dict(heads=4, kv_heads=2),
    "mha-tied": dict(heads=4, kv_heads=4, tie_word_embeddings=True),
    "gqa4-biases": dict(heads=8, kv_heads=2, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-3),
}
KEEPS = {
    "first-48": torch.arange(48),  # DReSS's default: drop the last quarter
    "scattered-40": torch.randperm(D, generator=torch.Generator().manual_seed(1))[:40].sort().values,
}


def _model(name, seed=0, dtype=torch.float32):
    """A tiny Llama whose every parameter is random (norm weights around 1, biases nonzero)."""
    model = tiny_llama(seed=seed, hidden=D, **CONFIGS[name])
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in pname else 0.1 * noise)
    return model.to(dtype)


def _norms(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]


def _dropped(keep, d=D):
    mask = torch.ones(d, dtype=torch.bool)
    mask[keep] = False
    return mask.nonzero().flatten()


@torch.no_grad()
def _zero_writers_(model, drop):
    """Zero everything that writes to the channels ``drop`` of the residual stream."""
    model.model.embed_tokens.weight[:, drop] = 0
    for block in model.model.layers:
        for linear in (block.self_attn.o_proj, block.mlp.down_proj):
            linear.weight[drop, :] = 0
            if linear.bias is not None:
                linear.bias[drop] = 0


@torch.no_grad()
def _scale_norms_(model, ratio):
    """Every RMSNorm's weight times sqrt(ratio), its eps times ratio."""
    for norm in _norms(model):
        norm.weight.mul_(math.sqrt(ratio))
        norm.variance_epsilon *= ratio


@torch.no_grad()
def _forward(model, tokens):
    out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    return out.logits, out.hidden_states


def _sliced(model, keep):
    model = copy.deepcopy(model)
    keep_hidden_channels_(model, keep)
    return model


@pytest.mark.parametrize("keep_name", KEEPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_sliced_model_equals_zeroed_model_with_rescaled_norms(config, keep_name):
    model, keep = _model(config), KEEPS[keep_name]
    drop, ratio = _dropped(keep), keep.numel() / D
    tokens = random_tokens((2, 12), vocab=model.config.vocab_size, seed=3)
    logits, hidden = _forward(_sliced(model, keep), tokens)

    reference = copy.deepcopy(model)
    _zero_writers_(reference, drop)
    naive_logits, _ = _forward(reference, tokens)
    _scale_norms_(reference, ratio)
    ref_logits, ref_hidden = _forward(reference, tokens)

    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert len(hidden) == len(ref_hidden) == model.config.num_hidden_layers + 1
    for h, ref in zip(hidden, ref_hidden):
        assert torch.equal(ref[..., drop], torch.zeros_like(ref[..., drop]))
        torch.testing.assert_close(h, ref[..., keep], rtol=1e-5, atol=1e-5)
    # the norm rescale is what makes them equal: without it the logits are far apart
    assert (naive_logits - logits).abs().max() > 1e-2


@pytest.mark.parametrize("config", CONFIGS)
def test_slicing_zero_channels_changes_only_the_norm_statistic(config):
    """Channels that are zero everywhere (written, read, norm entries): slicing them removes
    nothing the model uses, except that each RMSNorm now averages over d' channels, not d;
    scaling the sliced norms' weights by sqrt(d/d') and eps by d/d' restores the logits."""
    keep = KEEPS["first-48"]
    drop, ratio = _dropped(keep), keep.numel() / D
    model = _model(config)
    _zero_writers_(model, drop)
    with torch.no_grad():
        for block in model.model.layers:
            for linear in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj,
                           block.mlp.gate_proj, block.mlp.up_proj):
                linear.weight[:, drop] = 0
        model.lm_head.weight[:, drop] = 0
        for norm in _norms(model):
            norm.weight[drop] = 0
    tokens = random_tokens((2, 12), vocab=model.config.vocab_size, seed=4)
    expected, _ = _forward(model, tokens)
    sliced = _sliced(model, keep)
    logits, _ = _forward(sliced, tokens)
    assert (logits - expected).abs().max() > 1e-2
    _scale_norms_(sliced, 1 / ratio)
    logits, _ = _forward(sliced, tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
def test_every_hidden_tensor_is_sliced_and_nothing_else_changes(config, dtype):
    model = _model(config, dtype=dtype).train()
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    heads, kv_heads, head_dim = (model.config.num_attention_heads, model.config.num_key_value_heads,
                                 model.config.head_dim)
    keep = KEEPS["scattered-40"]

    keep_hidden_channels_(model, keep)

    after = model.state_dict()
    assert set(after) == set(before)
    for name, old in before.items():
        new = after[name]
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight" or \
                any(name.endswith(f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            expected = old[:, keep]
        elif "norm" in name or any(name.endswith(f"{n}.{p}") for n in ("o_proj", "down_proj")
                                   for p in ("weight", "bias")):
            expected = old[keep]
        else:  # q/k/v/gate/up biases
            expected = old
        assert new.dtype == dtype and torch.equal(new, expected), name
        assert new.is_contiguous(), name
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == frozen
    assert all(m.training for m in model.modules())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.model.embed_tokens.embedding_dim == model.lm_head.in_features == 40
    for block in model.model.layers:
        assert block.hidden_size == block.mlp.hidden_size == 40
        for linear in (block.self_attn.q_proj, block.mlp.up_proj):
            assert type(linear) is nn.Linear and linear.in_features == 40
        assert block.self_attn.o_proj.out_features == block.mlp.down_proj.out_features == 40
    config_ = model.config
    assert (config_.hidden_size, config_.head_dim, config_.num_attention_heads, config_.num_key_value_heads) \
        == (40, head_dim, heads, kv_heads)
    assert config_.rms_norm_eps == CONFIGS[config].get("rms_norm_eps", 1e-6)
    assert all(norm.variance_epsilon == config_.rms_norm_eps for norm in _norms(model))
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)


def _save_with_pyprune(model, directory):
    pyprune.save(model, None, directory)


def _save_pretrained(model, directory):
    model.save_pretrained(directory)


@pytest.mark.parametrize("save", [_save_with_pyprune, _save_pretrained], ids=["pyprune.save", "save_pretrained"])
@pytest.mark.parametrize("config", ["gqa-untied", "mha-tied"])
def test_saved_slice_reloads_with_plain_from_pretrained(tmp_path, config, save):
    from transformers import AutoModelForCausalLM

    model = _sliced(_model(config), KEEPS["first-48"])
    tied = model.config.tie_word_embeddings
    save(model, tmp_path / "sliced")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sliced", local_files_only=True).eval()
    assert reloaded.config.hidden_size == 48 and reloaded.config.head_dim == 16  # not 48 // 4
    assert reloaded.model.layers[0].self_attn.q_proj.weight.shape == (64, 48)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    tokens = random_tokens((2, 10), vocab=model.config.vocab_size, seed=5)
    assert torch.equal(_forward(reloaded, tokens)[0], _forward(model, tokens)[0])
    generated = reloaded.generate(tokens, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 16)
    assert torch.equal(generated, model.generate(tokens, max_new_tokens=6, min_new_tokens=6,
                                                 do_sample=False, pad_token_id=0))
    if save is _save_with_pyprune:
        loaded, _ = pyprune.load(tmp_path / "sliced")
        assert torch.equal(_forward(loaded, tokens)[0], _forward(model, tokens)[0])


def _sparse(model):
    pyprune.prune(model, "magnitude", "2:4", None, progress=False)
    sparsify_(model)
    return model


def _sliced_mlp(model):
    slice_mlp_channels_(model.model.layers[0], torch.arange(64))
    return model


def _stale_hidden_size(model):
    model.config.hidden_size = 32
    return model


def _extra_hidden_parameter(model):
    model.model.layers[1].register_parameter("scale", nn.Parameter(torch.ones(D)))
    return model


def _untied_in_config(model):
    model.config.tie_word_embeddings = False
    return model


BAD_KEEPS = [
    ([], ValueError, "cannot keep no hidden channel"),
    ([[0, 1], [2, 3]], ValueError, "must be 1-D"),
    (torch.arange(8).float(), TypeError, "integer channel indices"),
    (torch.arange(D) < 8, TypeError, "integer channel indices"),
    (None, TypeError, "must be a 1-D tensor or sequence"),
    ([0, 0, 1, 2], ValueError, "distinct"),
    ([-1, 0, 1, 2], ValueError, "must lie in [0, 64)"),
    ([0, 1, 2, 64], ValueError, "must lie in [0, 64)"),
    ([1, 0, 2, 3], ValueError, "sorted ascending"),
    (list(range(62)), ValueError, "num_attention_heads=4"),
]
BAD_MODELS = [
    (_sparse, "SparseLinear"),
    (_sliced_mlp, "SlicedLinear"),
    (lambda model: model.model, "is not a causal LM whose hidden stream pyprune can slice"),
    (_stale_hidden_size, "hidden size 32"),
    (_extra_hidden_parameter, "does not know how to slice: ['model.layers.1.scale']"),
    (_untied_in_config, "tie_word_embeddings"),
]


def _assert_rejected_untouched(model, keep, error, message):
    state = {name: t.clone() for name, t in model.state_dict().items()}
    modules = dict(model.named_modules())
    hidden = model.config.hidden_size
    with pytest.raises(error) as info:
        keep_hidden_channels_(model, keep)
    assert message in str(info.value)
    after = model.state_dict()
    assert set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
    assert dict(model.named_modules()) == modules and model.config.hidden_size == hidden


@pytest.mark.parametrize("keep, error, message", BAD_KEEPS)
def test_bad_keep_is_rejected_before_anything_changes(keep, error, message):
    _assert_rejected_untouched(_model("gqa-untied"), keep, error, message)


@pytest.mark.parametrize("break_model, message", BAD_MODELS)
def test_bad_model_is_rejected_before_anything_changes(break_model, message):
    model = break_model(_model("mha-tied"))
    _assert_rejected_untouched(model, torch.arange(48), ValueError, message)


def _removed_parameters(config, removed, biases=False):
    """Parameters that removing ``removed`` hidden channels deletes, from the config alone."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    embeddings = config.vocab_size * (1 if config.tie_word_embeddings else 2)
    per_layer = 2 * q + 2 * kv + 3 * config.intermediate_size + 2 + (2 if biases else 0)
    return removed * (embeddings + config.num_hidden_layers * per_layer + 1)


@pytest.mark.parametrize("config", CONFIGS)
def test_model_cost_before_and_after_slicing(config):
    model = _model(config)
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    linear = c.num_hidden_layers * D * (2 * q + 2 * kv + 3 * c.intermediate_size) + c.vocab_size * D
    attention = c.num_hidden_layers * 4 * q * 128
    before = model_cost(model, 128)
    assert before == {"parameters": parameter_count(model), "linear_flops_per_token": 2 * linear,
                      "attention_flops_per_token": attention, "flops_per_token": 2 * linear + attention}
    keep_hidden_channels_(model, KEEPS["first-48"])
    after = model_cost(model, 128)
    biases = bool(CONFIGS[config].get("mlp_bias"))
    assert before["parameters"] - after["parameters"] == _removed_parameters(c, 16, biases)
    assert after["linear_flops_per_token"] * D == before["linear_flops_per_token"] * 48
    assert after["attention_flops_per_token"] == attention


@pytest.mark.parametrize("seqlen, error", [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_model_cost_rejects_a_bad_seqlen(seqlen, error):
    with pytest.raises(error, match="seqlen"):
        model_cost(_model("gqa-untied"), seqlen)


@pytest.mark.slow
def test_smollm2_sliced_from_576_to_432_channels(smollm2_copy):
    model, tokenizer = smollm2_copy
    config = model.config
    assert (config.hidden_size, config.tie_word_embeddings) == (576, True)
    before = model_cost(model, 512)
    keep_hidden_channels_(model, torch.arange(432))  # DReSS's default: drop the last 25%
    after = model_cost(model, 512)
    assert before["parameters"] - after["parameters"] == _removed_parameters(config, 144) == 33_628_752
    assert after["linear_flops_per_token"] * 576 == before["linear_flops_per_token"] * 432
    assert after["attention_flops_per_token"] == before["attention_flops_per_token"]
    assert (config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads) \
        == (432, 64, 9, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = tokenizer("It is a truth universally acknowledged", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 8)
    assert int(generated.min()) >= 0 and int(generated.max()) < config.vocab_size
