"""pyprune.ops scores on every implementation that implements them: the scores (magnitude, Wanda, Taylor)
and Wanda's statistic accumulate_sqnorm_ against the reference, then COPAL's accumulation
accumulate_abs_outer_ (acc += alpha·|a|ᵀ|b|).

Each implementation (the reference, the C++ kernel, the Triton kernel in the interpreter or on a GPU) is
checked against an fp64 oracle with a rounding bound: every product of |a| and |b| is exact in
fp64 and the fp32 sums of non-negative terms err by at most (T + a few)·u₃₂ relative to the sum of
magnitudes, so a wrong mask, a missing |·| or a lost tile is far outside it.
"""
import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import IMPLEMENTATIONS, DTYPES, rand, randn
from tests.ops.common import kernel_implementations

#: (tokens T, M, D): single elements, sizes off every tile (Triton 64×64×32 in the interpreter),
#: more than GROUP_M tile rows (600), and T across the C++ kernel's 512-token chunks (1100).
SHAPES = [(1, 1, 1), (7, 33, 100), (33, 129, 7), (100, 1, 129), (129, 100, 33), (9, 600, 130),
          (1100, 20, 36)]
U32 = torch.finfo(torch.float32).eps / 2


pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")


def _inputs(tokens, M, D, a_dtype, b_dtype, seed=0):
    """a [T, M] like an output sensitivity (small: some fp16 values are subnormal), b [T, D] like
    activations."""
    a = randn((tokens, M), seed=seed) * 1e-2
    b = randn((tokens, D), seed=seed + 1) * 4
    return a.to(a_dtype), b.to(b_dtype)


def _run(implementation_device, acc, a, b, alpha=1.0):
    """The op on the implementation and device; returns acc back on the CPU."""
    name, device = implementation_device
    acc = acc.to(device)
    with ops.use_implementation(name):
        out = ops.accumulate_abs_outer_(acc, a.to(device), b.to(device), alpha=alpha)
    assert out is acc
    return acc.cpu()


