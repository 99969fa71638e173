"""The reference ops against first principles: definitions written out element by element,
optimality conditions of the proximal operators, exact counts, bit layouts."""
import itertools
import math

import pytest
import torch

from pyprune.ops import reference as R
from tests.helpers import rand, randn, tied_scores


def _beats(scores, i, j):
    """Does element j beat element i? Higher score, or the same score at a lower index."""
    return scores[j] > scores[i] or (scores[j] == scores[i] and j < i)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (4, 8), (3, 6), (5, 7)])
def test_nm_mask_is_rank_below_n_in_every_group(n, m):
    scores = tied_scores((3, 4 * m), seed=n * 31 + m).tolist()
    mask = R.nm_mask(torch.tensor(scores), n, m).tolist()
    for row_scores, row_mask in zip(scores, mask):
        for start in range(0, len(row_scores), m):
            group = row_scores[start:start + m]
            for i in range(m):
                rank = sum(_beats(group, i, j) for j in range(m) if j != i)
                assert row_mask[start + i] == (rank < n)


def test_nm_mask_maximises_the_kept_score_sum():
    scores = randn((16, 8), seed=3)
    mask = R.nm_mask(scores, 3, 8)
    for row, keep in zip(scores, mask):
        best = max(sum(row[list(c)]) for c in itertools.combinations(range(8), 3))
        assert torch.isclose(row[keep].sum(), best)


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.7, 0.99])
@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_topk_mask_keeps_the_best_exactly(sparsity, scope):
    scores = tied_scores((5, 37), seed=7)
    mask = R.topk_mask(scores, sparsity, scope)
    segments = zip(scores, mask) if scope == "row" else [(scores.flatten(), mask.flatten())]
    for seg_scores, seg_mask in segments:
        count = seg_scores.numel()
        assert int(seg_mask.sum()) == math.floor((1 - sparsity) * count + 0.5)
        kept = seg_mask.nonzero().flatten().tolist()
        dropped = (~seg_mask).nonzero().flatten().tolist()
        values = seg_scores.tolist()
        for k in kept:
            for d in dropped:
                assert _beats(values, d, k)


def test_kept_count_rounds_half_up():
    assert R.kept_count(7, 0.5) == 4
    assert R.kept_count(10, 0.7) == 3
    assert R.kept_count(5, 0.0) == 5
    assert R.kept_count(3, 0.9) == 0


def test_scores_match_their_formulas():
    w, g = randn((4, 6), torch.bfloat16, seed=1), randn((4, 6), seed=2)
    x = randn((3, 5, 6), seed=4)
    sqnorm = torch.zeros(6)
    R.accumulate_sqnorm_(sqnorm, x)
    R.accumulate_sqnorm_(sqnorm, x[0])
    for j in range(6):
        column = [float(v) for v in x[..., j].flatten()] + [float(v) for v in x[0, :, j]]
        assert math.isclose(float(sqnorm[j]), sum(v * v for v in column), rel_tol=1e-5)
    wanda, taylor, magnitude = R.wanda_score(w, sqnorm), R.taylor_score(w, g), R.magnitude_score(w)
    for i, j in itertools.product(range(4), range(6)):
        wij = float(w[i, j])
        assert float(magnitude[i, j]) == abs(wij)
        expected = torch.tensor(abs(wij) * math.sqrt(float(sqnorm[j])), dtype=torch.float32)
        assert torch.isclose(wanda[i, j], expected, rtol=1e-6)
        assert float(taylor[i, j]) == abs(float(torch.tensor(wij) * g[i, j]))
    assert wanda.dtype == taylor.dtype == magnitude.dtype == torch.float32


def test_wanda_sqrt_is_correctly_rounded():
    sqnorm = rand((4096,), seed=5) * 100
    expected = torch.tensor([math.sqrt(v) for v in sqnorm.double().tolist()], dtype=torch.float32)
    assert torch.equal(R.wanda_score(torch.ones(1, 4096), sqnorm)[0], expected)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.5])
def test_soft_threshold_satisfies_the_prox_optimality_condition(alpha):
    x = randn((50,), seed=6)
    z = R.soft_threshold(x, alpha)
    # 0 ∈ z − x + α∂|z|: z − x = −α·sign(z) where z ≠ 0, and |x| ≤ α where z = 0
    nonzero = z != 0
    torch.testing.assert_close((x - z)[nonzero], alpha * z[nonzero].sign())
    assert bool((x[~nonzero].abs() <= alpha + 1e-7).all())


@pytest.mark.parametrize("group_dim", [0, 1, 2])
def test_group_soft_threshold_satisfies_the_prox_optimality_condition(group_dim):
    x = randn((6, 5, 4), seed=8)
    x.select(group_dim, 1).mul_(0.05)  # a group well inside the threshold, so both cases occur
    alpha = 2.0
    z = R.group_soft_threshold(x, alpha, group_dim)
    for g in range(x.shape[group_dim]):
        xg, zg = x.select(group_dim, g), z.select(group_dim, g)
        if zg.norm() > 0:  # x_g − z_g = α z_g / ‖z_g‖
            torch.testing.assert_close(xg - zg, alpha * zg / zg.norm())
        else:
            assert xg.norm() <= alpha
    assert (z == 0).all(dim=tuple(d for d in range(3) if d != group_dim)).any(), "some group must vanish"


def test_group_soft_threshold_minimises_the_prox_objective():
    x = randn((8, 12), seed=9)
    alpha = 1.0

    def objective(v):
        return alpha * v.norm(dim=1).sum() + 0.5 * (v - x).square().sum()

    z = R.group_soft_threshold(x, alpha, 0)
    g = torch.Generator().manual_seed(10)
    for _ in range(200):
        assert objective(z) <= objective(z + 0.05 * torch.randn(x.shape, generator=g)) + 1e-6


def test_pack_mask_bit_layout():
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, 0] = mask[0, 7] = mask[0, 8] = mask[1, 10] = True
    meta = R.pack_mask(mask)
    assert meta.tolist() == [[1 | 128, 1], [0, 4]]
    assert torch.equal(R.unpack_mask(meta, 11), mask)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6)])
def test_compress_round_trip_and_linear(n, m):
    w = randn((5, 4 * m), seed=11)
    mask = R.nm_mask(R.magnitude_score(w), n, m)
    values, meta = R.nm_compress(w, mask, n, m)
    assert values.shape == (5, 4 * n) and meta.shape == (5, (4 * m + 7) // 8)
    assert torch.equal(R.nm_decompress(values, meta, n, m), w * mask)
    x = randn((3, 4 * m), seed=12)
    torch.testing.assert_close(R.nm_linear(x, values, meta, n, m), x @ (w * mask).T)


def test_sliced_linear_matches_the_masked_dense_product():
    w, b = randn((7, 9), seed=13), randn((7,), seed=14)
    in_index, out_index = torch.tensor([0, 2, 3, 8]), torch.tensor([6, 1, 4])
    x = randn((2, 9), seed=15)
    expected = (x[:, in_index] @ w[:, in_index].T + b)[:, out_index]
    torch.testing.assert_close(R.sliced_linear(x[:, in_index], w, b, in_index, out_index), expected)
