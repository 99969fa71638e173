"""pyprune.ops nm_format (nm_compress, nm_decompress) on every backend that implements it: the
kernels against the reference (exact), the round trip over random problems, and the C++
decompression called directly on awkward shapes. Without a GPU the Triton kernels run in the
interpreter."""
import pytest
import torch
from hypothesis import given

from pyprune import ops
from pyprune.ops import nm_format
from pyprune.ops import reference as R
from pyprune.ops.backend import native_module
from tests.helpers import randn
from tests.ops.common import (PROPERTY_BACKENDS, SETTINGS, awkward_shapes, compressed, kernel_backends, nm_problems,
                              property_backend)

C = native_module("cpu")
pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNEL_NM = [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (7, 32)]
NM = [(2, 4), (4, 8), (1, 2), (3, 8), (5, 16), (7, 32), (3, 6)]


@pytest.mark.parametrize("device", kernel_backends(nm_format._COMPRESS_IMPLS, nm_format._DECOMPRESS_IMPLS), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", KERNEL_NM)
def test_compress_decompress(device, dtype, n, m):
    w = randn((3, 4 * m), dtype, seed=13).to(device)
    mask = R.nm_mask(w.float().abs(), n, m)
    values, meta = ops.nm_compress(w, mask, n, m)
    ref_values, ref_meta = R.nm_compress(w, mask, n, m)
    assert torch.equal(values, ref_values) and torch.equal(meta, ref_meta)
    assert torch.equal(ops.nm_decompress(values, meta, n, m), w * mask)


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
@SETTINGS
@given(problem=nm_problems())
def test_compress_round_trip(backend, problem):
    w, n, m = problem
    with property_backend(backend):
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
