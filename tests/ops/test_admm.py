"""SAFE's dual update pyprune.ops.admm_dual_update_ (z-step + u-step on the compact (v, keep)
state, spec §1.8 and K6) on every implementation.

Each implementation (the C++ kernel, the Triton kernel in the interpreter or on a GPU) is checked against
pyprune.ops.reference: keep bit for bit (ties everywhere: v and x on a few integer levels, ±0.0,
act_sqnorm columns that are 0), v to fp32 (it is x.float() + u: equal in practice), the residual
‖x − z‖² to fp32 summation tolerance, on awkward shapes (one row, odd rows, widths off every
block), x in fp32/fp16/bf16, 2:4, 4:8 and 3:8, top-k per row and per tensor, with and without
act_sqnorm, and over consecutive calls with the state carried. Independently of the reference:
z + u = x + u_old, exact counts, and the residual from the outputs in fp64.
"""
import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import IMPLEMENTATIONS, DTYPES, NATIVE_IMPLEMENTATIONS, tied_scores

NM_PATTERNS = [dict(n=2, m=4), dict(n=4, m=8), dict(n=3, m=8)]
TOPK_PATTERNS = [dict(sparsity=0.5, scope="row"), dict(sparsity=0.7, scope="tensor")]
#: One row, odd rows with a width off every block and group count, a single group per row.
NM_SHAPES = [(1, 24), (7, 40), (33, 120), (5, 8)]
TOPK_SHAPES = [(1, 37), (7, 40), (3, 130)]
#: Over the C++ kernels' parallel threshold (32,768 elements), many C++ blocks and Triton programs,
#: rows of two top-k chunks (1024) the second partial.
LARGE = (17, 2000)


pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _state(shape, dtype, seed, with_act):
    """(v, keep, x, act_sqnorm) on a few integer levels, so that the new v = x + u ties often
    (±0.0 included); act_sqnorm in {0, 1, 4} (zero columns tie at score 0) or None."""
    g = _generator(seed)
    v = tied_scores(shape, torch.float32, seed=seed, levels=4) - 1.0
    keep = torch.rand(shape, generator=g) < 0.5
    x = (tied_scores(shape, torch.float32, seed=seed + 1, levels=5) - 2.0).to(dtype)
    act = torch.randint(0, 3, (shape[1],), generator=g).float().square() if with_act else None
    return v, keep, x, act


def _pattern_args(pattern):
    """The reference's positional (n, m, sparsity, scope) of a pattern."""
    if "m" in pattern:
        return pattern["n"], pattern["m"], 0.0, "row"
    return 0, 0, pattern["sparsity"], pattern["scope"]


def _run(implementation_device, v, keep, x, act, pattern):
    """The op on ``implementation_device`` on copies of the state; returns (v, keep, residual) on the CPU."""
    name, device = implementation_device
    v, keep, x = v.clone().to(device), keep.clone().to(device), x.to(device)
    act = None if act is None else act.to(device)
    with ops.use_implementation(name):
        residual = ops.admm_dual_update_(v, keep, x, act_sqnorm=act, **pattern)
    assert residual.dtype == torch.float32 and residual.shape == () and residual.device == v.device
    return v.cpu(), keep.cpu(), residual.cpu()


def _expected(v, keep, x, act, pattern):
    v, keep = v.clone(), keep.clone()
    residual = R.admm_dual_update_(v, keep, x, act, *_pattern_args(pattern))
    return v, keep, residual


def _assert_counts(keep, pattern):
    """Exactly n of every m, or kept_count per row / tensor."""
    if "m" in pattern:
        per_group = keep.reshape(-1, pattern["m"]).sum(dim=1)
        assert bool((per_group == pattern["n"]).all())
    elif pattern["scope"] == "row":
        per_row = keep.sum(dim=1)
        assert bool((per_row == R.kept_count(keep.shape[1], pattern["sparsity"])).all())
    else:
        assert int(keep.sum()) == R.kept_count(keep.numel(), pattern["sparsity"])


