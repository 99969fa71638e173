"""RIA (Zhang et al., ICLR 2024): the score of Eq. 4 on a hand example and from the dense model's
activations, and its channel permutation for N:M: a permutation, the mask N:M exact along it, never
less kept score than the unpermuted mask; exact counts on tiny models of several families."""
import itertools
import math

import pytest
import torch

import pyprune
from pyprune import methods
from pyprune.methods.channel_permutation import kept_score, nm_channel_permutation, snake_allocation
from pyprune.methods.ria import ria_score
from pyprune.ops.assignment import linear_sum_assignment
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_decoder, tiny_llama

FAMILIES = ("llama", "opt", "gemma3")


def test_the_score_is_the_relative_importance_times_the_activation_norm_to_the_power_a():
    weight = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    sqnorm = torch.tensor([4.0, 9.0])  # ‖X‖ = (2, 3)
    # column totals (4, 6), row totals (3, 7)
    expected = torch.tensor([[(1 / 4 + 1 / 3) * 2 ** 0.5, (2 / 6 + 2 / 3) * 3 ** 0.5],
                             [(3 / 4 + 3 / 7) * 2 ** 0.5, (4 / 6 + 4 / 7) * 3 ** 0.5]])
    torch.testing.assert_close(ria_score(weight, sqnorm, 0.5), expected)
    torch.testing.assert_close(ria_score(weight, sqnorm, 0.0), expected / torch.tensor([2 ** 0.5, 3 ** 0.5]))


def test_a_zero_column_scores_zero_not_nan():
    weight = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    scores = ria_score(weight, torch.ones(2), 0.5)
    assert bool(torch.isfinite(scores).all()) and bool((scores[:, 0] == 0).all())


def _dense_sqnorms(model, calib, index=0):
    """Σ x_j² of every linear's inputs in block ``index`` from one dense forward (hooks)."""
    sqnorms, handles = {}, []
    for name, linear in engine.block_linears(model.model.layers[index]).items():
        def hook(module, args, output, key=name):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sqnorms[key] = sqnorms.get(key, 0) + x.square().sum(0)
        handles.append(linear.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=calib)
    for handle in handles:
        handle.remove()
    return sqnorms


def test_the_first_block_keeps_the_highest_scores_of_each_layer_from_the_dense_activations():
    model, calib = tiny_llama(), random_tokens((4, 16))
    linears = engine.block_linears(model.model.layers[0])
    dense = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    sqnorms = _dense_sqnorms(model, calib)
    pyprune.prune(model, "ria", 0.5, calib, batch_size=2, progress=False)
    for name, linear in engine.block_linears(model.model.layers[0]).items():
        scores = ria_score(dense[name], sqnorms[name].float(), 0.5)
        kept = linear.weight != 0
        assert int(kept.sum()) == scores.numel() // 2  # scope "tensor": half of the layer
        assert float(scores[kept].min()) >= float(scores[~kept].max()) - 1e-6


def test_the_assignment_finds_the_best_matching():
    generator = torch.Generator().manual_seed(0)
    for size in range(1, 7):
        profit = torch.randn(size, size, generator=generator, dtype=torch.float64).round(decimals=1)
        columns = linear_sum_assignment(profit)
        assert sorted(columns.tolist()) == list(range(size))
        best = max(sum(float(profit[r, c]) for r, c in enumerate(p)) for p in itertools.permutations(range(size)))
        assert math.isclose(float(profit[torch.arange(size), columns].sum()), best, abs_tol=1e-9)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_the_permutation_keeps_n_m_exact_and_never_less_score(n, m):
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        scores = torch.rand(24, 8 * m, generator=generator) ** 3  # skewed, as real scores are
        scores[:, :m] *= 5  # one group of strong channels: the unpermuted N:M mask wastes them
        perm = nm_channel_permutation(scores, n, m)
        assert sorted(perm.tolist()) == list(range(scores.shape[1]))
        keep = pyprune.patterns.NM(n, m).keep_mask(scores[:, perm])
        assert bool((keep.reshape(24, -1, m).sum(-1) == n).all())
        assert kept_score(scores[:, perm], n, m) >= kept_score(scores, n, m)
        assert kept_score(scores[:, perm], n, m) >= kept_score(scores[:, snake_allocation(scores, m)], n, m) - 1e-9
    assert kept_score(scores[:, perm], n, m) > kept_score(scores, n, m)  # the strong group is spread out


def test_the_permutation_is_the_identity_when_it_cannot_gain():
    scores = torch.zeros(4, 8)
    scores[:, [0, 1, 4, 5]] = 1.0  # the unpermuted 2:4 mask keeps every 1 already
    perm = nm_channel_permutation(scores, 2, 4)
    assert kept_score(scores[:, perm], 2, 4) == kept_score(scores, 2, 4) == 16


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_prunes_to_exact_counts_and_the_permuted_mask_is_n_m_along_its_permutation(family):
    calib = random_tokens((4, 16))
    model = tiny_decoder(family, layers=2)
    report = pyprune.prune(model, "ria", 0.5, calib, batch_size=2, progress=False)
    for block in engine.decoder_blocks(model):
        for linear in engine.block_linears(block).values():
            assert int((linear.weight == 0).sum()) == linear.weight.numel() // 2
    assert report["scope"] == "tensor"
    model = tiny_decoder(family, layers=2)
    ria = methods.get("ria", channel_permutation=True)
    report = pyprune.prune(model, ria, "2:4", calib, batch_size=2, progress=False)
    prefix = engine.block_prefix(model)
    linears = {f"{prefix}.{index}.{name}": linear for index, block in enumerate(engine.decoder_blocks(model))
               for name, linear in engine.block_linears(block).items()}
    assert set(ria.permutations) == set(linears) and report["channel_permutation"]["layers"] == len(linears)
    assert report["channel_permutation"]["kept_score_gain_mean"] >= 1.0
    for name, linear in linears.items():
        kept = (linear.weight[:, ria.permutations[name]] != 0).reshape(linear.out_features, -1, 4).sum(-1)
        assert bool((kept == 2).all()), name


def test_channel_permutation_with_an_unstructured_pattern_is_refused_before_the_model_changes():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="option channel_permutation of method 'ria'.*N:M"):
        pyprune.prune(model, "ria", 0.5, random_tokens((2, 8)), channel_permutation=True, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
