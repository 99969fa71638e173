"""pyprune.ops mask selection (nm_mask, score_nm_mask, topk_mask, score_topk_mask) on every
implementation that implements it: the kernels through the public API against the reference (masks exactly
equal, fp32/fp16/bf16, awkward shapes), properties over random problems (exact counts,
idempotence), then the C++ kernels (pyprune._C) and the CUDA kernel (pyprune._C_cuda) called
directly, bit for bit against the reference on every score kind. Without a GPU the Triton kernels
run in the interpreter."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pyprune.ops.reference as ref
from pyprune import ops
from pyprune.ops import reference as R
from pyprune.ops.library import native
from pyprune.ops.conventions import ScoreKind
from tests.helpers import DTYPES, rand, randn, tied_scores
from tests.ops.common import (DEVICE, PROPERTY_IMPLEMENTATIONS, SETTINGS, awkward_shapes, kernel_implementations,
                              nm_problems, property_implementation)

#: On CPU tensors the ops run pyprune._C's kernels (tests/ops/test_registration.py).
C = torch.ops.pyprune
pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")
KERNEL_NM = [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (7, 32)]


# ----------------------------------------------------------------------------------------------
# Every kernel implementation through the public API against the reference.


@pytest.mark.parametrize("device", kernel_implementations("nm_mask"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", KERNEL_NM)
def test_nm_mask_exact(device, dtype, n, m):
    for shape in [(1, m), (3, 5 * m), (2, 4096 // 32 * m)]:
        scores = tied_scores(shape, dtype, seed=n + m).to(device)
        assert torch.equal(ops.nm_mask(scores, n, m), R.nm_mask(scores, n, m)), shape


@pytest.mark.parametrize("device", kernel_implementations("nm_mask"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6)])
def test_score_nm_mask_exact(device, dtype, n, m):
    w = tied_scores((9, 12 * m), dtype, seed=5, levels=5).to(device) - 2
    sqnorm = torch.randint(0, 4, (12 * m,), generator=torch.Generator().manual_seed(6)).float().to(device)
    assert torch.equal(ops.score_nm_mask(w, n, m), R.score_nm_mask(w, n, m))
    assert torch.equal(ops.score_nm_mask(w, n, m, sqnorm), R.score_nm_mask(w, n, m, sqnorm))


@pytest.mark.parametrize("device", kernel_implementations("nm_mask"), indirect=True)
def test_nm_mask_with_infinities(device):
    scores = torch.tensor([[float("inf"), 1.0, float("-inf"), float("inf"),
                            float("-inf"), float("-inf"), 0.0, -0.0]], device=device)
    expected = torch.tensor([[True, False, False, True, False, False, True, True]])
    assert torch.equal(ops.nm_mask(scores, 2, 4).cpu(), expected)


@pytest.mark.parametrize("device", kernel_implementations("topk_mask"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.999])
def test_topk_mask_exact(device, dtype, scope, sparsity):
    for shape in [(1, 1), (6, 37)]:
        scores = tied_scores(shape, dtype, seed=7).to(device)
        assert torch.equal(ops.topk_mask(scores, sparsity, scope), R.topk_mask(scores, sparsity, scope))


@pytest.mark.parametrize("device", kernel_implementations("topk_mask"), indirect=True)
@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_topk_mask_wide_rows(device, scope):
    scores = randn((2, 4096), torch.bfloat16, seed=8).to(device)  # bf16 values tie often
    assert torch.equal(ops.topk_mask(scores, 0.5, scope), R.topk_mask(scores, 0.5, scope))


@pytest.mark.parametrize("device", kernel_implementations("topk_mask"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_topk_mask_exact(device, dtype):
    w = randn((5, 70), dtype, seed=9).to(device)
    sqnorm = rand((70,), seed=10).to(device)
    for scope in ("row", "tensor"):
        assert torch.equal(ops.score_topk_mask(w, 0.6, scope), R.score_topk_mask(w, 0.6, scope))
        assert torch.equal(ops.score_topk_mask(w, 0.3, scope, sqnorm),
                           R.score_topk_mask(w, 0.3, scope, sqnorm))


@pytest.mark.parametrize("device", kernel_implementations("nm_mask", "topk_mask"), indirect=True)
@pytest.mark.parametrize("op", ["nm_mask", "topk_mask"])
def test_nan_scores_raise(device, op):
    scores = torch.ones(3, 8, device=device)
    scores[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ops.nm_mask(scores, 2, 4) if op == "nm_mask" else ops.topk_mask(scores, 0.5)


# ----------------------------------------------------------------------------------------------
# Properties over random problems (hypothesis), on the automatic choice and on the kernels.


@pytest.mark.parametrize("implementation", PROPERTY_IMPLEMENTATIONS)
@SETTINGS
@given(problem=nm_problems())
def test_nm_mask_keeps_exactly_n_and_is_idempotent(implementation, problem):
    scores, n, m = problem
    with property_implementation(implementation):
        mask = ops.nm_mask(scores, n, m)
        assert bool((mask.reshape(-1, m).sum(dim=1) == n).all())
        assert torch.equal(mask, R.nm_mask(scores, n, m))
        # magnitude pruning is idempotent: the pruned weights select the same mask again
        by_magnitude = ops.score_nm_mask(scores, n, m)
        assert torch.equal(ops.score_nm_mask(scores * by_magnitude, n, m), by_magnitude)


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
TOPK_IMPLEMENTATIONS = PROPERTY_IMPLEMENTATIONS + (["cpu"] if DEVICE == "cpu" else [])


# 12 examples, not 25: the Triton interpreter takes ~2 s per example here (CI time); the fixed awkward
# shapes of test_score_topk_mask_exact cover every dtype on every implementation.
@pytest.mark.parametrize("implementation", TOPK_IMPLEMENTATIONS)
@settings(SETTINGS, max_examples=12)
@given(problem=topk_problems(), sparsity=st.floats(0.0, 0.999), scope=st.sampled_from(["row", "tensor"]))
def test_topk_mask_counts_are_exact(implementation, problem, sparsity, scope):
    scores, act_sqnorm = problem
    with property_implementation(implementation):
        mask = ops.topk_mask(scores, sparsity, scope)
        fused = ops.score_topk_mask(scores, sparsity, scope, act_sqnorm)
    rows, cols = scores.shape
    count = cols if scope == "row" else rows * cols
    for m in (mask, fused):
        kept = m.sum(dim=1) if scope == "row" else m.sum().reshape(1)
        assert bool((kept == R.kept_count(count, sparsity)).all())
    assert torch.equal(mask, R.topk_mask(scores, sparsity, scope))
    assert torch.equal(fused, R.score_topk_mask(scores, sparsity, scope, act_sqnorm))


# ----------------------------------------------------------------------------------------------
# pyprune._C: the C++ N:M kernel called directly, bit for bit against the reference.


NM = [(2, 4), (4, 8), (1, 2), (3, 8), (5, 16), (7, 32), (3, 6)]
KINDS = [ScoreKind.GIVEN, ScoreKind.MAGNITUDE, ScoreKind.WANDA]
NAN_MSG = "NaN"


def _expected(src, act, n, m, kind):
    if kind == ScoreKind.GIVEN:
        return ref.nm_mask(src, n, m)
    return ref.score_nm_mask(src, n, m, act_sqnorm=act if kind == ScoreKind.WANDA else None)


def _data(kind_of_data, shape, dtype, gen):
    if kind_of_data == "randn":
        x = torch.randn(shape, generator=gen)
    elif kind_of_data == "ties":
        # Few distinct values (both signs, so -0.0/+0.0 and |x| ties too): many equal scores.
        x = torch.randint(-2, 3, shape, generator=gen).float()
        x = torch.where(torch.rand(shape, generator=gen) < 0.3, x * -0.0, x)
    elif kind_of_data == "special":
        vals = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 65504.0])
        x = vals[torch.randint(0, len(vals), shape, generator=gen)]
    else:
        raise AssertionError(kind_of_data)
    return x.to(dtype)


def _act(cols, kind_of_data, gen):
    if kind_of_data == "ties":
        # Integer sums of squares: equal products across columns; zeros give zero scores.
        return torch.randint(0, 3, (cols,), generator=gen).float()
    if kind_of_data == "special":
        # Strictly positive (inf * 0 would be NaN), with some very large values.
        a = torch.rand(cols, generator=gen) + 0.25
        return torch.where(torch.rand(cols, generator=gen) < 0.1, torch.full_like(a, 3.0e38), a)
    a = torch.rand(cols, generator=gen) * 10.0
    return torch.where(torch.rand(cols, generator=gen) < 0.05, torch.zeros_like(a), a)


def _check(src, act, n, m, kind):
    got = C.nm_mask(src, act if kind == ScoreKind.WANDA else None, n, m, kind)
    want = _expected(src, act, n, m, kind)
    assert got.dtype == torch.bool and got.shape == src.shape
    assert torch.equal(got, want), (src.dtype, tuple(src.shape), n, m, kind)
    per_group = got.reshape(-1, m).sum(dim=1)
    assert bool((per_group == n).all())


@pytest.mark.parametrize("data", ["randn", "ties", "special"])
@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nm_mask_matches_reference(dtype, kind, n, m, data):
    gen = torch.Generator().manual_seed(1000 * n + 10 * m + kind)
    for shape in awkward_shapes(m):
        src = _data(data, shape, dtype, gen)
        act = _act(shape[1], data, gen)
        _check(src, act, n, m, kind)


@pytest.mark.parametrize("n,m", NM)
def test_signed_zero_ties_keep_lower_index(n, m):
    # -0.0 == +0.0: ties, so the lowest indices win whatever the signs.
    x = torch.zeros(4, 4 * m)
    x[:, 1::2] = -0.0
    x[1] = torch.where(torch.arange(4 * m) % 3 == 0, -0.0, 0.0)
    for kind in (0, 1):
        got = C.nm_mask(x, None, n, m, kind)
        want = torch.zeros(4, m, dtype=torch.bool)
        want[:, :n] = True
        assert torch.equal(got, want.repeat(1, 4))
        assert torch.equal(got, _expected(x, None, n, m, kind))


def test_infinities():
    x = torch.tensor([[float("-inf"), 1.0, float("inf"), float("inf"),
                       float("-inf"), float("-inf"), float("-inf"), -3.0]])
    assert C.nm_mask(x, None, 2, 4, 0).tolist() == [[False, False, True, True,
                                                     True, False, False, True]]
    assert C.nm_mask(x, None, 2, 4, 1).tolist() == [[True, False, True, False,
                                                     True, True, False, False]]
    for kind in (0, 1):
        _check(x, None, 2, 4, kind)
        _check(x, None, 1, 8, kind)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_half_bit_pattern(dtype):
    # All 65536 encodings but NaN, shuffled: exercises the exact fp16/bf16 -> fp32 conversion.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[~torch.isnan(x.float())]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    width = 384  # a multiple of every m tested
    x = x[: x.numel() // width * width].reshape(-1, width).contiguous()
    for n, m in NM:
        for kind in (0, 1):
            _check(x, None, n, m, kind)
        act = torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5
        _check(x, act, n, m, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_raises(dtype, kind):
    x = torch.randn(6, 64).to(dtype)
    x[4, 37] = float("nan")
    act = torch.rand(64) + 0.1
    with pytest.raises(ValueError, match=NAN_MSG):
        C.nm_mask(x, act if kind == ScoreKind.WANDA else None, 2, 4, kind)
    big = torch.randn(300, 512).to(dtype)  # large enough for the parallel path
    big[299, 511] = float("nan")
    act = torch.rand(512) + 0.1
    with pytest.raises(ValueError, match=NAN_MSG):
        C.nm_mask(big, act if kind == ScoreKind.WANDA else None, 3, 16, kind)


def test_wanda_nan_from_act_sqnorm():
    """A negative or NaN statistic is refused before the kernel runs (it would score NaN); inf·0
    scores NaN in the kernel."""
    x = torch.randn(2, 8)
    bad_act = torch.rand(8)
    bad_act[3] = -1.0  # sqrt(-1) = NaN
    with pytest.raises(ValueError, match=r"act_sqnorm must be >= 0 .*; got -1.0 at column 3"):
        C.nm_mask(x, bad_act, 2, 4, 2)
    nan_act = torch.rand(8)
    nan_act[6] = float("nan")
    with pytest.raises(ValueError, match=r"act_sqnorm must be >= 0 .*; got nan at column 6"):
        C.nm_mask(x, nan_act, 4, 8, 2)
    inf_w = x.clone()
    inf_w[1, 2] = float("inf")
    zero_act = torch.rand(8)
    zero_act[2] = 0.0  # inf * 0 = NaN
    with pytest.raises(ValueError, match=NAN_MSG):
        C.nm_mask(inf_w, zero_act, 2, 4, 2)


def test_wide_rows_fast():
    # 4096-wide rows, many of them: the path the pruners use (runs in milliseconds).
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(256, 4096, generator=gen)
    act = torch.rand(4096, generator=gen) * 5.0
    for n, m in [(2, 4), (4, 8)]:
        for dtype in DTYPES:
            src = w.to(dtype)
            for kind in KINDS:
                _check(src, act, n, m, kind)


def test_empty_rows():
    out = C.nm_mask(torch.empty(0, 16), None, 2, 4, 1)
    assert out.shape == (0, 16) and out.dtype == torch.bool


def test_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        C.nm_mask(x.double(), None, 2, 4, 0)
    with pytest.raises(RuntimeError):
        C.nm_mask(torch.randn(4, 10), None, 2, 4, 0)  # cols % m != 0
    with pytest.raises(RuntimeError):
        C.nm_mask(x, None, 4, 4, 0)  # n >= m
    with pytest.raises(RuntimeError):
        C.nm_mask(x, None, 2, 4, 2)  # Wanda without act_sqnorm
    with pytest.raises(RuntimeError):
        C.nm_mask(x, torch.rand(4), 2, 4, 2)  # act_sqnorm of the wrong length
    transposed = torch.randn(8, 4).t()  # the op reads any layout and leading dims
    assert torch.equal(C.nm_mask(transposed, None, 2, 4, 0), C.nm_mask(transposed.contiguous(), None, 2, 4, 0))
    assert torch.equal(C.nm_mask(x.reshape(2, 2, 8), None, 2, 4, 0), C.nm_mask(x, None, 2, 4, 0).reshape(2, 2, 8))


def test_openmp_threads():
    t = native("cpu").openmp_threads()
    assert isinstance(t, int) and t >= 1


def test_storage_offset_views():
    # Contiguous views that do not start at the beginning of their storage (unaligned data).
    flat = torch.randn(5 * 4096 + 3, generator=torch.Generator().manual_seed(3))
    act = torch.rand(4096) * 2.0
    for offset in (1, 2, 3):
        for dtype in DTYPES:
            base = flat.to(dtype)
            src = base[offset: offset + 5 * 4096].view(5, 4096)
            assert src.is_contiguous() and src.storage_offset() == offset
            for (n, m), kind in [((2, 4), 0), ((4, 8), 1), ((3, 6), 2)]:
                cols = 4096 - 4096 % m
                _check(src[:, :cols].contiguous() if cols != 4096 else src, act[:cols], n, m, kind)


# ----------------------------------------------------------------------------------------------
# Exact top-k masks (radix select), per row and per tensor, against reference.keep_top.

SCOPES = [True, False]  # per_row: one selection per row, or one over the whole tensor
TOPK_SHAPES = [(1, 1), (9, 1), (1, 7), (5, 37), (3, 4099), (7, 4096), (64, 4096)]


def _topk_expected(src, act, keep, per_row, kind):
    scores = (src.float() if kind == ScoreKind.GIVEN else ref.magnitude_score(src)
              if kind == ScoreKind.MAGNITUDE else ref.wanda_score(src, act))
    rows = scores.reshape(-1, scores.shape[-1]) if per_row else scores.reshape(1, -1)
    return ref.keep_top(rows, keep).reshape(scores.shape)


def _keeps(count, gen):
    """Keep counts 0, 1, half, all but one, all, and a random one."""
    return sorted({0, 1, count - 1, count, count // 2, int(torch.randint(0, count + 1, (1,), generator=gen))})


def _check_topk(src, act, keep, per_row, kind):
    got = C.topk_mask(src, act if kind == ScoreKind.WANDA else None, keep, per_row, kind)
    assert got.dtype == torch.bool and got.shape == src.shape
    want = _topk_expected(src, act, keep, per_row, kind)
    assert torch.equal(got, want), (src.dtype, tuple(src.shape), keep, per_row, kind)
    kept = got.sum(dim=1) if per_row else got.sum().reshape(1)
    assert bool((kept == keep).all())


def _ulps(shape, gen):
    """Scores a few ulps apart around ±1 (and ±0.0): only the low key bits tell them apart, so
    every radix digit is needed and many keys tie."""
    one = torch.tensor(1.0).view(torch.int32)
    bits = one + torch.randint(-3, 4, shape, generator=gen, dtype=torch.int32)
    x = bits.view(torch.float32) * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return torch.where(torch.rand(shape, generator=gen) < 0.05, -0.0, x)


@pytest.mark.parametrize("data", ["randn", "ties", "special", "ulps"])
@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_mask_matches_reference(dtype, kind, per_row, data):
    gen = torch.Generator().manual_seed(10 * kind + per_row)
    for shape in TOPK_SHAPES:
        src = _ulps(shape, gen).to(dtype) if data == "ulps" else _data(data, shape, dtype, gen)
        act = _act(shape[1], "randn" if data == "ulps" else data, gen)
        for keep in _keeps(shape[1] if per_row else src.numel(), gen):
            _check_topk(src, act, keep, per_row, kind)


@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_signed_zero_ties_keep_lower_index(per_row):
    # -0.0 == +0.0: ties, so the lowest (row-major) indices win whatever the signs.
    x = torch.zeros(6, 40)
    x[:, 1::2] = -0.0
    x[2] = torch.where(torch.arange(40) % 3 == 0, -0.0, 0.0)
    for kind in (0, 1):
        got = C.topk_mask(x, None, 13 if per_row else 100, per_row, kind)
        want = torch.zeros(6, 40, dtype=torch.bool)
        if per_row:
            want[:, :13] = True
        else:
            want.view(-1)[:100] = True
        assert torch.equal(got, want)


def test_topk_infinities():
    x = torch.tensor([[float("-inf"), 1.0, float("inf"), float("inf"), -0.0, float("-inf"), -3.0, 0.0]])
    assert C.topk_mask(x, None, 3, True, 0).tolist() == [[False, True, True, True,
                                                         False, False, False, False]]
    assert C.topk_mask(x, None, 4, True, 1).tolist() == [[True, False, True, True,
                                                         False, True, False, False]]
    # Of the two -inf the lower index stays.
    assert C.topk_mask(x, None, 7, False, 0).tolist() == [[True, True, True, True,
                                                          True, False, True, True]]
    for keep in range(9):
        for kind, per_row in [(0, True), (1, True), (0, False), (1, False)]:
            _check_topk(x, None, keep, per_row, kind)


@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_ties_across_blocks_keep_the_first(per_row):
    # One repeated value across many rows and kernel blocks, cut in the middle: the kept copies
    # are exactly the first ones in index order.
    x = torch.ones(300, 1000)
    x[17, 3] = 2.0
    x[250, 999] = 0.5
    keep = 400 if per_row else 123457
    got = C.topk_mask(x, None, keep, per_row, 0)
    # The 2.0 lies among the first `keep` elements of its row / of the tensor, the 0.5 does not.
    want = torch.zeros(300, 1000, dtype=torch.bool)
    if per_row:
        want[:, :keep] = True
    else:
        want.view(-1)[:keep] = True
    assert torch.equal(got, want)
    assert torch.equal(got, _topk_expected(x, None, keep, per_row, 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_every_half_bit_pattern(dtype, per_row):
    # All 65536 encodings but NaN, shuffled: every exponent and sign reaches the radix select.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[~torch.isnan(x.float())]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    x = x[: x.numel() // 384 * 384].reshape(-1, 384).contiguous()
    act = torch.rand(384, generator=torch.Generator().manual_seed(1)) + 0.5
    count = 384 if per_row else x.numel()
    for kind in KINDS:
        for keep in (1, count // 3, count // 2, count - 5):
            _check_topk(x, act, keep, per_row, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_nan_raises(dtype, kind, per_row):
    act = torch.rand(512) + 0.1
    for shape, at in [((6, 64), (4, 37)), ((300, 512), (299, 511))]:  # serial and parallel paths
        x = torch.randn(shape).to(dtype)
        x[at] = float("nan")
        count = shape[1] if per_row else x.numel()
        for keep in (0, count // 2, count):  # raised even when nothing needs selecting
            with pytest.raises(ValueError, match=NAN_MSG):
                C.topk_mask(x, act[: shape[1]] if kind == ScoreKind.WANDA else None, keep, per_row, kind)


@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_wanda_nan_from_act_sqnorm(per_row):
    x = torch.randn(2, 8)
    for col, value in [(3, -1.0), (6, float("nan"))]:  # refused before the kernel runs
        act = torch.rand(8)
        act[col] = value
        with pytest.raises(ValueError, match=rf"act_sqnorm must be >= 0 .*; got {value} at column {col}"):
            C.topk_mask(x, act, 4, per_row, 2)
    inf_w = x.clone()
    inf_w[1, 2] = float("inf")
    zero_act = torch.rand(8)
    zero_act[2] = 0.0  # inf * 0 = NaN
    with pytest.raises(ValueError, match=NAN_MSG):
        C.topk_mask(inf_w, zero_act, 4, per_row, 2)


def test_topk_empty_and_bad_arguments():
    out = C.topk_mask(torch.empty(0, 16), None, 8, True, 1)
    assert out.shape == (0, 16) and out.dtype == torch.bool
    x = torch.randn(4, 8)
    for call, message in [
        (lambda: C.topk_mask(x, None, 9, True, 0), r"keep must be in \[0, 8\]"),
        (lambda: C.topk_mask(x, None, 33, False, 0), r"keep must be in \[0, 32\]"),
        (lambda: C.topk_mask(x, None, -1, True, 0), "keep must be in"),
        (lambda: C.topk_mask(x.double(), None, 2, True, 0), "dtype must be"),
        (lambda: C.topk_mask(x, None, 2, True, 2), "needs act_sqnorm"),
        (lambda: C.topk_mask(x, torch.rand(4), 2, True, 2), "act_sqnorm must be 1-D of length 8"),
        (lambda: C.topk_mask(x, None, 2, True, 3), "score_kind must be 0 \\(GIVEN\\), 1 \\(MAGNITUDE\\) or 2 \\(WANDA\\), got 3"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call()
    transposed = torch.randn(8, 4).t()  # the op reads any layout; a 1-D src is one row
    assert torch.equal(C.topk_mask(transposed, None, 2, True, 0),
                       C.topk_mask(transposed.contiguous(), None, 2, True, 0))
    assert torch.equal(C.topk_mask(x[0], None, 2, True, 0), C.topk_mask(x[:1], None, 2, True, 0)[0])


def test_topk_storage_offset_views():
    # Contiguous views that do not start at the beginning of their storage (unaligned data).
    flat = torch.randn(5 * 4096 + 3, generator=torch.Generator().manual_seed(3))
    act = torch.rand(4096) * 2.0
    for offset in (1, 2, 3):
        for dtype in DTYPES:
            src = flat.to(dtype)[offset: offset + 5 * 4096].view(5, 4096)
            assert src.storage_offset() == offset
            for kind in KINDS:
                _check_topk(src, act, 2048, True, kind)
                _check_topk(src, act, 9000, False, kind)


# ----------------------------------------------------------------------------------------------
# pyprune._C_cuda: the same contract on CUDA tensors (only where a GPU and the extension exist).

def _cuda_module():
    """torch.ops.pyprune, whose ops run pyprune._C_cuda's kernels on CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if native("cuda") is None:  # setup.py builds it wherever CUDA is usable
        pytest.fail("a CUDA device is here but pyprune._C_cuda is not built; reinstall with "
                    "`pip install --no-build-isolation -e .`", pytrace=False)
    return torch.ops.pyprune


