"""Autograd of nm_linear and sliced_linear equals autograd of the dense masked / sliced matmul."""
import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R

from tests.helpers import DTYPES, assert_close, randn


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
