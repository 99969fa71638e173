"""Shared by the op family tests: the kernel implementations of an op, the property-test set-up
(hypothesis settings, N:M problems, the implementations they run on) and awkward shapes and
compressed weights."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import pyprune.ops.reference as ref
from pyprune import ops
from tests.helpers import HAS_CUDA, NATIVE_IMPLEMENTATIONS

#: pyprune._C_cuda (the native CUDA kernels), on a GPU only.
CUDA_IMPLEMENTATION = pytest.param(("cuda", "cuda"), id="cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")])


def kernel_implementations(*op_names):
    """(implementation, device) params of the non-reference implementations every op of
    ``op_names`` has (:data:`pyprune.ops.IMPLEMENTATIONS`); feed them to the ``device`` fixture
    (tests/ops/conftest.py) with ``indirect=True``."""
    names = set.intersection(*(set(ops.IMPLEMENTATIONS[op]) for op in op_names))
    return [p for p in NATIVE_IMPLEMENTATIONS + [CUDA_IMPLEMENTATION] if p.values[0][0] in names]


#: The property tests run on the dispatcher's choice and on the Triton kernels.
PROPERTY_IMPLEMENTATIONS = ["auto", "triton"]
DEVICE = "cuda" if HAS_CUDA else "cpu"
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nm_problems(draw):
    """(scores on a few levels, n, m): N:M problems with many ties."""
    m = draw(st.integers(2, 16))
    n = draw(st.integers(1, m - 1))
    rows, groups = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    levels = draw(st.integers(1, 6))  # few levels = many ties
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-levels, levels + 1, (rows, groups * m), generator=g).float() / 2
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return scores.to(dtype).to(DEVICE), n, m


def property_implementation(name):
    """use_implementation for a name of PROPERTY_IMPLEMENTATIONS ("auto": the dispatcher's choice)."""
    return ops.use_implementation(None if name == "auto" else name)


def awkward_shapes(m):
    """Awkward shapes: one group, one row, cols not a multiple of 64, rows crossing kernel blocks."""
    wide = 4096 - 4096 % m  # 4096-wide rows (4092 for m = 6)
    return [(1, m), (1, 3 * m), (2, 37 * m), (5, wide), (33, 11 * m), (64, wide)]


def compressed(shape, dtype, n, m, seed=0):
    """(w, its N:M magnitude mask, values, meta) of a random weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen).to(dtype)
    mask = ref.nm_mask(w.float().abs(), n, m)
    return w, mask, *ref.nm_compress(w, mask, n, m)