def _check_cuda(CC, src, act, n, m, kind):
    got = CC.nm_mask(src.cuda(), act.cuda() if kind == ScoreKind.WANDA else None, n, m, kind)
    assert got.is_cuda and got.dtype == torch.bool and got.shape == src.shape
    want = _expected(src.cpu(), act.cpu() if act is not None else None, n, m, kind)
    assert torch.equal(got.cpu(), want), (src.dtype, tuple(src.shape), n, m, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("data", ["randn", "ties", "special"])
@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_nm_mask_matches_reference(dtype, kind, n, m, data):
    CC = _cuda_module()
    gen = torch.Generator().manual_seed(1000 * n + 10 * m + kind)
    for shape in awkward_shapes(m):
        src = _data(data, shape, dtype, gen)
        act = _act(shape[1], data, gen)
        _check_cuda(CC, src, act, n, m, kind)
        # Unaligned start (storage offset 1): the kernels' scalar-load path.
        flat = torch.empty(src.numel() + 1, dtype=dtype, device="cuda")
        flat[1:] = src.reshape(-1).cuda()
        view = flat[1:].view(shape)
        got = CC.nm_mask(view, act.cuda() if kind == ScoreKind.WANDA else None, n, m, kind)
        assert torch.equal(got.cpu(), _expected(src, act, n, m, kind))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_nan_raises(dtype, kind):
    CC = _cuda_module()
    for n, m in [(2, 4), (4, 8), (3, 6)]:
        x = torch.randn(8, 96).to(dtype)
        x[5, 17] = float("nan")
        act = torch.rand(96) + 0.1
        with pytest.raises(ValueError, match=NAN_MSG):
            CC.nm_mask(x.cuda(), act.cuda() if kind == ScoreKind.WANDA else None, n, m, kind)
    # After an error the module still works.
    _check_cuda(CC, torch.randn(4, 64).to(dtype), torch.rand(64), 2, 4, kind)
