"""The structured methods' hidden-channel protocol (``structure="hidden"``, LLM-Pruner's channel-wise):
the channel score against a hand sum, the channels removed, the sliced model against the masked full one."""
import copy
import json
import math

import pytest
import torch

import pyprune
from pyprune import cli
from pyprune.methods import get
from pyprune.methods.structured import STREAM, hidden_channel_scores
from pyprune.methods.taylor import gradient_taylor_score
from pyprune.nn.layout import hidden_slices
from pyprune.patterns import Structured
from pyprune.runtime import engine
from pyprune.studies import robustness
from tests.helpers import random_tokens, tiny_decoder, tiny_llama

CHEAP = {"taylor": {}, "moreau": {"steps": 2}, "moreau-gs": {"steps": 2}, "smoothgrad": {"passes": 2}}


def _element_scores(model):
    """A distinct fixed score tensor per parameter (fp32), keyed by id."""
    gen = torch.Generator().manual_seed(1)
    return {id(p): torch.rand(p.shape, generator=gen) for p in model.parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_hidden_channel_scores_sum_every_slice_of_the_channel(tied):
    model = tiny_llama(hidden=32, heads=4, kv_heads=2, intermediate=48, tie_word_embeddings=tied,
                       attention_bias=True, mlp_bias=True)
    scores = _element_scores(model)
    s = lambda p: scores[id(p)]  # noqa: E731
    expected = torch.zeros(32, dtype=torch.float64)
    for d in range(32):
        total = s(model.model.embed_tokens.weight)[:, d].sum() + s(model.model.norm.weight)[d]
        if not tied:
            total += s(model.lm_head.weight)[:, d].sum()
        for block in model.model.layers:
            attn, mlp = block.self_attn, block.mlp
            for reader in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                total += s(reader.weight)[:, d].sum()  # input columns (their biases index outputs)
            for writer in (attn.o_proj, mlp.down_proj):
                total += s(writer.weight)[d].sum() + s(writer.bias)[d]
            total += s(block.input_layernorm.weight)[d] + s(block.post_attention_layernorm.weight)[d]
        expected[d] = float(total)
    got = hidden_channel_scores(model, lambda p: scores.get(id(p)))
    assert got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def _masked(model, keep):
    """``model`` with the other hidden channels zeroed where they enter the stream (embedding columns,
    o/down rows) and each RMSNorm rescaled to average over the kept channels: multiplier sqrt(d'/d)...
    exactly, sqrt(d/d')·x/sqrt(mean_kept(x²) + eps) = the masked norm with eps·d'/d times sqrt(d'/d)."""
    masked = copy.deepcopy(model)
    d = model.config.hidden_size
    drop = torch.tensor(sorted(set(range(d)) - set(keep.tolist())))
    ratio = keep.numel() / d
    with torch.no_grad():
        masked.model.embed_tokens.weight[:, drop] = 0
        norms = [masked.model.norm]
        for block in masked.model.layers:
            block.self_attn.o_proj.weight[drop] = 0
            block.mlp.down_proj.weight[drop] = 0
            norms += [block.input_layernorm, block.post_attention_layernorm]
        for norm in norms:
            norm.weight.mul_(math.sqrt(ratio))
            norm.variance_epsilon *= ratio
    return masked


def test_taylor_hidden_removes_the_lowest_channels_and_equals_the_masked_model():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2)
    calib = random_tokens((4, 16))
    scored = copy.deepcopy(model)
    params = [p for _, p, _, _ in hidden_slices(scored)]
    with pyprune.methods.structured.gradients_for(scored, params):
        engine.accumulate_gradients(scored, calib, batch_size=8, progress=False)
        channel_scores = hidden_channel_scores(scored, gradient_taylor_score)
    lowest = sorted(torch.argsort(channel_scores.double(), stable=True)[:16].tolist())

    pruned = copy.deepcopy(model)
    method = get("taylor", structure="hidden")
    report = pyprune.prune(pruned, method, Structured(0.25), calib, progress=False)
    assert report["hidden_size"] == [64, 48] and report["pruned_hidden_channels"] == lowest
    torch.testing.assert_close(method.layer_scores[STREAM]["hidden"], channel_scores)
    keep = torch.tensor(sorted(set(range(64)) - set(lowest)))
    assert pruned.config.hidden_size == 48 and pruned.model.embed_tokens.weight.shape == (128, 48)
    assert all(e["pruned"] and e["heads"] == 4 and e["channels"] == 96 for e in report["structure"])
    tokens = random_tokens((2, 12), seed=5)
    with torch.no_grad():
        torch.testing.assert_close(pruned(tokens).logits, _masked(model, keep)(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CHEAP))
def test_every_structured_method_scores_the_hidden_stream(name, monkeypatch):
    """Each method's element scores are asked for exactly the hidden-stream parameters (embedding and
    norms included) and the channels kept are the top of the summed scores."""
    model = tiny_llama(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2)
    expected = {id(p) for _, p, _, _ in hidden_slices(model)}
    method = get(name, structure="hidden", **CHEAP[name])
    asked = []
    original = type(method).element_scores

    def spy(self, model, params, *args, **kwargs):
        asked.append({id(p) for p in params})
        return original(self, model, params, *args, **kwargs)

    monkeypatch.setattr(type(method), "element_scores", spy)
    report = pyprune.prune(model, method, Structured(0.1), random_tokens((4, 16)), progress=False)
    assert asked == [expected]
    scores = method.layer_scores[STREAM]["hidden"]
    # round(0.9·64) = 58: 56 and 60 are the nearest multiples of the 4 heads; a tie keeps more
    assert report["hidden_size"] == [64, 60]
    assert float(scores[report["pruned_hidden_channels"]].max()) <= float(
        scores[[c for c in range(64) if c not in report["pruned_hidden_channels"]]].min())


def test_gemma_hidden_prune_runs():
    model = tiny_decoder("gemma3", layers=2)
    report = pyprune.prune(model, "taylor", Structured(0.25), random_tokens((2, 16)), structure="hidden",
                           progress=False)
    assert model.config.hidden_size == 48 == report["hidden_size"][1]
    assert model(random_tokens((1, 8))).logits.shape == (1, 8, 128)


@pytest.mark.parametrize("kwargs,family,message", [
    ({}, "opt", "option structure='hidden' of method 'taylor' cannot slice this model's hidden channels: .*LayerNorm"),
    ({"first_layer": 1}, "llama", "structure='hidden' .* first_layer=1 apply to structure='groups' only"),
    ({"heads": False}, "llama", "heads=False apply to structure='groups' only"),
    ({"structure": "rows"}, "llama", "structure"),
])
def test_hidden_refusals_leave_the_model(kwargs, family, message):
    model = tiny_decoder(family, layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        pyprune.prune(model, "taylor", Structured(0.25), random_tokens((2, 16)),
                      **{"structure": "hidden", **kwargs}, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_robustness_study_compares_hidden_channels(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "robust.json"
    argv = ["robustness", "--model", str(model_dir), "--method", "taylor", "--ratio", "0.25", "--calib", str(text),
            "--nsamples", "2", "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16", "--eval-tokens", "64",
            "--structure", "hidden", "--report", str(report_path), "--quiet"]
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert set(report["spearman"]) == {"hidden"} and 0.0 <= report["agreement"] <= 1.0
    assert report["options"]["structure"] == "hidden"
    groups = robustness.pruned_groups({"structure": [], "pruned_hidden_channels": [3, 7]})
    assert groups == {(STREAM, "hidden", 3), (STREAM, "hidden", 7)}