def _assert_matches_oracle(actual, acc0, a, b, alpha=1.0, calls=1):
    """actual == acc0 + alpha·|a|ᵀ|b| within the fp32 rounding bound (alpha rounded to fp32, as the
    kernels use it); ``calls`` is how many accumulations produced it."""
    a64 = a.reshape(-1, a.shape[-1]).double().abs()
    b64 = b.reshape(-1, b.shape[-1]).double().abs()
    alpha32 = float(torch.tensor(alpha, dtype=torch.float32))
    products = a64.T @ b64
    exact = acc0.double() + alpha32 * products
    magnitude = acc0.double().abs() + abs(alpha32) * products
    bound = (a64.shape[0] + 4 * calls + 4) * U32 * magnitude + 1e-30
    error = (actual.double() - exact).abs()
    bad = error > bound
    if bool(bad.any()):
        worst = int((error / bound).argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
        raise AssertionError(f"{int(bad.sum())} of {error.numel()} entries beyond the bound; worst at {at}: "
                             f"got {float(actual[at])}, exact {float(exact[at]):.8g}, bound {float(bound[at]):.3g}")
    assert actual.dtype == torch.float32


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-M{}-D{}".format(*s))
def test_matches_oracle(implementation_device, shape, dtype):
    tokens, M, D = shape
    a, b = _inputs(tokens, M, D, dtype, dtype, seed=sum(shape))
    acc0 = torch.zeros(M, D)
    _assert_matches_oracle(_run(implementation_device, acc0.clone(), a, b), acc0, a, b)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("a_dtype,b_dtype", [(x, y) for x in DTYPES for y in DTYPES if x != y], ids=str)
def test_mixed_dtypes(implementation_device, a_dtype, b_dtype):
    a, b = _inputs(70, 129, 33, a_dtype, b_dtype, seed=3)
    acc0 = torch.zeros(129, 33)
    _assert_matches_oracle(_run(implementation_device, acc0.clone(), a, b), acc0, a, b)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("alpha", [2.0, 0.3, -1.5, 0.0])
def test_alpha_and_a_nonzero_accumulator(implementation_device, alpha):
    a, b = _inputs(45, 37, 66, torch.bfloat16, torch.float32, seed=4)
    acc0 = randn((37, 66), seed=5) * 3
    _assert_matches_oracle(_run(implementation_device, acc0.clone(), a, b, alpha), acc0, a, b, alpha)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_halves_equal_one_call(implementation_device, dtype):
    """Accumulating batch after batch is the sum over all their tokens (COPAL's G_k = G_{k-1} + …)."""
    a, b = _inputs(2 * 600, 29, 70, dtype, dtype, seed=6)
    acc0 = randn((29, 70), seed=7).abs()
    whole = _run(implementation_device, acc0.clone(), a, b, 2.0)
    halves = _run(implementation_device, _run(implementation_device, acc0.clone(), a[:600], b[:600], 2.0), a[600:], b[600:], 2.0)
    _assert_matches_oracle(whole, acc0, a, b, 2.0)
    _assert_matches_oracle(halves, acc0, a, b, 2.0, calls=2)
    scale = float((acc0 + 2 * a.float().abs().T @ b.float().abs()).max())
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_leading_dims_are_tokens(implementation_device):
    a, b = _inputs(2 * 5 * 3, 17, 40, torch.float16, torch.float16, seed=8)
    a3, b3 = a.reshape(2, 5, 3, 17), b.reshape(2, 5, 3, 40)
    acc0 = torch.ones(17, 40)
    got = _run(implementation_device, acc0.clone(), a3, b3, 2.0)
    assert torch.equal(got, _run(implementation_device, acc0.clone(), a, b, 2.0))
    _assert_matches_oracle(got, acc0, a, b, 2.0)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_non_contiguous_operands(implementation_device):
    a_t, b_t = _inputs(40, 19, 33, torch.float32, torch.bfloat16, seed=9)
    a, b = a_t.T.contiguous().T, b_t.T.contiguous().T  # the same values, column-major
    assert not a.is_contiguous() and not b.is_contiguous()
    acc0 = torch.zeros(19, 33)
    _assert_matches_oracle(_run(implementation_device, acc0.clone(), a, b), acc0, a_t, b_t)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_deterministic(implementation_device):
    a, b = _inputs(300, 70, 45, torch.bfloat16, torch.bfloat16, seed=10)
    first = _run(implementation_device, torch.zeros(70, 45), a, b, 2.0)
    assert torch.equal(first, _run(implementation_device, torch.zeros(70, 45), a, b, 2.0))


# ---- argument checks, tracing -------------------------------------------------------------------

ACC, A, B = torch.zeros(4, 6), torch.ones(3, 4), torch.ones(3, 6)
_BUFFER = torch.zeros(64)


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.accumulate_abs_outer_(ACC.numpy(), A, B), TypeError, "acc must be a torch.Tensor"),
    (lambda: ops.accumulate_abs_outer_(ACC.half(), A, B), TypeError, "acc must have dtype torch.float32"),
    (lambda: ops.accumulate_abs_outer_(ACC.double(), A, B), TypeError, "acc must have dtype float32, float16"),
    (lambda: ops.accumulate_abs_outer_(torch.zeros(24), A, B), ValueError, "acc must be 2-D"),
    (lambda: ops.accumulate_abs_outer_(torch.zeros(6, 4).T, A, B), ValueError, "acc must be contiguous"),
    (lambda: ops.accumulate_abs_outer_(ACC, torch.ones(3, 5), B), ValueError,
     r"a must have acc's 4 rows as its last dim; got shape \(3, 5\)"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, torch.ones(3, 4)), ValueError,
     r"b must have acc's 6 columns as its last dim; got shape \(3, 4\)"),
    (lambda: ops.accumulate_abs_outer_(ACC, torch.tensor(1.0), B), ValueError, "a must have acc's 4 rows"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, torch.ones(2, 6)), ValueError,
     r"a and b must have the same leading \(token\) dims; got \(3,\) and \(2,\)"),
    (lambda: ops.accumulate_abs_outer_(ACC, torch.ones(1, 3, 4), B), ValueError, "same leading"),
    (lambda: ops.accumulate_abs_outer_(ACC, A.int(), B), TypeError, "a must have dtype float32"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, B.double()), TypeError, "b must have dtype float32"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, [1.0] * 6), TypeError, "b must be a torch.Tensor"),
    (lambda: ops.accumulate_abs_outer_(ACC, torch.ones(0, 4), torch.ones(0, 6)), ValueError, "a must not be empty"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, torch.ones(3, 6, device="meta")), ValueError,
     "tensors must be on one device"),
    (lambda: ops.accumulate_abs_outer_(_BUFFER[:24].view(4, 6), _BUFFER[12:24].view(3, 4), B), ValueError,
     "acc must not share memory with a"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, B, alpha=float("nan")), ValueError, "alpha must be a finite float"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, B, alpha=float("inf")), ValueError, "alpha must be a finite float"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, B, alpha="2"), TypeError, "alpha must be a finite float"),
    (lambda: ops.accumulate_abs_outer_(ACC, A, B, alpha=None), TypeError, "alpha must be a finite float"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_failed_call_leaves_acc_untouched():
    acc = randn((4, 6), seed=11)
    before = acc.clone()
    with pytest.raises(ValueError):
        ops.accumulate_abs_outer_(acc, A, torch.ones(2, 6))
    assert torch.equal(acc, before)


def test_cpu_kernel_checks_direct_calls():
    C = torch.ops.pyprune  # on CPU tensors: pyprune._C's kernel
    with pytest.raises(RuntimeError, match="acc dtype must be one of float32, got float16"):
        C.accumulate_abs_outer_(ACC.half(), A, B, 1.0)
    with pytest.raises(RuntimeError, match=r"b must have shape \[3, 6\]"):
        C.accumulate_abs_outer_(ACC, A, torch.ones(2, 6), 1.0)
    acc, expected, transposed = ACC.clone(), ACC.clone(), torch.arange(12.0).reshape(4, 3).T  # any layout
    C.accumulate_abs_outer_(acc, transposed, B, 1.0)
    C.accumulate_abs_outer_(expected, transposed.contiguous(), B, 1.0)
    assert torch.equal(acc, expected) and bool(acc.any())


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
def test_opcheck(implementation):
    a, b = _inputs(12, 5, 9, torch.bfloat16, torch.float32, seed=12)
    with ops.use_implementation(implementation):
        torch.library.opcheck(torch.ops.pyprune.accumulate_abs_outer_.default,
                              (torch.ones(5, 9), a.reshape(3, 4, 5), b.reshape(3, 4, 9), 2.0))


# ----------------------------------------------------------------------------------------------
# The scores and accumulate_sqnorm_ on every kernel implementation, against the reference.


SCORE_SHAPES = [(1, 8), (1, 4096), (7, 40), (33, 96)]


@pytest.mark.parametrize("device", kernel_implementations("score"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SCORE_SHAPES)
def test_scores(device, dtype, shape):
    w, g = randn(shape, dtype, seed=1).to(device), randn(shape, dtype, seed=2).to(device)
    sqnorm = (rand(shape[1:], seed=3) * 10).to(device)
    assert torch.equal(ops.magnitude_score(w), R.magnitude_score(w))
    assert torch.equal(ops.wanda_score(w, sqnorm), R.wanda_score(w, sqnorm))
    assert torch.equal(ops.taylor_score(w, g), R.taylor_score(w, g))


@pytest.mark.parametrize("device", kernel_implementations("accumulate_sqnorm_"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3), (2, 5, 4096), (1000, 7)])
def test_accumulate_sqnorm(device, dtype, shape):
    x = randn(shape, dtype, seed=4).to(device)
    acc, expected = torch.ones(shape[-1], device=device), torch.ones(shape[-1], device=device)
    out = ops.accumulate_sqnorm_(acc, x)
    assert out is acc
    torch.testing.assert_close(acc, R.accumulate_sqnorm_(expected, x), rtol=1e-5, atol=1e-4)