def _assert_step(got, expected, v_old, keep_old, x, pattern):
    """got = expected (keep exact, v to fp32, residual to fp32 summation), plus the identities."""
    (v, keep, residual), (v_ref, keep_ref, residual_ref) = got, expected
    assert torch.equal(keep, keep_ref), f"{int((keep != keep_ref).sum())} of {keep.numel()} keep flags differ"
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(residual, residual_ref, rtol=1e-5, atol=1e-6)
    _assert_counts(keep, pattern)
    z, u = v * keep, v * ~keep
    torch.testing.assert_close(z + u, x.float() + v_old * ~keep_old, rtol=1e-6, atol=0.0)
    exact = (x.double() - z.double()).square().sum()
    torch.testing.assert_close(residual.double(), exact, rtol=1e-5, atol=1e-6)


def _cases(patterns, shapes):
    for pattern in patterns:
        label = f"{pattern['n']}:{pattern['m']}" if "m" in pattern else f"{pattern['scope']}-{pattern['sparsity']}"
        for shape in shapes:
            for dtype in DTYPES:
                for with_act in (False, True):
                    yield pytest.param(pattern, shape, dtype, with_act,
                                       id=f"{label}-{shape[0]}x{shape[1]}-{str(dtype)[6:]}-{'wanda' if with_act else 'magnitude'}")


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("pattern,shape,dtype,with_act",
                         list(_cases(NM_PATTERNS, NM_SHAPES)) + list(_cases(TOPK_PATTERNS, TOPK_SHAPES)))
def test_update_matches_reference(implementation_device, pattern, shape, dtype, with_act):
    v, keep, x, act = _state(shape, dtype, seed=sum(shape), with_act=with_act)
    got = _run(implementation_device, v, keep, x, act, pattern)
    _assert_step(got, _expected(v, keep, x, act, pattern), v, keep, x, pattern)


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
@pytest.mark.parametrize("pattern,dtype,with_act", [
    (dict(n=2, m=4), torch.float32, False), (dict(n=2, m=4), torch.bfloat16, True),
    (dict(n=3, m=8), torch.float16, True), (dict(sparsity=0.5, scope="row"), torch.bfloat16, True),
    (dict(sparsity=0.5, scope="tensor"), torch.float32, False)], ids=str)
def test_large_state_matches_reference(implementation_device, pattern, dtype, with_act):
    """Several threads, many C++ blocks and Triton programs; Gaussian values (few ties). The
    interpreter takes about half a minute per top-k call here: fewer cases."""
    g = _generator(3)
    v, keep = torch.randn(LARGE, generator=g), torch.rand(LARGE, generator=g) < 0.5
    x = torch.randn(LARGE, generator=g).to(dtype)
    act = torch.rand(LARGE[1], generator=g) * 4 if with_act else None
    got = _run(implementation_device, v, keep, x, act, pattern)
    _assert_step(got, _expected(v, keep, x, act, pattern), v, keep, x, pattern)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("pattern", NM_PATTERNS + TOPK_PATTERNS, ids=str)
def test_consecutive_calls_carry_the_state(implementation_device, pattern):
    """SAFE's loop from v = 0, keep = False: each call's u is the previous call's v⊙¬keep."""
    shape = (7, 40)
    g = _generator(5)
    v, keep = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    v_ref, keep_ref = v.clone(), keep.clone()
    act = torch.rand(shape[1], generator=g)
    name, device = implementation_device
    v, keep = v.to(device), keep.to(device)
    for step in range(3):
        x = torch.randn(shape, generator=g).to(torch.bfloat16)  # x moves between dual updates
        v_old, keep_old = v.cpu().clone(), keep.cpu().clone()
        with ops.use_implementation(name):
            residual = ops.admm_dual_update_(v, keep, x.to(device), act_sqnorm=act.to(device), **pattern)
        residual_ref = R.admm_dual_update_(v_ref, keep_ref, x, act, *_pattern_args(pattern))
        _assert_step((v.cpu(), keep.cpu(), residual.cpu()), (v_ref, keep_ref, residual_ref), v_old, keep_old,
                     x, pattern)
        if step == 0:  # from u = 0: v is x itself and the residual is the pruned part of x
            assert torch.equal(v.cpu(), x.float())
            torch.testing.assert_close(residual.cpu(), (x.float() * ~keep.cpu()).square().sum())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf·0
