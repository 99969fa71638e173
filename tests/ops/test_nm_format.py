"""pyprune.ops nm_format (nm_compress, nm_decompress) on every implementation that implements it: the
kernels against the reference (exact), the round trip over random problems, and the C++
decompression called directly on awkward shapes. Without a GPU the Triton kernels run in the
interpreter."""
import pytest
import torch
from hypothesis import given

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import randn
from tests.ops.common import (PROPERTY_IMPLEMENTATIONS, SETTINGS, awkward_shapes, compressed, kernel_implementations,
                              nm_problems, property_implementation)

#: On CPU tensors the ops run pyprune._C's kernels (tests/ops/test_registration.py).
C = torch.ops.pyprune
pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNEL_NM = [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (7, 32)]
NM = [(2, 4), (4, 8), (1, 2), (3, 8), (5, 16), (7, 32), (3, 6)]


@pytest.mark.parametrize("device", kernel_implementations("nm_compress", "nm_decompress"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", KERNEL_NM)
def test_compress_decompress(device, dtype, n, m):
    w = randn((3, 4 * m), dtype, seed=13).to(device)
    mask = R.nm_mask(w.float().abs(), n, m)
    values, meta = ops.nm_compress(w, mask, n, m)
    ref_values, ref_meta = R.nm_compress(w, mask, n, m)
    assert torch.equal(values, ref_values) and torch.equal(meta, ref_meta)
    assert torch.equal(ops.nm_decompress(values, meta, n, m), w * mask)


@pytest.mark.parametrize("implementation", PROPERTY_IMPLEMENTATIONS)
@SETTINGS
@given(problem=nm_problems())
def test_compress_round_trip(implementation, problem):
    w, n, m = problem
    with property_implementation(implementation):
        mask = ops.score_nm_mask(w, n, m)
        values, meta = ops.nm_compress(w, mask, n, m)
        assert values.shape == (w.shape[0], w.shape[1] * n // m)
        assert torch.equal(ops.nm_decompress(values, meta, n, m), w * mask)
        again = ops.nm_compress(ops.nm_decompress(values, meta, n, m), mask, n, m)
        assert torch.equal(again[0], values) and torch.equal(again[1], meta)


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nm_decompress_is_exact(dtype, n, m):
    for shape in awkward_shapes(m):
        w, mask, values, meta = compressed(shape, dtype, n, m)
        assert torch.equal(C.nm_decompress(values, meta, n, m), w * mask), shape


@pytest.mark.parametrize("device", [pytest.param(("reference", "cpu"), id="reference"),
                                    *kernel_implementations("sparse24_compress")], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (13, 96), (64, 512)])
def test_sparse24_compress_is_nm_compress_with_the_mma_metadata(device, dtype, shape):
    w = randn(shape, dtype, seed=21).to(device)
    mask = R.nm_mask(w.float().abs(), 2, 4)
    values, mma_meta = ops.sparse24_compress(w, mask)
    ref_values, packed = R.nm_compress(w, mask, 2, 4)
    assert torch.equal(values, ref_values)
    assert mma_meta.dtype == torch.int16 and torch.equal(mma_meta, R.sparse24_mma_meta(packed, shape[1]))


@pytest.mark.parametrize("call,error,message", [
    (lambda w, mask: ops.sparse24_compress(w.float(), mask), TypeError, "w must have dtype float16 or bfloat16"),
    (lambda w, mask: ops.sparse24_compress(w[:, :16], mask[:, :16]), ValueError, "multiple of 32 columns; got 16"),
    (lambda w, mask: ops.sparse24_compress(w, mask.half()), TypeError, "mask must be a bool tensor"),
    (lambda w, mask: ops.sparse24_compress(w, mask[:2]), ValueError, "mask must have the shape of w"),
    (lambda w, mask: ops.sparse24_compress(w, torch.ones_like(mask)), ValueError,
     "mask must keep exactly n=2 of every m=4 elements; row 0, group 0 keeps 4"),
])
def test_sparse24_compress_bad_arguments_name_the_argument(call, error, message):
    w = randn((4, 32), torch.float16, seed=22)
    with pytest.raises(error, match=message):
        call(w, R.nm_mask(w.float().abs(), 2, 4))
