"""DSnoT (Zhang et al., ICLR 2024), the option ``dsnot`` of Wanda and SparseGPT: its swap rules on a
hand example, never a change of sparsity (each row's count, N:M exact), a much lower expected
reconstruction error on a real SmolLM2 layer, and tiny models of several families."""
import pytest
import torch

import pyprune
from pyprune import methods
from pyprune.methods.dsnot import InputMoments, is_attention, refine_mask
from pyprune.patterns import NM, Unstructured
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_decoder

FAMILIES = ("llama", "opt", "gemma3")


def _refine(keep, effect, nm=None, threshold=0.6, initial=None):
    ones = torch.ones(effect.shape[1])
    wanda = torch.arange(effect.shape[1], dtype=torch.float32).expand_as(effect)  # rising with the column
    return refine_mask(keep, effect, ones, wanda, wanda if initial is None else initial, nm, cycles=50,
                       threshold=threshold, var_power=1.0)


def test_a_positive_error_grows_the_largest_effect_and_prunes_the_lowest_negative_kept_weight():
    keep = torch.tensor([[True, True, False, False]])
    effect = torch.tensor([[-1.0, 2.0, 3.0, 0.5]])  # ε = 3 + 0.5 = 3.5
    # grow column 2 (effect 3, the largest), prune column 0 (effect < 0): ε = 3.5 - 1 - 3 = -0.5, within 0.6
    assert _refine(keep, effect).tolist() == [[False, True, True, False]]
    # below 0.5 the row goes on: ε < 0 grows the lowest effect left (column 3) and prunes the lowest-scored
    # kept weight of effect >= 0 (column 1): ε = -0.5 + 2 - 0.5 = 1; then no pruned weight is left to grow
    assert _refine(keep, effect, threshold=0.1).tolist() == [[False, False, True, True]]


def test_an_n_m_swap_stays_in_the_group_and_is_refused_when_the_error_changes_sign():
    keep = torch.tensor([[True, True, False, False, True, True, False, False]])
    effect = torch.tensor([[0.2, 0.1, 3.0, 0.5, 1.0, 1.0, 0.3, 0.3]])  # ε = 3 + 0.5 + 0.3 + 0.3 = 4.1
    initial = torch.tensor([[5.0, 4.0, 1.0, 1.0, 5.0, 5.0, 1.0, 1.0]])
    # grow column 2, prune the lowest initial score kept in its group (column 1): ε = 4.1 + 0.1 - 3 = 1.2 > 0
    # then grow column 3 (0.5 / 1), prune column 0 of the same group: ε = 1.2 + 0.2 - 0.5 = 0.9, and so on
    refined = _refine(keep, effect, NM(2, 4), threshold=0.1, initial=initial)
    assert refined.reshape(-1, 4).sum(-1).tolist() == [2, 2]
    assert refined[0, :4].tolist() == [False, False, True, True]
    # a growth that would turn ε negative is refused under N:M (the row stops), made when unstructured
    keep, effect = keep[:, :4], torch.tensor([[0.2, 0.1, 3.0, -0.5]])  # ε = 2.5; growing column 2 gives -0.4
    assert _refine(keep, effect, NM(2, 4), threshold=0.1, initial=initial[:, :4]).tolist() == keep.tolist()
    assert _refine(keep, effect).tolist() == [[True, False, True, False]]


@pytest.mark.parametrize("pattern", [Unstructured(0.5, "row"), Unstructured(0.7, "tensor"), NM(2, 4), NM(1, 4)])
def test_the_refinement_never_changes_a_rows_count_or_the_n_m_pattern(pattern):
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(32, 64, generator=generator)
        mean, variance = torch.randn(64, generator=generator), torch.rand(64, generator=generator) + 0.1
        scores = weight.abs() * (mean.square() + variance).sqrt()
        keep = pattern.keep_mask(scores)
        refined = refine_mask(keep, weight.double() * mean.double(), variance, scores, scores,
                              pattern if isinstance(pattern, NM) else None, cycles=50, threshold=0.0, var_power=1.0)
        assert not torch.equal(refined, keep)
        assert torch.equal(refined.sum(dim=1), keep.sum(dim=1))
        if isinstance(pattern, NM):
            assert bool((refined.reshape(32, -1, pattern.m).sum(-1) == pattern.n).all())


def test_the_moments_are_the_authors_per_sequence_statistics():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    moments = InputMoments(4, "cpu")
    moments.add(x[:2])
    moments.add(x[2:])
    exact = x.double()  # the moments sum float32 partials in float64: equal to float32 rounding
    float32 = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(moments.sequence_sum, exact.sum(dim=(0, 1)) / 3, **float32)
    torch.testing.assert_close(moments.variance, exact.var(dim=1, unbiased=False).mean(dim=0), **float32)
    torch.testing.assert_close(moments.sqnorm, exact.square().sum(dim=(0, 1)), **float32)


