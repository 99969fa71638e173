"""pyprune._C (C++/OpenMP CPU kernels) against the pure-PyTorch reference, bit for bit."""
import pytest
import torch

import pyprune.ops.reference as ref
from pyprune.ops.backend import native_module

from tests.helpers import assert_linear_close

C = native_module("cpu")


@pytest.fixture(autouse=True)
def cpu_extension_is_built():
    """pyprune._C is part of the install: without it every test here fails (never skips)."""
    if C is None:
        pytest.fail("pyprune._C is not built: install with `pip install --no-build-isolation -e .` "
                    "(or `python setup.py build_ext --inplace`) with torch already installed", pytrace=False)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NM = [(2, 4), (4, 8), (1, 2), (3, 8), (5, 16), (7, 32), (3, 6)]
KINDS = [0, 1, 2]
NAN_MSG = "NaN"


def _shapes(m):
    """Awkward shapes: one group, one row, cols not a multiple of 64, rows crossing kernel blocks."""
    wide = 4096 - 4096 % m  # 4096-wide rows (4092 for m = 6)
    return [(1, m), (1, 3 * m), (2, 37 * m), (5, wide), (33, 11 * m), (64, wide)]


def _expected(src, act, n, m, kind):
    if kind == 0:
        return ref.nm_mask(src, n, m)
    return ref.score_nm_mask(src, n, m, act_sqnorm=act if kind == 2 else None)


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
    got = C.nm_mask(src, act if kind == 2 else None, n, m, kind)
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
    for shape in _shapes(m):
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
        C.nm_mask(x, act if kind == 2 else None, 2, 4, kind)
    big = torch.randn(300, 512).to(dtype)  # large enough for the parallel path
    big[299, 511] = float("nan")
    act = torch.rand(512) + 0.1
    with pytest.raises(ValueError, match=NAN_MSG):
        C.nm_mask(big, act if kind == 2 else None, 3, 16, kind)


def test_wanda_nan_from_act_sqnorm():
    x = torch.randn(2, 8)
    bad_act = torch.rand(8)
    bad_act[3] = -1.0  # sqrt(-1) = NaN
    with pytest.raises(ValueError, match=NAN_MSG):
        C.nm_mask(x, bad_act, 2, 4, 2)
    nan_act = torch.rand(8)
    nan_act[6] = float("nan")
    with pytest.raises(ValueError, match=NAN_MSG):
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
    with pytest.raises(RuntimeError):
        C.nm_mask(torch.randn(8, 4).t(), None, 2, 4, 0)  # not contiguous


def test_openmp_threads():
    t = C.openmp_threads()
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
# The compressed N:M form on the CPU: decompression (exact) and the decode GEMV (fp32 accumulate).

def _compressed(shape, dtype, n, m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen).to(dtype)
    mask = ref.nm_mask(w.float().abs(), n, m)
    return w, mask, *ref.nm_compress(w, mask, n, m)


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nm_decompress_is_exact(dtype, n, m):
    for shape in _shapes(m):
        w, mask, values, meta = _compressed(shape, dtype, n, m)
        assert torch.equal(C.nm_decompress(values, meta, n, m), w * mask), shape


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# the AVX2 permute (1) and expand paths for 1:2, 2:4, 4:8; past 8 tokens, chunks of 8 (12: 8 + 4;
# 17: 8 + 8 + a one-token chunk, permuted)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 12, 17])
def test_nm_linear_gemv_matches_dense_masked_matmul(dtype, n, m, tokens):
    for shape in _shapes(m)[:5]:
        w, mask, values, meta = _compressed(shape, dtype, n, m, seed=1)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(tokens, shape[1], generator=gen).to(dtype)
        bias = torch.randn(shape[0], generator=gen).to(dtype)
        got = C.nm_linear_gemv(x, values, meta, n, m, bias)
        assert got.dtype == dtype and got.shape == (tokens, shape[0])
        assert_linear_close(got, x, w * mask, bias)


