"""pyprune.ops prox (soft_threshold, group_soft_threshold) on every implementation that implements it:
the kernels against the reference within dtype tolerance on awkward shapes, and the group
shrinkage property over random problems. Without a GPU the Triton kernels run in the interpreter."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import DTYPES, assert_close, randn
from tests.ops.common import DEVICE, PROPERTY_IMPLEMENTATIONS, SETTINGS, kernel_implementations, property_implementation


@pytest.mark.parametrize("device", kernel_implementations("soft_threshold"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 1025), (1, 4096)])
def test_soft_threshold(device, dtype, shape):
    x = randn(shape, dtype, seed=11).to(device)
    assert_close(ops.soft_threshold(x, 0.4), R.soft_threshold(x, 0.4), dtype)


@pytest.mark.parametrize("device", kernel_implementations("group_soft_threshold"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group_dim", [((1, 7), 0), ((5, 4096), 0), ((4096, 3), 1),
                                             ((70, 33), 1), ((3, 5, 6), 1), ((9,), 0)])
def test_group_soft_threshold(device, dtype, shape, group_dim):
    x = randn(shape, dtype, seed=12).to(device)
    others = [d for d in range(x.dim()) if d != group_dim]
    norms = x.float().square().sum(dim=others).sqrt() if others else x.float().abs()
    alpha = float(norms.median())  # about half of the groups vanish
    out = ops.group_soft_threshold(x, alpha, group_dim)
    expected = R.group_soft_threshold(x, alpha, group_dim)
    assert_close(out, expected, dtype)
    assert out.dtype == dtype


@pytest.mark.parametrize("implementation", PROPERTY_IMPLEMENTATIONS)
@SETTINGS
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), alpha=st.floats(0.0, 3.0),
       group_dim=st.integers(0, 1), seed=st.integers(0, 2 ** 16))
def test_group_soft_threshold_shrinks_norms_by_alpha(implementation, rows, cols, alpha, group_dim, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    with property_implementation(implementation):
        z = ops.group_soft_threshold(x, alpha, group_dim)
    other = 1 - group_dim
    before, after = x.norm(dim=other), z.norm(dim=other)
    # ‖prox(x)_g‖ = max(‖x_g‖ − α, 0), and the direction of each group is kept
    torch.testing.assert_close(after, (before - alpha).clamp_min(0), rtol=1e-5, atol=1e-5)
    cosine = (x * z).sum(dim=other)
    assert bool((cosine >= -1e-6).all())