def test_the_attention_layers_are_told_by_name():
    assert is_attention("model.layers.3.self_attn.q_proj") and is_attention("gpt_neox.layers.0.attention.dense")
    assert not is_attention("model.layers.3.mlp.down_proj") and not is_attention("model.decoder.layers.1.fc1")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_exact_counts_and_the_refinement_changes_the_mask(family):
    calib = random_tokens((4, 16))
    for method, pattern in (("wanda", 0.5), ("sparsegpt", "2:4")):
        plain, refined = tiny_decoder(family, layers=2), tiny_decoder(family, layers=2)
        pyprune.prune(plain, method, pattern, calib, batch_size=2, progress=False, dsnot=True, dsnot_cycles=1,
                      dsnot_threshold=1e9)  # the initial mask alone: no row is above the threshold
        report = pyprune.prune(refined, method, pattern, calib, batch_size=2, progress=False, dsnot=True,
                               dsnot_threshold=0.0, dsnot_layers="all")
        changed = 0
        for before, after in zip(engine.decoder_blocks(plain), engine.decoder_blocks(refined)):
            for name, linear in engine.block_linears(after).items():
                kept = linear.weight != 0
                assert torch.equal(kept.sum(dim=1), (engine.block_linears(before)[name].weight != 0).sum(dim=1))
                changed += int((kept != (engine.block_linears(before)[name].weight != 0)).sum())
                if pattern == "2:4":
                    assert bool((kept.reshape(kept.shape[0], -1, 4).sum(-1) == 2).all())
                else:
                    assert bool((kept.sum(dim=1) == kept.shape[1] // 2).all())  # per row, as the authors
        assert changed > 0 and report["options"]["dsnot"]


def test_only_the_attention_is_refined_by_default():
    calib = random_tokens((4, 16))
    plain, refined = tiny_decoder("llama", layers=2), tiny_decoder("llama", layers=2)
    pyprune.prune(plain, "wanda", 0.5, calib, batch_size=2, progress=False, dsnot=True, dsnot_threshold=1e9)
    pyprune.prune(refined, "wanda", 0.5, calib, batch_size=2, progress=False, dsnot=True, dsnot_threshold=0.0)
    before, after = plain.model.layers[0], refined.model.layers[0]  # later blocks see other inputs
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(before.mlp, name).weight, getattr(after.mlp, name).weight)
    assert not torch.equal(before.self_attn.o_proj.weight, after.self_attn.o_proj.weight)


def test_dsnot_is_an_option_of_wanda_and_sparsegpt_only_and_checks_its_values():
    for name in ("wanda", "sparsegpt"):
        assert {"dsnot", "dsnot_cycles", "dsnot_threshold", "dsnot_var_power", "dsnot_layers"} <= \
            {option.name for option in methods.METHODS[name].options}
    assert "dsnot" not in {option.name for option in methods.METHODS["alps"].options}
    with pytest.raises(ValueError, match="option dsnot_layers of method 'wanda' must be one of attention, mlp, all"):
        methods.get("wanda", dsnot_layers="ffn")
    with pytest.raises(ValueError, match="option dsnot_cycles of method 'sparsegpt' must be >= 1"):
        methods.get("sparsegpt", dsnot_cycles=0)


@pytest.fixture(scope="module")
def smollm2_o_proj(smollm2):
    """Block 3's attention output projection of SmolLM2-135M and the moments of its inputs on 4 x 128
    tokens of Emma."""
    from pyprune.inputs import data
    model, tokenizer = smollm2
    calib = data.calibration_samples(tokenizer, "emma", nsamples=4, seqlen=128, seed=0)
    layer = model.model.layers[3].self_attn.o_proj
    moments = InputMoments(layer.in_features, "cpu")
    handle = layer.register_forward_hook(lambda module, args, output: moments.add(args[0].detach()))
    with torch.no_grad():
        model.model(input_ids=calib)  # the decoder alone: no logits needed
    handle.remove()
    return layer.weight.detach().float(), moments


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [Unstructured(0.5, "row"), NM(2, 4)])
def test_on_a_real_smollm2_layer_the_expected_reconstruction_error_falls_and_counts_stay(smollm2_o_proj, pattern):
    from pyprune import ops
    weight, moments = smollm2_o_proj
    effect = weight.double() * moments.sequence_sum
    wanda = ops.wanda_score(weight, moments.sqnorm.float())
    keep = pattern.keep_mask(wanda)
    refined = refine_mask(keep, effect, moments.variance, wanda, wanda, pattern if isinstance(pattern, NM) else None,
                          cycles=50, threshold=0.1, var_power=1.0)
    assert torch.equal(refined.sum(dim=1), keep.sum(dim=1))

    def expected_error(mask):  # Σ_i |ε_i|, ε_i = Σ_{j pruned} W_ij·E[x_j] per sequence (Eq. 3)
        return float((effect * ~mask).sum(dim=1).abs().sum())

    assert expected_error(refined) < 0.5 * expected_error(keep)