def _cpu_flags():
    """The CPU feature flags the kernel reports on, from /proc/cpuinfo (independent of it)."""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo lists no CPU flags")


AVX2_FLAGS = {"avx2", "fma", "f16c"}


def test_cpu_feature_detection_matches_proc_cpuinfo():
    assert C.cpu_has_avx2_fma_f16c() == (AVX2_FLAGS <= _cpu_flags())


# Rows: one pass of 4/2/1 rows plus leftovers (1, 5, 7, 9); columns: whole 16-column blocks, a
# trailing byte (cols % 16 == 8) and, for 2:4 and 1:2, a trailing half byte (cols % 8 == 4).
HALF_DENSITY_SHAPES = [(1, 16), (5, 24), (7, 52), (9, 4096), (3, 4104), (4, 36)]


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (4, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", range(1, 9))  # every token count: each is its own template
def test_half_density_kernels_every_token_count_and_awkward_shape(dtype, n, m, tokens):
    # the AVX2 kernel on a CPU with AVX2/FMA/F16C (this project's machines have them), the
    # generic one elsewhere; either must match the dense masked matmul
    expected = ("avx2_permute" if tokens == 1 else "avx2_expand") if AVX2_FLAGS <= _cpu_flags() else "generic"
    for shape in HALF_DENSITY_SHAPES:
        if shape[1] % m:
            continue
        w, mask, values, meta = _compressed(shape, dtype, n, m, seed=7)
        x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(8)).to(dtype)
        bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(9)).to(dtype)
        assert C.nm_linear_gemv_path(x, values, meta, n, m) == expected
        assert_linear_close(C.nm_linear_gemv(x, values, meta, n, m, bias), x, w * mask, bias)
        assert_linear_close(C.nm_linear_gemv(x, values, meta, n, m, None), x, w * mask)


@pytest.mark.parametrize("tokens,n,m,cols", [(1, 3, 6, 48), (2, 3, 6, 96), (1, 1, 4, 64), (8, 3, 8, 64), (19, 3, 8, 64)])
def test_other_gemv_shapes_take_the_generic_kernel(tokens, n, m, cols):
    # 3:6 is half density too, but its groups straddle mask bytes (the lane tables need 4 of 8)
    w, mask, values, meta = _compressed((5, cols), torch.float32, n, m)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(10))
    assert C.nm_linear_gemv_path(x, values, meta, n, m) == "generic"
    assert_linear_close(C.nm_linear_gemv(x, values, meta, n, m, None), x, w * mask)


