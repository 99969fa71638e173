"""pyprune.ops linear (nm_linear, sliced_linear, sparse24_linear) on every implementation that implements
it: the kernels against the dense masked / sliced matmul within the fp32-accumulation bound, the
gradients against autograd of the dense product, the C++ decode GEMV called directly (every token
count and awkward shape of its generic, AVX2 and AVX-512 kernels, each level where the CPU has it), and sparse24_linear's reference from the
mma.sp form, its CUDA kernel against it (gpu) and its argument checks. Without a GPU the Triton
kernels run in the interpreter."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pyprune import ops
from pyprune.ops import reference as R
from pyprune.ops.library import native
from pyprune.ops.conventions import sparse24_mma_meta
from tests.helpers import HAS_CUDA, assert_close, assert_linear_close, randn
from tests.ops.common import awkward_shapes, compressed, kernel_implementations

C = native("cpu")  # its helpers (cpu_isa, nm_linear_path)
#: On CPU tensors the ops run pyprune._C's kernels (tests/ops/test_registration.py).
K = torch.ops.pyprune
pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NM = [(2, 4), (4, 8), (1, 2), (3, 8), (5, 16), (7, 32), (3, 6)]
SPARSE24_DTYPES = [torch.float16, torch.bfloat16]
SPARSE24_SHAPES = [(1, 24, 64), (13, 130, 96), (70, 64, 512)]  # tokens, out_features, in_features


# ----------------------------------------------------------------------------------------------
# Every kernel implementation through the public API.


@pytest.mark.parametrize("device", kernel_implementations("nm_linear"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (9, 32)])
@pytest.mark.parametrize("rows,in_features,out_features", [(1, 64, 24), (5, 96, 70), (37, 96, 70)])
def test_nm_linear(device, dtype, n, m, rows, in_features, out_features):
    _check_nm_linear(device, dtype, n, m, rows, in_features // m * m, out_features)


@pytest.mark.parametrize("device", kernel_implementations("nm_linear"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_nm_linear_4096_wide_gemv(device, dtype, n, m):
    _check_nm_linear(device, dtype, n, m, 2, 4096, 20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nm_linear_cpu_past_the_gemv_rows(cpu_extension_is_built, dtype):
    """Over 256 rows the CPU kernel multiplies W decompressed 2 MiB of rows at a time (here two
    blocks and a partial one) with BLAS."""
    _check_nm_linear("cpu", dtype, 2, 4, 300, 1024, 1100 if dtype == torch.float32 else 2200)


def _check_nm_linear(device, dtype, n, m, rows, in_features, out_features):
    w = randn((out_features, in_features), dtype, seed=14).to(device)
    values, meta = R.nm_compress(w, R.nm_mask(w.float().abs(), n, m), n, m)
    x = randn((rows, in_features), dtype, seed=15).to(device)
    bias = randn((out_features,), dtype, seed=16).to(device)
    dense = R.nm_decompress(values, meta, n, m)
    assert_linear_close(ops.nm_linear(x, values, meta, n, m, bias), x, dense, bias)
    assert_linear_close(ops.nm_linear(x.reshape(1, rows, -1), values, meta, n, m)[0], x, dense)


@pytest.mark.parametrize("device", [pytest.param(("reference", "cpu"), id="reference"),
                                    *kernel_implementations("nm_linear")], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (64,), (2, 1, 3, 64)])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_nm_linear_takes_every_shape_nn_linear_takes(device, dtype, shape, grad):
    """As F.linear: an empty batch gives an empty result, a 1-D x one row, leading dims are kept."""
    w = randn((24, 64), dtype, seed=20).to(device)
    values, meta = R.nm_compress(w, R.nm_mask(w.float().abs(), 2, 4), 2, 4)
    bias = randn((24,), dtype, seed=21).to(device)
    x = randn(shape, dtype, seed=22).to(device).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = ops.nm_linear(x, values, meta, 2, 4, bias)
    dense = R.nm_decompress(values, meta, 2, 4)
    assert out.shape == F.linear(x, dense, bias).shape == (*shape[:-1], 24) and out.dtype == dtype
    if out.numel():
        assert_linear_close(out.reshape(-1, 24), x.reshape(-1, 64), dense, bias)
    if grad:
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("device", [pytest.param(("reference", "cpu"), id="reference"),
                                    *kernel_implementations("sliced_linear")], indirect=True)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (8,)])
def test_sliced_linear_takes_empty_batches_and_1d_inputs(device, shape):
    w, bias = randn((50, 40), seed=17).to(device), randn((50,), seed=18).to(device)
    in_index, out_index = torch.arange(0, 40, 5, device=device), torch.arange(49, 0, -7, device=device)
    x = randn(shape, seed=19).to(device)
    out = ops.sliced_linear(x, w, bias, in_index, out_index)
    expected = F.linear(x, w[out_index][:, in_index], bias[out_index])
    assert out.shape == expected.shape == (*shape[:-1], 7)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("device", kernel_implementations("sliced_linear"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_in,with_out", [(True, True), (True, False), (False, True), (False, False)])
def test_sliced_linear(device, dtype, with_in, with_out):
    w = randn((50, 40), dtype, seed=17).to(device)
    bias = randn((50,), dtype, seed=18).to(device)
    in_index = torch.tensor([0, 3, 4, 10, 11, 12, 39, 20], device=device) if with_in else None
    out_index = torch.arange(49, 0, -3, device=device) if with_out else None
    x = randn((3, 5, 8 if with_in else 40), dtype, seed=19).to(device)
    expected = R.sliced_linear(x.float(), w.float(), bias.float(), in_index, out_index)
    assert_close(ops.sliced_linear(x, w, bias, in_index, out_index), expected, dtype)


# ----------------------------------------------------------------------------------------------
# Gradients (nm_linear and sliced_linear carry their own backward).


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m,rows", [(2, 4, 3), (4, 8, 20), (3, 6, 2)])
def test_nm_linear_gradients_match_dense_masked_matmul(dtype, n, m, rows):
    w = randn((24, 48), dtype, seed=1)
    mask = R.nm_mask(w.float().abs(), n, m)
    values, meta = R.nm_compress(w, mask, n, m)
    x, bias = randn((2, rows, 48), dtype, seed=2), randn((24,), dtype, seed=3)
    grad_out = randn((2, rows, 24), dtype, seed=4)

    xs, vs, bs = _leaf(x), _leaf(values), _leaf(bias)
    ops.nm_linear(xs, vs, meta, n, m, bs).backward(grad_out)

    xd, wd, bd = _leaf(x.float()), _leaf((w * mask).float()), _leaf(bias.float())
    torch.nn.functional.linear(xd, wd * mask, bd).backward(grad_out.float())
    assert_close(xs.grad, xd.grad, dtype)
    assert_close(vs.grad, wd.grad[mask].reshape(values.shape), dtype)
    assert_close(bs.grad, bd.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliced_linear_gradients_reach_only_the_kept_block(dtype):
    w, bias = randn((10, 12), dtype, seed=5), randn((10,), dtype, seed=6)
    in_index, out_index = torch.tensor([7, 0, 3, 11]), torch.tensor([9, 2, 4])
    x, grad_out = randn((5, 4), dtype, seed=7), randn((5, 3), dtype, seed=8)

    xs, ws, bs = _leaf(x), _leaf(w), _leaf(bias)
    ops.sliced_linear(xs, ws, bs, in_index, out_index).backward(grad_out)

    xd, wd, bd = _leaf(x.float()), _leaf(w.float()), _leaf(bias.float())
    torch.nn.functional.linear(xd, wd[out_index][:, in_index], bd[out_index]).backward(grad_out.float())
    assert_close(xs.grad, xd.grad, dtype)
    assert_close(ws.grad, wd.grad, dtype)
    assert_close(bs.grad, bd.grad, dtype)
    untouched = torch.ones_like(w, dtype=torch.bool)
    untouched[out_index[:, None], in_index[None, :]] = False
    assert not ws.grad[untouched].any()


# ----------------------------------------------------------------------------------------------
# pyprune._C's nm_linear on CPU tensors, its decode GEMV (up to 256 rows; fp32 accumulation).


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# the AVX2 permute (1) and expand paths for 1:2, 2:4, 4:8; past 8 tokens, chunks of 8 (12: 8 + 4;
# 17: 8 + 8 + a one-token chunk, permuted)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 12, 17])
def test_nm_linear_gemv_matches_dense_masked_matmul(dtype, n, m, tokens):
    for shape in awkward_shapes(m)[:5]:
        w, mask, values, meta = compressed(shape, dtype, n, m, seed=1)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(tokens, shape[1], generator=gen).to(dtype)
        bias = torch.randn(shape[0], generator=gen).to(dtype)
        got = K.nm_linear(x, values, meta, n, m, bias)
        assert got.dtype == dtype and got.shape == (tokens, shape[0])
        assert_linear_close(got, x, w * mask, bias)


def _cpu_flags():
    """The CPU feature flags the kernel reports on, from /proc/cpuinfo (independent of it)."""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo lists no CPU flags")


#: Each level of pyprune._C's kernels and the /proc/cpuinfo flags it adds to the one before.
ISA_LEVELS = {"generic": set(), "avx2": {"avx2", "fma", "f16c"},
              "avx512": {"avx512f"}, "avx512_bf16": {"avx512bw", "avx512_vbmi2", "avx512_bf16"}}


def _missing_flags(isa):
    """The flags this CPU lacks for ``isa`` and every level below it."""
    levels = list(ISA_LEVELS)
    needed = set().union(*(ISA_LEVELS[level] for level in levels[:levels.index(isa) + 1]))
    return sorted(needed - _cpu_flags())


def test_cpu_isa_detection_matches_proc_cpuinfo():
    detected = [isa for isa in ISA_LEVELS if not _missing_flags(isa)][-1]
    assert C.cpu_isa(detected=True) == detected


@pytest.fixture
def cpu_isa(request):
    """Cap pyprune._C at the level ``request.param`` for one test (skipped, naming the flags, where
    this CPU lacks them), then restore the cap."""
    missing = _missing_flags(request.param)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for the {request.param} kernels")
    previous = C.limit_cpu_isa(request.param)
    assert C.cpu_isa() == request.param
    yield request.param
    C.limit_cpu_isa(previous)


def test_cpu_isa_limit_names_the_allowed_levels_and_env_caps_it():
    with pytest.raises(ValueError, match="generic, avx2, avx512, avx512_bf16; got 'sse'"):
        C.limit_cpu_isa("sse")
    code = "from pyprune.ops.library import native as n; print(n('cpu').cpu_isa())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYPRUNE_MAX_CPU_ISA": "generic"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "generic"


#: The kernel each level runs for one and for more tokens of a half-density pattern, per dtype.
def _expected_path(isa, dtype, tokens):
    if isa == "generic":
        return "generic"
    if isa == "avx2":
        return "avx2_permute" if tokens == 1 else "avx2_expand"
    return "avx512_bf16_dot" if isa == "avx512_bf16" and dtype == torch.bfloat16 else "avx512_expand"


# Rows: passes of 8/6/4/3/2 rows plus leftovers, more than one 48-row panel (97); columns: whole
# 16-, 32- and 64-column blocks, a trailing byte (cols % 16 == 8), a trailing half byte for 2:4 and
# 1:2 (cols % 8 == 4), and more than one 2048-column x block (4104).
HALF_DENSITY_SHAPES = [(1, 16), (5, 24), (7, 52), (9, 4096), (3, 4104), (4, 36), (97, 360)]


@pytest.mark.parametrize("cpu_isa", list(ISA_LEVELS), indirect=True)
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (4, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# every register-blocked count (1-8) is its own template; then chunks of 8 with every remainder
@pytest.mark.parametrize("tokens", [*range(1, 10), 16, 23, 64])
def test_half_density_kernels_every_token_count_and_awkward_shape(cpu_isa, dtype, n, m, tokens):
    for shape in HALF_DENSITY_SHAPES:
        if shape[1] % m or (tokens > 9 and shape[0] * shape[1] > 40000):  # the long rows: few counts
            continue
        w, mask, values, meta = compressed(shape, dtype, n, m, seed=7)
        x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(8)).to(dtype)
        bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(9)).to(dtype)
        assert C.nm_linear_path(x, values, meta, n, m) == _expected_path(cpu_isa, dtype, tokens)
        assert_linear_close(K.nm_linear(x, values, meta, n, m, bias), x, w * mask, bias)
        assert_linear_close(K.nm_linear(x, values, meta, n, m, None), x, w * mask)


@pytest.mark.parametrize("cpu_isa", list(ISA_LEVELS), indirect=True)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("tokens", [1, 8])
def test_bf16_gemv_is_as_close_to_the_exact_product_as_torchs_bf16_linear(cpu_isa, n, m, tokens):
    # SmolLM2-135M's linear shapes: the kernel sums in fp32 and rounds once, as torch's bf16 GEMM
    # does, so its largest error against the fp64 product is no larger (only the order differs)
    for shape in [(576, 576), (1536, 576), (576, 1536)]:
        w, mask, values, meta = compressed(shape, torch.bfloat16, n, m, seed=3)
        x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        exact = x.double() @ (w * mask).double().t()
        kernel_error = (K.nm_linear(x, values, meta, n, m, None).double() - exact).abs().max()
        torch_error = (F.linear(x, w * mask).double() - exact).abs().max()
        assert kernel_error <= torch_error * 1.01, (shape, float(kernel_error), float(torch_error))


@pytest.mark.parametrize("tokens,n,m,cols", [(1, 3, 6, 48), (2, 3, 6, 96), (1, 1, 4, 64), (8, 3, 8, 64), (19, 3, 8, 64)])
def test_other_gemv_shapes_take_the_generic_kernel(tokens, n, m, cols):
    # 3:6 is half density too, but its groups straddle mask bytes (the lane tables need 4 of 8)
    w, mask, values, meta = compressed((5, cols), torch.float32, n, m)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(10))
    assert C.nm_linear_path(x, values, meta, n, m) == "generic"
    assert_linear_close(K.nm_linear(x, values, meta, n, m, None), x, w * mask)


def test_double_takes_the_generic_kernel():
    w, mask, values, meta = compressed((5, 64), torch.float64, 2, 4)
    x = torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    assert C.nm_linear_path(x, values, meta, 2, 4) == "generic"
    assert_linear_close(K.nm_linear(x, values, meta, 2, 4, None), x, w * mask)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_nm_linear_gemv_check_catches_one_dropped_weight(dtype, n, m, tokens):
    # The tolerance is tight enough to matter: a kernel that skips one kept weight per row (the
    # one of median contribution to the first token) fails the check on 4096-wide rows.
    w, mask, values, meta = compressed((64, 4096 - 4096 % m), dtype, n, m, seed=5)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(6)).to(dtype)
    assert_linear_close(K.nm_linear(x, values, meta, n, m, None), x, w * mask)
    contribution = (x[0].float() * (w * mask).float()).abs().masked_fill(~mask, float("inf"))
    median_column = contribution.sort(dim=1).indices[:, values.shape[1] // 2]
    dropped = values.clone()
    slot = (mask.cumsum(dim=1) - 1).gather(1, median_column[:, None]).squeeze(1)
    dropped[torch.arange(w.shape[0]), slot] = 0
    with pytest.raises(AssertionError, match="beyond the"):
        assert_linear_close(K.nm_linear(x, dropped, meta, n, m, None), x, w * mask)


def test_nm_linear_gemv_bad_arguments():
    _, _, values, meta = compressed((4, 16), torch.float32, 2, 4)
    with pytest.raises(RuntimeError, match="x must have 16 columns"):
        K.nm_linear(torch.zeros(1, 12), values, meta, 2, 4, None)
    with pytest.raises(RuntimeError, match="meta must be"):
        K.nm_decompress(values, meta[:, :1].contiguous(), 2, 4)
    with pytest.raises(RuntimeError, match="x must have 16 columns"):
        C.nm_linear_path(torch.zeros(1, 12), values, meta, 2, 4)


# ----------------------------------------------------------------------------------------------
# sparse24_linear: 2:4 on sparse tensor cores (CUDA mma.sp), its reference and its checks.


def _sparse24_problem(dtype, tokens, out_features, in_features, device="cpu"):
    """(x, w ⊙ mask, bias, values, mma_meta) of a random 2:4-pruned layer."""
    w = randn((out_features, in_features), dtype, seed=8)
    mask = R.nm_mask(w.float().abs(), 2, 4)
    values, meta = R.nm_compress(w, mask, 2, 4)
    x, bias = randn((tokens, in_features), dtype, seed=9), randn((out_features,), dtype, seed=10)
    tensors = (x, w * mask, bias, values, sparse24_mma_meta(meta, in_features))
    return tuple(t.to(device) for t in tensors)


@pytest.mark.parametrize("dtype", SPARSE24_DTYPES, ids=str)
@pytest.mark.parametrize("tokens,out_features,in_features", SPARSE24_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_sparse24_linear_reference_is_the_dense_masked_product(dtype, tokens, out_features, in_features, with_bias):
    x, dense, bias, values, mma_meta = _sparse24_problem(dtype, tokens, out_features, in_features)
    bias = bias if with_bias else None
    expected = F.linear(x.float(), dense.float(), None if bias is None else bias.float()).to(dtype)
    with ops.use_implementation("reference"):
        out = ops.sparse24_linear(x, values, mma_meta, bias)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    assert torch.equal(out, expected)


def test_sparse24_linear_leading_dims_are_tokens():
    x, dense, bias, values, mma_meta = _sparse24_problem(torch.float16, 6, 24, 64)
    out = ops.sparse24_linear(x.reshape(2, 3, 64), values, mma_meta, bias)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.reshape(6, 24), ops.sparse24_linear(x, values, mma_meta, bias))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", SPARSE24_DTYPES, ids=str)
@pytest.mark.parametrize("tokens,out_features,in_features", SPARSE24_SHAPES)
def test_sparse24_linear_cuda_kernel_matches_the_reference(dtype, tokens, out_features, in_features):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.fail("sparse24_linear needs sm80 or newer; run the gpu tests on such a device", pytrace=False)
    x, _, bias, values, mma_meta = _sparse24_problem(dtype, tokens, out_features, in_features, device="cuda")
    with ops.use_implementation("reference"):
        expected = ops.sparse24_linear(x, values, mma_meta, bias)
    with ops.use_implementation("cuda"):
        out = ops.sparse24_linear(x, values, mma_meta, bias)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _sparse24_bad_calls():
    x, _, bias, values, mma_meta = _sparse24_problem(torch.float16, 2, 8, 32)
    return [
        (lambda: ops.sparse24_linear(x.float(), values.float(), mma_meta), TypeError,
         "values must have dtype float16 or bfloat16; got torch.float32"),
        (lambda: ops.sparse24_linear(x[:, :16], values[:, :8], mma_meta[:, :1]), ValueError,
         "in a multiple of 32"),
        (lambda: ops.sparse24_linear(x, values, mma_meta.to(torch.int32)), TypeError,
         "mma_meta must be an int16 tensor"),
        (lambda: ops.sparse24_linear(x, values, mma_meta[:4]), ValueError, "mma_meta must have the shape"),
        (lambda: ops.sparse24_linear(x.bfloat16(), values, mma_meta), TypeError, "x and values must have one dtype"),
        (lambda: ops.sparse24_linear(x, values, mma_meta, bias[:4]), ValueError, r"bias must be \[8\]"),
        (lambda: ops.sparse24_linear(torch.ones(2, 64, dtype=torch.float16), values, mma_meta), ValueError,
         "x must have 32 features"),
    ]


@pytest.mark.parametrize("case", range(len(_sparse24_bad_calls())))
def test_sparse24_linear_bad_arguments_name_the_argument(case):
    call, error, message = _sparse24_bad_calls()[case]
    with pytest.raises(error, match=message):
        call()