@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_signed_zeros_and_infinities(implementation_device):
    """v·0 as in the reference: a kept -2.0 leaves -0.0 (+ x = -0.0 stays -0.0), and -0.0 ties
    with +0.0 (lower index kept); ±inf are scores like any other (three tie at inf)."""
    inf = float("inf")
    v = torch.tensor([[-2.0, 5.0, 3.0, -1.0, inf, 1.0, 2.0, -inf]])
    keep = torch.tensor([[True, True, False, False, False, False, False, False]])
    x = torch.tensor([[-0.0, 0.0, -3.0, 1.5, 0.0, -inf, 0.5, 0.0]])
    pattern = dict(n=2, m=4)
    v_new, keep_new, _ = _run(implementation_device, v, keep, x, None, pattern)
    v_ref, keep_ref, _ = _expected(v, keep, x, None, pattern)
    assert torch.equal(v_ref, torch.tensor([[-0.0, 0.0, 0.0, 0.5, inf, -inf, 2.5, -inf]]))
    assert torch.equal(keep_ref, torch.tensor([[True, False, False, True, True, True, False, False]]))
    assert torch.equal(keep_new, keep_ref)
    assert torch.equal(v_new, v_ref) and torch.equal(v_new.signbit(), v_ref.signbit())


@pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt:RuntimeWarning")  # the interpreter's
@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("pattern", [dict(n=2, m=4), dict(sparsity=0.5, scope="row"),
                                     dict(sparsity=0.5, scope="tensor")], ids=str)
def test_nan_scores_raise(implementation_device, pattern):
    """A NaN in x (diverged training) gives NaN scores: ValueError, as for the mask ops; a negative
    act_sqnorm is refused before any score is computed."""
    v, keep, x, act = _state((3, 8), torch.float32, seed=1, with_act=True)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"scores of v = x \+ u \(and act_sqnorm\) contain NaN"):
        _run(implementation_device, v, keep, x, None, pattern)
    x[1, 2] = 0.0
    act[3] = -1.0
    with pytest.raises(ValueError, match=r"act_sqnorm must be >= 0 \(a sum of squares of activations\); got -1.0 "
                                         "at column 3"):
        _run(implementation_device, v, keep, x, act, pattern)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_sparsity_zero_keeps_everything(implementation_device, scope):
    """z = v = x + u_old, so the residual is ‖u_old‖²."""
    v, keep, x, _ = _state((4, 9), torch.float32, seed=2, with_act=False)
    _, keep_new, residual = _run(implementation_device, v, keep, x, None, dict(sparsity=0.0, scope=scope))
    assert bool(keep_new.all())
    torch.testing.assert_close(residual, (v * ~keep).square().sum())


V, KEEP, X = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bool), torch.randn(4, 8)
_BUFFER = torch.zeros(64)


def _call(**overrides):
    arguments = dict(v=V.clone(), keep=KEEP.clone(), x=X, n=2, m=4)
    arguments.update(overrides)
    arguments = {k: value for k, value in arguments.items() if value is not None}
    return ops.admm_dual_update_(arguments.pop("v"), arguments.pop("keep"), arguments.pop("x"), **arguments)