def test_double_takes_the_generic_kernel():
    w, mask, values, meta = _compressed((5, 64), torch.float64, 2, 4)
    x = torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    assert C.nm_linear_gemv_path(x, values, meta, 2, 4) == "generic"
    assert_linear_close(C.nm_linear_gemv(x, values, meta, 2, 4, None), x, w * mask)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_nm_linear_gemv_check_catches_one_dropped_weight(dtype, n, m, tokens):
    # The tolerance is tight enough to matter: a kernel that skips one kept weight per row (the
    # one of median contribution to the first token) fails the check on 4096-wide rows.
    w, mask, values, meta = _compressed((64, 4096 - 4096 % m), dtype, n, m, seed=5)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(6)).to(dtype)
    assert_linear_close(C.nm_linear_gemv(x, values, meta, n, m, None), x, w * mask)
    contribution = (x[0].float() * (w * mask).float()).abs().masked_fill(~mask, float("inf"))
    median_column = contribution.sort(dim=1).indices[:, values.shape[1] // 2]
    dropped = values.clone()
    slot = (mask.cumsum(dim=1) - 1).gather(1, median_column[:, None]).squeeze(1)
    dropped[torch.arange(w.shape[0]), slot] = 0
    with pytest.raises(AssertionError, match="beyond the"):
        assert_linear_close(C.nm_linear_gemv(x, dropped, meta, n, m, None), x, w * mask)


def test_nm_linear_gemv_bad_arguments():
    _, _, values, meta = _compressed((4, 16), torch.float32, 2, 4)
    with pytest.raises(RuntimeError, match="x must have 16 columns"):
        C.nm_linear_gemv(torch.zeros(1, 12), values, meta, 2, 4, None)
    with pytest.raises(RuntimeError, match="meta must be"):
        C.nm_decompress(values, meta[:, :1].contiguous(), 2, 4)
    with pytest.raises(RuntimeError, match="x must have 16 columns"):
        C.nm_linear_gemv_path(torch.zeros(1, 12), values, meta, 2, 4)


# ----------------------------------------------------------------------------------------------
# Exact top-k masks (radix select), per row and per tensor, against reference.keep_top.

SCOPES = [True, False]  # per_row: one selection per row, or one over the whole tensor
TOPK_SHAPES = [(1, 1), (9, 1), (1, 7), (5, 37), (3, 4099), (7, 4096), (64, 4096)]


def _topk_expected(src, act, keep, per_row, kind):
    scores = src.float() if kind == 0 else ref.magnitude_score(src) if kind == 1 else ref.wanda_score(src, act)
    rows = scores.reshape(-1, scores.shape[-1]) if per_row else scores.reshape(1, -1)
    return ref.keep_top(rows, keep).reshape(scores.shape)


def _keeps(count, gen):
    """Keep counts 0, 1, half, all but one, all, and a random one."""
    return sorted({0, 1, count - 1, count, count // 2, int(torch.randint(0, count + 1, (1,), generator=gen))})


def _check_topk(src, act, keep, per_row, kind):
    got = C.topk_mask(src, act if kind == 2 else None, keep, per_row, kind)
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
                C.topk_mask(x, act[: shape[1]] if kind == 2 else None, keep, per_row, kind)


@pytest.mark.parametrize("per_row", SCOPES, ids=["row", "tensor"])
def test_topk_wanda_nan_from_act_sqnorm(per_row):
    x = torch.randn(2, 8)
    for col, value in [(3, -1.0), (6, float("nan"))]:  # sqrt(-1) = NaN; NaN
        act = torch.rand(8)
        act[col] = value
        with pytest.raises(ValueError, match=NAN_MSG):
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
        (lambda: C.topk_mask(x[0], None, 2, True, 0), "must be 2-D"),
        (lambda: C.topk_mask(torch.randn(8, 4).t(), None, 2, True, 0), "contiguous"),
        (lambda: C.topk_mask(x, None, 2, True, 2), "needs act_sqnorm"),
        (lambda: C.topk_mask(x, torch.rand(4), 2, True, 2), "act_sqnorm must be 1-D of length 8"),
        (lambda: C.topk_mask(x, None, 2, True, 3), "score_kind must be 0, 1 or 2"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call()


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
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    module = native_module("cuda")
    if module is None:  # setup.py builds it wherever CUDA is usable
        pytest.fail("a CUDA device is here but pyprune._C_cuda is not built; reinstall with "
                    "`pip install --no-build-isolation -e .`", pytrace=False)
    return module


def _check_cuda(CC, src, act, n, m, kind):
    got = CC.nm_mask(src.cuda(), act.cuda() if kind == 2 else None, n, m, kind)
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
    for shape in _shapes(m):
        src = _data(data, shape, dtype, gen)
        act = _act(shape[1], data, gen)
        _check_cuda(CC, src, act, n, m, kind)
        # Unaligned start (storage offset 1): the kernels' scalar-load path.
        flat = torch.empty(src.numel() + 1, dtype=dtype, device="cuda")
        flat[1:] = src.reshape(-1).cuda()
        view = flat[1:].view(shape)
        got = CC.nm_mask(view, act.cuda() if kind == 2 else None, n, m, kind)
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
            CC.nm_mask(x.cuda(), act.cuda() if kind == 2 else None, n, m, kind)
    # After an error the module still works.
    _check_cuda(CC, torch.randn(4, 64).to(dtype), torch.rand(64), 2, 4, kind)
