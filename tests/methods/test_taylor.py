"""Taylor structured pruning (LLM-Pruner) and physical compaction on tiny random Llamas."""
import copy
import itertools

import pytest
import torch
from torch import nn

import pyprune
from pyprune.runtime import engine
from pyprune.methods.structured import keep_heads
from pyprune.methods.taylor import Taylor, group_scores
from pyprune.nn import compact
from pyprune.patterns import Structured, Unstructured
from tests.helpers import random_tokens, tiny_llama


def _llama(layers=3, hidden=64, heads=8, kv_heads=4, intermediate=128, seed=0):
    return tiny_llama(seed=seed, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                      kv_heads=kv_heads)


def _calib(n=4, seqlen=16, seed=0):
    return random_tokens((n, seqlen), seed=seed)


def _grads(model, calib):
    engine.accumulate_gradients(model, calib, batch_size=8, progress=False)


def _brute_scores(block):
    """Group importance by hand from W and its gradient, in fp64."""
    attn, mlp = block.self_attn, block.mlp
    hd = attn.head_dim

    def s(linear):
        return (linear.weight.detach().double() * linear.weight.grad.double()).abs()

    q, k, v, o = s(attn.q_proj), s(attn.k_proj), s(attn.v_proj), s(attn.o_proj)
    gate, up, down = s(mlp.gate_proj), s(mlp.up_proj), s(mlp.down_proj)
    heads = [float(q[h * hd:(h + 1) * hd].sum() + o[:, h * hd:(h + 1) * hd].sum())
             for h in range(q.shape[0] // hd)]
    kv_heads = [float(k[j * hd:(j + 1) * hd].sum() + v[j * hd:(j + 1) * hd].sum())
                for j in range(k.shape[0] // hd)]
    channels = [float(gate[c].sum() + up[c].sum() + down[:, c].sum()) for c in range(gate.shape[0])]
    return {"heads": torch.tensor(heads), "kv_heads": torch.tensor(kv_heads),
            "channels": torch.tensor(channels)}


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 4), (4, 4)])
def test_group_scores_equal_brute_force(heads, kv_heads):
    model = _llama(heads=heads, kv_heads=kv_heads)
    _grads(model, _calib())
    for block in model.model.layers:
        got, expected = group_scores(block), _brute_scores(block)
        for key in expected:
            assert got[key].dtype == torch.float32
            torch.testing.assert_close(got[key].double(), expected[key].double(), rtol=1e-5, atol=1e-9)


def _best_gqa_selection(q, kv, n_groups, per_group):
    """Brute force over every choice of ``n_groups`` KV groups and ``per_group`` query heads in each:
    the one with the largest retained importance."""
    n_kv = kv.numel()
    g = q.numel() // n_kv
    best = None
    for groups in itertools.combinations(range(n_kv), n_groups):
        for picks in itertools.product(*(itertools.combinations(range(j * g, (j + 1) * g), per_group)
                                         for j in groups)):
            total = sum(float(kv[j]) for j in groups) + sum(float(q[h]) for p in picks for h in p)
            if best is None or total > best[0] + 1e-12:
                best = (total, sorted(h for p in picks for h in p), list(groups))
    return best[1], best[2]


def test_prune_keeps_the_highest_scoring_heads_and_channels():
    calib = _calib()
    model = _llama()  # 8 heads / 4 KV heads (groups of 2), head_dim 8, 128 channels
    dense = copy.deepcopy(model)
    _grads(dense, calib)
    scores = [group_scores(block) for block in dense.model.layers]
    params_before = sum(p.numel() for p in model.parameters())

    report = pyprune.prune(model, "taylor", Structured(0.25), calib, progress=False)

    hd, hidden = 8, 64
    for index, (block, old) in enumerate(zip(model.model.layers, dense.model.layers)):
        s = scores[index]
        # 6 of 8 query heads kept: only 3 KV groups of 2 is GQA-valid (at most 2 per group)
        q_kept, kv_kept = _best_gqa_selection(s["heads"], s["kv_heads"], 3, 2)
        channels = torch.sort(s["channels"], descending=True, stable=True).indices[:96].sort().values
        entry = report["structure"][index]
        assert entry["kept_heads"] == q_kept and entry["kept_kv_heads"] == kv_kept
        assert (entry["heads"], entry["kv_heads"], entry["channels"]) == (6, 3, 96)
        attn, mlp = block.self_attn, block.mlp
        assert attn.num_key_value_groups == 2
        q_rows = torch.tensor([h * hd + i for h in q_kept for i in range(hd)])
        kv_rows = torch.tensor([j * hd + i for j in kv_kept for i in range(hd)])
        assert torch.equal(attn.q_proj.weight, old.self_attn.q_proj.weight[q_rows])
        assert torch.equal(attn.k_proj.weight, old.self_attn.k_proj.weight[kv_rows])
        assert torch.equal(attn.v_proj.weight, old.self_attn.v_proj.weight[kv_rows])
        assert torch.equal(attn.o_proj.weight, old.self_attn.o_proj.weight[:, q_rows])
        assert torch.equal(mlp.gate_proj.weight, old.mlp.gate_proj.weight[channels])
        assert torch.equal(mlp.up_proj.weight, old.mlp.up_proj.weight[channels])
        assert torch.equal(mlp.down_proj.weight, old.mlp.down_proj.weight[:, channels])
        assert list(attn.o_proj.weight.shape) == [hidden, 48]
        # nothing kept should score below anything removed
        removed = sorted(set(range(128)) - set(channels.tolist()))
        assert s["channels"][channels].min() >= s["channels"][removed].max()

    removed_per_layer = 2 * 8 * hidden + 2 * 8 * hidden + 2 * 8 * hidden + 3 * 32 * hidden
    #                   2 query heads (q rows + o cols), 1 KV head (k + v rows), 32 channels x 3
    params_after = params_before - 3 * removed_per_layer
    assert sum(p.numel() for p in model.parameters()) == params_after
    assert report["parameters_after"] == params_after
    assert report["sparsity"] == pytest.approx(1 - params_after / params_before)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    logits = model(input_ids=calib).logits
    assert logits.shape == (4, 16, 128) and torch.isfinite(logits).all()
    # hidden 64 is not a multiple of 6 heads: transformers 5's LlamaConfig rejects that
    assert report["config_compatible"] is False
    assert model.config.num_attention_heads == 8


def test_multi_head_attention_prunes_single_heads():
    calib = _calib()
    model = _llama(heads=4, kv_heads=4, hidden=48, intermediate=96)  # head_dim 12; 48 % 3 == 0
    dense = copy.deepcopy(model)
    _grads(dense, calib)
    report = pyprune.prune(model, "taylor", Structured(0.25), calib, progress=False)
    for index, block in enumerate(dense.model.layers):
        s = group_scores(block)
        expected = torch.sort(s["heads"] + s["kv_heads"], descending=True, stable=True).indices[:3]
        entry = report["structure"][index]
        assert entry["kept_heads"] == entry["kept_kv_heads"] == sorted(expected.tolist())
        assert model.model.layers[index].self_attn.num_key_value_groups == 1
    assert report["config_compatible"] is True
    assert (model.config.num_attention_heads, model.config.num_key_value_heads,
            model.config.intermediate_size, model.config.head_dim) == (3, 3, 72, 12)


def _zeroed(model, kept):
    """Copy of ``model`` with the removed heads/channels zeroed in place (same shapes)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for block, (q_kept, kv_kept, ch_kept) in zip(model.model.layers, kept):
            attn, mlp = block.self_attn, block.mlp
            hd = attn.head_dim
            for h in set(range(attn.q_proj.out_features // hd)) - set(q_kept):
                attn.q_proj.weight[h * hd:(h + 1) * hd] = 0
                attn.o_proj.weight[:, h * hd:(h + 1) * hd] = 0
            for j in set(range(attn.k_proj.out_features // hd)) - set(kv_kept):
                attn.k_proj.weight[j * hd:(j + 1) * hd] = 0
                attn.v_proj.weight[j * hd:(j + 1) * hd] = 0
            for c in set(range(mlp.gate_proj.out_features)) - set(ch_kept):
                mlp.gate_proj.weight[c] = 0
                mlp.up_proj.weight[c] = 0
                mlp.down_proj.weight[:, c] = 0
    return model


@pytest.mark.parametrize("heads,kv_heads,kept_heads", [
    (8, 4, [([0, 1, 4, 5, 6, 7], [0, 2, 3]), ([1, 3, 5, 7], [0, 1, 2, 3]), ([2, 3], [1])]),
    (4, 4, [([0, 2, 3], [0, 2, 3]), ([1], [1]), ([0, 1, 2, 3], [0, 1, 2, 3])]),
])
def test_removing_equals_zeroing(heads, kv_heads, kept_heads):
    torch.manual_seed(1)
    model = _llama(heads=heads, kv_heads=kv_heads)
    channels = [sorted(torch.randperm(128)[:n].tolist()) for n in (100, 7, 128)]
    kept = [(q, kv, ch) for (q, kv), ch in zip(kept_heads, channels)]
    reference = _zeroed(model, kept)
    for block, (q, kv, ch) in zip(model.model.layers, kept):
        compact.keep_attention_heads_(block, q, kv)
        compact.keep_mlp_channels_(block, ch)
    tokens = _calib(3, 20, seed=5)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in reference.parameters())
    # the same sums in a different order: equal up to fp32 rounding
    torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits,
                               rtol=1e-5, atol=1e-5)


def test_heads_or_channels_only():
    model = _llama()
    Taylor(heads=False).prune(model, Structured(0.5), _calib(), progress=False)
    for block in model.model.layers:
        assert block.self_attn.q_proj.out_features == 64 and block.mlp.gate_proj.out_features == 64
    model = _llama()
    Taylor(channels=False).prune(model, Structured(0.5), _calib(), progress=False)
    for block in model.model.layers:
        assert block.self_attn.q_proj.out_features == 32 and block.mlp.gate_proj.out_features == 128


def test_invalid_gqa_selection_is_rejected():
    model = _llama()
    block = model.model.layers[0]
    before = [p.clone() for p in block.parameters()]
    with pytest.raises(ValueError, match="same"):
        compact.keep_attention_heads_(block, [0, 1, 2], [0, 1])  # group 0 keeps 2, group 1 keeps 1
    with pytest.raises(ValueError, match="not kept"):
        compact.keep_attention_heads_(block, [0, 2], [0])  # head 2 reads KV head 1
    with pytest.raises(ValueError):
        compact.keep_mlp_channels_(block, [])
    with pytest.raises(ValueError):
        compact.keep_mlp_channels_(block, [0, 128])
    assert all(torch.equal(a, b) for a, b in zip(before, block.parameters()))


def test_uniform_is_config_compatible():
    calib = _calib()
    model = _llama(hidden=96)  # 8 heads / 4 KV heads of 12; 96 % 6 == 0
    tokens = _calib(2, 12, seed=3)
    report = pyprune.prune(model, "taylor", Structured(0.25, uniform=True), calib, progress=False)
    assert report["config_compatible"] is True
    assert report["pattern"] == "structured 0.25 uniform"
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
            config.head_dim) == (6, 3, 96, 12)
    for entry in report["structure"]:
        groups = {h // 2 for h in entry["kept_heads"]}
        assert groups == set(entry["kept_kv_heads"])  # whole KV groups
    rebuilt = type(model)(copy.deepcopy(config)).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(rebuilt(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_uniform_snaps_heads_to_counts_the_config_accepts():
    model = _llama(hidden=64)  # 6 heads would not divide hidden 64: keep 8 (nearest valid, larger)
    report = pyprune.prune(model, "taylor", Structured(0.25, uniform=True), _calib(), progress=False)
    assert report["config_compatible"] is True
    assert {(e["heads"], e["kv_heads"], e["channels"]) for e in report["structure"]} == {(8, 4, 96)}
    model = _llama(hidden=64)
    report = pyprune.prune(model, "taylor", Structured(0.5, uniform=True), _calib(), progress=False)
    assert {(e["heads"], e["kv_heads"], e["channels"]) for e in report["structure"]} == {(4, 2, 64)}
    assert model.config.num_attention_heads == 4


def test_layer_range_leaves_other_layers_dense():
    model = _llama(hidden=96)
    report = pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False,
                           first_layer=1, last_layer=-1)
    shapes = [(e["pruned"], e["heads"], e["channels"]) for e in report["structure"]]
    assert shapes == [(False, 8, 128), (True, 6, 96), (True, 6, 96)]
    assert report["config_compatible"] is False
    assert model.config.num_attention_heads == 8 and model.config.intermediate_size == 128
    assert torch.isfinite(model(input_ids=_calib()).logits).all()


def test_keep_heads_rule():
    q = torch.tensor([5.0, 1.0, 4.0, 3.0, 0.5, 0.2, 9.0, 0.1, 2.0])  # 9 heads, 3 KV groups of 3
    kv = torch.tensor([1.0, 1.0, 1.0])
    # 20% of 9: keep round(7.2) = 7, not reachable; 6 is nearest: 3 groups x 2 or 2 groups x 3
    q_kept, kv_kept = keep_heads(q, kv, 0.2, uniform=False)
    assert (q_kept.tolist(), kv_kept.tolist()) == _best_gqa_selection(q, kv, 3, 2) \
        or (q_kept.tolist(), kv_kept.tolist()) == _best_gqa_selection(q, kv, 2, 3)
    assert len(q_kept) == 6
    q_kept, kv_kept = keep_heads(q, kv, 0.2, uniform=True)  # round(2.4) = 2 whole groups
    assert (q_kept.tolist(), kv_kept.tolist()) == ([0, 1, 2, 6, 7, 8], [0, 2])
    q_kept, kv_kept = keep_heads(q, kv, 0.0, uniform=False)
    assert len(q_kept) == 9 and len(kv_kept) == 3
    q_kept, kv_kept = keep_heads(q, kv, 0.99, uniform=False)
    assert len(q_kept) == 1 and len(kv_kept) == 1


def test_ratio_zero_changes_nothing():
    model = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = pyprune.prune(model, "taylor", Structured(0.0), _calib(), progress=False)
    assert report["sparsity"] == 0 and report["config_compatible"] is True
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_bf16_model():
    model = _llama().to(torch.bfloat16)
    report = pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False)
    assert report["structure"][0]["channels"] == 96
    assert model.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(model(input_ids=_calib()).logits.float()).all()


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(8, 4)


class _OtherBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4))])


@pytest.mark.parametrize("bad", [_NoBlocks, _OtherBlocks])
def test_model_without_expected_blocks_is_a_one_line_error(bad):
    with pytest.raises(ValueError) as info:
        pyprune.prune(bad(), "taylor", Structured(0.2), _calib(), progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("pattern", [1.0, -0.1, 1.5, True])
def test_bad_ratio_raises(pattern):
    with pytest.raises(ValueError, match="ratio"):
        Structured(pattern)


@pytest.mark.parametrize("pattern,options,match", [
    ("2:4", {}, "supports patterns"),
    (Unstructured(0.5), {}, "supports patterns"),
    (Structured(0.2), {"first_layer": 3}, "selects no layers"),
    (Structured(0.2), {"first_layer": 2, "last_layer": 1}, "selects no layers"),
    (Structured(0.2), {"first_layer": "1"}, "first_layer"),
    (Structured(0.2), {"bogus": 1}, "has no option bogus; its options: first_layer"),
    (Structured(0.2, uniform=True), {"first_layer": 1}, "every layer"),
])
def test_bad_arguments_raise_before_anything_changes(pattern, options, match):
    model = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        pyprune.prune(model, "taylor", pattern, _calib(), progress=False, **options)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in state.items()}
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_needs_calibration():
    with pytest.raises(ValueError, match="calibration"):
        pyprune.prune(_llama(), "taylor", Structured(0.2), None, progress=False)


@pytest.mark.slow
def test_smollm2_taylor_20_percent_stays_sane(smollm2_copy):
    from pyprune.inputs.data import calibration_samples, eval_tokens
    from pyprune.evaluation.perplexity import perplexity

    model, tokenizer = smollm2_copy
    source = "emma"
    calib = calibration_samples(tokenizer, source, nsamples=16, seqlen=128)
    tokens = eval_tokens(tokenizer, source, max_tokens=512 * 4)
    dense = perplexity(model, tokens, 512, progress=False)
    report = pyprune.prune(model, "taylor", Structured(0.2), calib, batch_size=8, progress=False)
    pruned = perplexity(model, tokens, 512, progress=False)
    # 9 heads in 3 KV groups: every layer keeps 2 query heads per group (6 of 9) and 80% of channels
    assert {(e["heads"], e["kv_heads"], e["channels"]) for e in report["structure"]} == {(6, 3, 1229)}
    assert report["config_compatible"] is True
    assert 0.15 < report["sparsity"] < 0.25
    # seen: dense ~30-37, pruned ~110-230 (this 135M model is fragile: random groups give ~4400,
    # the lowest-importance groups kept instead ~700000)
    assert dense < pruned < 10 * dense
