"""Every Triton kernel against the reference: masks exactly equal, values within dtype tolerance,
for fp32/fp16/bf16 on awkward shapes (one row, one group, sizes off the block, 4096-wide rows).
Without a GPU the kernels run in the Triton interpreter."""
import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import DTYPES, KERNEL_DEVICES, assert_close, assert_linear_close, rand, randn, tied_scores

pytestmark = pytest.mark.parametrize("device", KERNEL_DEVICES)

SHAPES = [(1, 8), (1, 4096), (7, 40), (33, 96)]
NM = [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (7, 32)]


@pytest.fixture(autouse=True)
def triton_backend():
    with ops.use_backend("triton"):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scores(device, dtype, shape):
    w, g = randn(shape, dtype, seed=1).to(device), randn(shape, dtype, seed=2).to(device)
    sqnorm = (rand(shape[1:], seed=3) * 10).to(device)
    assert torch.equal(ops.magnitude_score(w), R.magnitude_score(w))
    assert torch.equal(ops.wanda_score(w, sqnorm), R.wanda_score(w, sqnorm))
    assert torch.equal(ops.taylor_score(w, g), R.taylor_score(w, g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3), (2, 5, 4096), (1000, 7)])
def test_accumulate_sqnorm(device, dtype, shape):
    x = randn(shape, dtype, seed=4).to(device)
    acc, expected = torch.ones(shape[-1], device=device), torch.ones(shape[-1], device=device)
    out = ops.accumulate_sqnorm_(acc, x)
    assert out is acc
    torch.testing.assert_close(acc, R.accumulate_sqnorm_(expected, x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", NM)
def test_nm_mask_exact(device, dtype, n, m):
    for shape in [(1, m), (3, 5 * m), (2, 4096 // 32 * m)]:
        scores = tied_scores(shape, dtype, seed=n + m).to(device)
        assert torch.equal(ops.nm_mask(scores, n, m), R.nm_mask(scores, n, m)), shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (3, 6)])
def test_score_nm_mask_exact(device, dtype, n, m):
    w = tied_scores((9, 12 * m), dtype, seed=5, levels=5).to(device) - 2
    sqnorm = torch.randint(0, 4, (12 * m,), generator=torch.Generator().manual_seed(6)).float().to(device)
    assert torch.equal(ops.score_nm_mask(w, n, m), R.score_nm_mask(w, n, m))
    assert torch.equal(ops.score_nm_mask(w, n, m, sqnorm), R.score_nm_mask(w, n, m, sqnorm))


def test_nm_mask_with_infinities(device):
    scores = torch.tensor([[float("inf"), 1.0, float("-inf"), float("inf"),
                            float("-inf"), float("-inf"), 0.0, -0.0]], device=device)
    expected = torch.tensor([[True, False, False, True, False, False, True, True]])
    assert torch.equal(ops.nm_mask(scores, 2, 4).cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.999])
def test_topk_mask_exact(device, dtype, scope, sparsity):
    for shape in [(1, 1), (6, 37)]:
        scores = tied_scores(shape, dtype, seed=7).to(device)
        assert torch.equal(ops.topk_mask(scores, sparsity, scope), R.topk_mask(scores, sparsity, scope))


@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_topk_mask_wide_rows(device, scope):
    scores = randn((2, 4096), torch.bfloat16, seed=8).to(device)  # bf16 values tie often
    assert torch.equal(ops.topk_mask(scores, 0.5, scope), R.topk_mask(scores, 0.5, scope))


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_topk_mask_exact(device, dtype):
    w = randn((5, 70), dtype, seed=9).to(device)
    sqnorm = rand((70,), seed=10).to(device)
    for scope in ("row", "tensor"):
        assert torch.equal(ops.score_topk_mask(w, 0.6, scope), R.score_topk_mask(w, 0.6, scope))
        assert torch.equal(ops.score_topk_mask(w, 0.3, scope, sqnorm),
                           R.score_topk_mask(w, 0.3, scope, sqnorm))


@pytest.mark.parametrize("op", ["nm_mask", "topk_mask"])
def test_nan_scores_raise(device, op):
    scores = torch.ones(3, 8, device=device)
    scores[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ops.nm_mask(scores, 2, 4) if op == "nm_mask" else ops.topk_mask(scores, 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 1025), (1, 4096)])
def test_soft_threshold(device, dtype, shape):
    x = randn(shape, dtype, seed=11).to(device)
    assert_close(ops.soft_threshold(x, 0.4), R.soft_threshold(x, 0.4), dtype)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", NM)
def test_compress_decompress(device, dtype, n, m):
    w = randn((3, 4 * m), dtype, seed=13).to(device)
    mask = R.nm_mask(w.float().abs(), n, m)
    values, meta = ops.nm_compress(w, mask, n, m)
    ref_values, ref_meta = R.nm_compress(w, mask, n, m)
    assert torch.equal(values, ref_values) and torch.equal(meta, ref_meta)
    assert torch.equal(ops.nm_decompress(values, meta, n, m), w * mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 2), (3, 6), (5, 16), (9, 32)])
@pytest.mark.parametrize("rows,in_features,out_features", [(1, 64, 24), (5, 96, 70), (37, 96, 70)])
def test_nm_linear(device, dtype, n, m, rows, in_features, out_features):
    _check_nm_linear(device, dtype, n, m, rows, in_features // m * m, out_features)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_nm_linear_4096_wide_gemv(device, dtype, n, m):
    _check_nm_linear(device, dtype, n, m, 2, 4096, 20)


def _check_nm_linear(device, dtype, n, m, rows, in_features, out_features):
    w = randn((out_features, in_features), dtype, seed=14).to(device)
    values, meta = R.nm_compress(w, R.nm_mask(w.float().abs(), n, m), n, m)
    x = randn((rows, in_features), dtype, seed=15).to(device)
    bias = randn((out_features,), dtype, seed=16).to(device)
    dense = R.nm_decompress(values, meta, n, m)
    assert_linear_close(ops.nm_linear(x, values, meta, n, m, bias), x, dense, bias)
    assert_linear_close(ops.nm_linear(x.reshape(1, rows, -1), values, meta, n, m)[0], x, dense)


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