@pytest.mark.parametrize("call,error,message", [
    (lambda: _call(x=X.int()), TypeError, "x must have dtype float32, float16, bfloat16"),
    (lambda: _call(x=X[0]), ValueError, "x must be 2-D"),
    (lambda: _call(x=X.numpy()), TypeError, "x must be a torch.Tensor"),
    (lambda: _call(v=V.numpy()), TypeError, "v must be a torch.Tensor"),
    (lambda: _call(keep=KEEP.numpy()), TypeError, "keep must be a torch.Tensor"),
    (lambda: _call(v=V.half()), TypeError, "v must have dtype torch.float32"),
    (lambda: _call(v=torch.zeros(4, 4)), ValueError, r"v must have the shape of x \(4, 8\)"),
    (lambda: _call(v=torch.zeros(8, 4).t()), ValueError, "v must be contiguous"),
    (lambda: _call(keep=KEEP.float()), TypeError, "keep must have dtype torch.bool"),
    (lambda: _call(keep=torch.zeros(4, 9, dtype=torch.bool)), ValueError, "keep must have the shape of x"),
    (lambda: _call(keep=torch.zeros(8, 4, dtype=torch.bool).t()), ValueError, "keep must be contiguous"),
    (lambda: _call(act_sqnorm=torch.ones(7)), ValueError, "act_sqnorm must have one entry per input column"),
    (lambda: _call(act_sqnorm=torch.ones(8).int()), TypeError, "act_sqnorm must have dtype"),
    (lambda: _call(n=None, m=None), ValueError, "give either sparsity .* or both n and m"),
    (lambda: _call(sparsity=0.5), ValueError, "give either sparsity .* or both n and m"),
    (lambda: _call(m=None), ValueError, "give either sparsity .* or both n and m"),
    (lambda: _call(n=None, m=None, sparsity=0.5, scope="column"), ValueError,
     "scope must be one of 'row', 'tensor'; got 'column'"),
    (lambda: _call(n=None, m=None, sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\)"),
    (lambda: _call(n=None, m=None, sparsity="0.5"), TypeError, "sparsity must be a float"),
    (lambda: _call(n=4, m=4), ValueError, "1 <= n < m <= 32"),
    (lambda: _call(n=2.0), TypeError, "n must be an int"),
    (lambda: _call(n=3, m=6), ValueError, "m=6 must divide the last dim of x"),
    (lambda: _call(x=torch.ones(4, 8, device="meta")), ValueError, "tensors must be on one device"),
    (lambda: _call(v=_BUFFER[:32].view(4, 8), x=_BUFFER[16:48].view(4, 8)), ValueError,
     "v must not share memory with x"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_failed_call_leaves_the_state_untouched():
    v, keep = torch.randn(4, 8), torch.rand(4, 8) < 0.5
    before = v.clone(), keep.clone()
    with pytest.raises(ValueError):
        ops.admm_dual_update_(v, keep, X, sparsity=0.5, scope="columns")
    assert torch.equal(v, before[0]) and torch.equal(keep, before[1])


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
def test_opcheck(implementation):
    v, keep, x, act = _state((6, 16), torch.bfloat16, seed=4, with_act=True)
    with ops.use_implementation(implementation):
        # (n, m, keep_count, per_row): 2:4; half of each row; 70% of the tensor
        for args in ((v, keep, x, act, 2, 4, 0, True), (v, keep, x, None, 0, 0, 8, True),
                     (v, keep, x, act, 0, 0, 67, False)):
            torch.library.opcheck(torch.ops.pyprune.admm_dual_update_.default, args)


def test_traces_into_one_graph_under_torch_compile():
    v, keep, x, act = _state((6, 16), torch.float32, seed=6, with_act=True)

    def two_updates(v, keep, x, act):
        first = ops.admm_dual_update_(v, keep, x, n=2, m=4, act_sqnorm=act)
        second = ops.admm_dual_update_(v, keep, x * 0.5, sparsity=0.5, scope="tensor")
        return first + second

    compiled = torch.compile(two_updates, backend="aot_eager", fullgraph=True)
    eager_state, compiled_state = (v.clone(), keep.clone()), (v.clone(), keep.clone())
    expected = two_updates(*eager_state, x, act)
    assert torch.equal(compiled(*compiled_state, x, act), expected)
    assert torch.equal(compiled_state[0], eager_state[0]) and torch.equal(compiled_state[1], eager_state[1])
