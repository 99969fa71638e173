"""Property tests (hypothesis) of the ops on the default backend and on the Triton kernels."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import HAS_CUDA

BACKENDS = ["auto", "triton"]
DEVICE = "cuda" if HAS_CUDA else "cpu"
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nm_problems(draw):
    m = draw(st.integers(2, 16))
    n = draw(st.integers(1, m - 1))
    rows, groups = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    levels = draw(st.integers(1, 6))  # few levels = many ties
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-levels, levels + 1, (rows, groups * m), generator=g).float() / 2
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return scores.to(dtype).to(DEVICE), n, m


def _backend(name):
    return ops.use_backend(None if name == "auto" else name)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=nm_problems())
def test_nm_mask_keeps_exactly_n_and_is_idempotent(backend, problem):
    scores, n, m = problem
    with _backend(backend):
        mask = ops.nm_mask(scores, n, m)
        assert bool((mask.reshape(-1, m).sum(dim=1) == n).all())
        assert torch.equal(mask, R.nm_mask(scores, n, m))
        # magnitude pruning is idempotent: the pruned weights select the same mask again
        by_magnitude = ops.score_nm_mask(scores, n, m)
        assert torch.equal(ops.score_nm_mask(scores * by_magnitude, n, m), by_magnitude)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(problem=nm_problems())
def test_compress_round_trip(backend, problem):
    w, n, m = problem
    with _backend(backend):
        mask = ops.score_nm_mask(w, n, m)
        values, meta = ops.nm_compress(w, mask, n, m)
        assert values.shape == (w.shape[0], w.shape[1] * n // m)
        assert torch.equal(ops.nm_decompress(values, meta, n, m), w * mask)
        again = ops.nm_compress(ops.nm_decompress(values, meta, n, m), mask, n, m)
        assert torch.equal(again[0], values) and torch.equal(again[1], meta)


@st.composite
def topk_problems(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 50))
    levels = draw(st.integers(1, 4))  # few levels = many ties
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    scores = torch.randint(-levels, levels + 1, (rows, cols), generator=g).float() / 2
    scores = torch.where(torch.rand(rows, cols, generator=g) < 0.2, scores * -0.0, scores)  # ±0.0
    act_sqnorm = torch.randint(0, 3, (cols,), generator=g).float().to(DEVICE) if draw(st.booleans()) else None
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return scores.to(dtype).to(DEVICE), act_sqnorm


# On CPU tensors "auto" runs the C++ kernel too (tests/test_ops_api.py checks that it is chosen);
# "cpu" forces it, so the comparison with the reference cannot silently run the reference.
TOPK_BACKENDS = BACKENDS + (["cpu"] if DEVICE == "cpu" else [])


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@SETTINGS
@given(problem=topk_problems(), sparsity=st.floats(0.0, 0.999), scope=st.sampled_from(["row", "tensor"]))
def test_topk_mask_counts_are_exact(backend, problem, sparsity, scope):
    scores, act_sqnorm = problem
    with _backend(backend):
        mask = ops.topk_mask(scores, sparsity, scope)
        fused = ops.score_topk_mask(scores, sparsity, scope, act_sqnorm)
    rows, cols = scores.shape
    count = cols if scope == "row" else rows * cols
    for m in (mask, fused):
        kept = m.sum(dim=1) if scope == "row" else m.sum().reshape(1)
        assert bool((kept == R.kept_count(count, sparsity)).all())
    assert torch.equal(mask, R.topk_mask(scores, sparsity, scope))
    assert torch.equal(fused, R.score_topk_mask(scores, sparsity, scope, act_sqnorm))


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), alpha=st.floats(0.0, 3.0),
       group_dim=st.integers(0, 1), seed=st.integers(0, 2 ** 16))
def test_group_soft_threshold_shrinks_norms_by_alpha(backend, rows, cols, alpha, group_dim, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    with _backend(backend):
        z = ops.group_soft_threshold(x, alpha, group_dim)
    other = 1 - group_dim
    before, after = x.norm(dim=other), z.norm(dim=other)
    # ‖prox(x)_g‖ = max(‖x_g‖ − α, 0), and the direction of each group is kept
    torch.testing.assert_close(after, (before - alpha).clamp_min(0), rtol=1e-5, atol=1e-5)
    cosine = (x * z).sum(dim=other)
    assert bool((cosine >= -1e-6).all())
