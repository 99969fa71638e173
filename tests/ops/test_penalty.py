"""DReSS's channel penalty pyprune.ops.channel_penalty_ on every implementation.

Each implementation (the C++ kernel, the Triton kernel in the interpreter or on a GPU) is checked against
pyprune.ops.reference: norms to fp32 tolerance, the gradient to its dtype's tolerance, unselected
slices bit for bit. The reference itself, and every implementation, is checked against autograd: adding
lam·Σ_c ‖W[slice c]‖ to the loss and backpropagating gives the same gradient as the op applied
after loss.backward().
"""
import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R
from tests.helpers import IMPLEMENTATIONS, DTYPES, NATIVE_IMPLEMENTATIONS, assert_close

NORMS = ("l2", "l1")
LAM = 0.37
#: (shape, dim): awkward sizes off every block; a 1-D weight is an RMSNorm scale.
LAYOUTS = [((7, 33), 0), ((7, 33), 1), ((129, 65), 0), ((129, 65), 1), ((100,), 0)]
#: Large enough for the C++ kernel's threads and several of its row blocks.
LARGE_LAYOUTS = [((512, 300), 0), ((300, 512), 1)]


pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _channels(extent, selection, seed=0):
    """The last quarter of the indices (DReSS's default), or a third of them scattered and
    unordered."""
    if selection == "range":
        return torch.arange(extent - max(3, extent // 4), extent)
    return torch.randperm(extent, generator=_generator(seed))[:max(3, extent // 3)]


def _inputs(shape, dim, dtype, grad_dtype, selection, seed=0):
    """(weight, grad, channels); the slice of the second selected channel is all zeros."""
    g = _generator(seed)
    weight = torch.randn(shape, generator=g)
    channels = _channels(shape[dim], selection, seed + 1)
    weight.select(dim, int(channels[1])).zero_()
    grad = torch.randn(shape, generator=g)
    return weight.to(dtype), grad.to(grad_dtype), channels


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _unselected(extent, channels):
    keep = torch.ones(extent, dtype=torch.bool)
    keep[channels] = False
    return keep.nonzero().flatten()


def _run(implementation_device, grad, weight, channels, dim, norm, lam=LAM):
    name, device = implementation_device
    grad, weight, channels = grad.to(device), weight.to(device), channels.to(device)
    with ops.use_implementation(name):
        norms = ops.channel_penalty_(grad, weight, channels, dim, lam, norm)
    return grad.cpu(), norms.cpu()


def _cases():
    for shape, dim in LAYOUTS:
        for dtype in DTYPES:
            for selection in ("range", "spread"):
                name = f"{'x'.join(map(str, shape))}-dim{dim}-{str(dtype)[6:]}-{selection}"
                yield pytest.param(shape, dim, dtype, selection, id=name)
    for shape, dim in LARGE_LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            for selection in ("range", "spread"):
                name = f"{'x'.join(map(str, shape))}-dim{dim}-{str(dtype)[6:]}-{selection}"
                yield pytest.param(shape, dim, dtype, selection, id=name)


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,dim,dtype,selection", list(_cases()))
def test_matches_reference(implementation_device, shape, dim, dtype, selection):
    weight, grad, channels = _inputs(shape, dim, dtype, dtype, selection, seed=sum(shape))
    zero_channel = int(channels[1])
    for norm in NORMS:
        expected = grad.clone()
        expected_norms = R.channel_penalty_(expected, weight, channels, dim, LAM, norm)
        got, norms = _run(implementation_device, grad.clone(), weight, channels, dim, norm)
        assert norms.dtype == torch.float32 and norms.shape == (channels.numel(),)
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
        assert float(norms[1]) == 0.0
        # a zero slice gets no step (ℓ2: subgradient 0; ℓ1: sign(0) = 0), the rest a visible one
        assert torch.equal(got.select(dim, zero_channel), grad.select(dim, zero_channel)), norm
        moved = got.index_select(dim, channels[2:]).float() - grad.index_select(dim, channels[2:]).float()
        assert bool((moved != 0).any()), norm
        others = _unselected(shape[dim], channels)
        assert torch.equal(_bits(got.index_select(dim, others)), _bits(grad.index_select(dim, others))), norm


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
@pytest.mark.parametrize("weight_dtype,grad_dtype", [(torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float16)])
def test_weight_and_grad_dtypes_differ(implementation_device, weight_dtype, grad_dtype):
    for dim in (0, 1):
        weight, grad, channels = _inputs((37, 50), dim, weight_dtype, grad_dtype, "spread", seed=dim)
        for norm in NORMS:
            expected = grad.clone()
            expected_norms = R.channel_penalty_(expected, weight, channels, dim, LAM, norm)
            got, norms = _run(implementation_device, grad.clone(), weight, channels, dim, norm)
            torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
            assert got.dtype == grad_dtype
            assert_close(got, expected, grad_dtype)


def _penalty64(weight, channels, dim, norm):
    """Σ_c ‖W[slice c]‖ in fp64, as autograd sees it."""
    slices = weight.index_select(dim, channels)
    others = [d for d in range(weight.dim()) if d != dim]
    order = 1 if norm == "l1" else 2
    return (torch.linalg.vector_norm(slices, ord=order, dim=others) if others else slices.abs()).sum()


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,dim", [((129, 65), 0), ((129, 65), 1), ((100,), 0)])
@pytest.mark.parametrize("norm", NORMS)
def test_equals_autograd_of_the_penalty_after_backward(implementation_device, shape, dim, norm):
    """The use in DReSS's training loop: the op after loss.backward() equals backpropagating
    loss + lam·Σ‖W[slice c]‖ (the zero slice included: autograd's norm has gradient 0 there)."""
    weight, _, channels = _inputs(shape, dim, torch.float32, torch.float32, "spread", seed=3)
    x = torch.randn(5, shape[-1], generator=_generator(4))

    def loss(w, x):
        return (x @ w).square().mean() if w.dim() == 1 else (x @ w.T).square().mean()

    expected = weight.double().requires_grad_()
    (loss(expected, x.double()) + LAM * _penalty64(expected, channels, dim, norm)).backward()

    name, device = implementation_device
    param = torch.nn.Parameter(weight.to(device))
    loss(param, x.to(device)).backward()
    with ops.use_implementation(name):
        norms = ops.channel_penalty_(param.grad, param, channels.to(device), dim, LAM, norm)
    assert not norms.requires_grad  # for logging; the step is already in param.grad
    torch.testing.assert_close(param.grad.cpu().double(), expected.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(LAM * norms.cpu().double().sum(),
                               LAM * _penalty64(weight.double(), channels, dim, norm), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
def test_strided_weight_and_int32_channels(implementation_device):
    """A transposed weight is read as its values (from a contiguous copy); int32 indices are
    the same positions as int64 ones."""
    base = torch.randn(40, 24, generator=_generator(5))
    weight, grad = base.t(), torch.randn(24, 40, generator=_generator(6))
    channels = torch.tensor([39, 3, 17, 0, 22])
    expected = grad.clone()
    expected_norms = R.channel_penalty_(expected, weight.contiguous(), channels, 1, LAM)
    got, norms = _run(implementation_device, grad.clone(), weight, channels.int(), 1, "l2")
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_lam_zero_leaves_grad_and_returns_norms(implementation_device):
    weight, grad, channels = _inputs((9, 13), 1, torch.float16, torch.float16, "spread")
    got, norms = _run(implementation_device, grad.clone(), weight, channels, 1, "l2", lam=0.0)
    assert torch.equal(_bits(got), _bits(grad))
    torch.testing.assert_close(norms, weight.float()[:, channels].norm(dim=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,dim", LARGE_LAYOUTS)
def test_cpu_kernel_does_not_depend_on_the_thread_count(shape, dim):
    weight, grad, channels = _inputs(shape, dim, torch.float32, torch.bfloat16, "spread", seed=9)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(_run(("cpu", "cpu"), grad.clone(), weight, channels, dim, "l2"))
    finally:
        torch.set_num_threads(threads)
    (grad_1, norms_1), (grad_2, norms_2) = results
    assert torch.equal(_bits(grad_1), _bits(grad_2)) and torch.equal(_bits(norms_1), _bits(norms_2))


# ---- argument checks, tracing -------------------------------------------------------------------

W, G, P = torch.ones(4, 8), torch.zeros(4, 8), torch.tensor([1, 5])
_BUFFER = torch.zeros(40)


def _call(grad=G, weight=W, channels=P, dim=1, lam=0.1, norm="l2"):
    return ops.channel_penalty_(grad.clone() if grad is G else grad, weight, channels, dim, lam, norm)


@pytest.mark.parametrize("call,error,message", [
    (lambda: _call(channels=torch.tensor([1, 5, 1])), ValueError, "channels must not repeat a position"),
    (lambda: _call(channels=torch.tensor([1, 8])), ValueError,
     r"channels must hold positions in \[0, 8\) of weight's dim 1; got values in \[1, 8\]"),
    (lambda: _call(channels=torch.tensor([-1, 2]), dim=0), ValueError,
     r"channels must hold positions in \[0, 4\) of weight's dim 0"),
    (lambda: _call(channels=torch.tensor([1.0, 2.0])), ValueError, "channels must be a non-empty 1-D int64/int32"),
    (lambda: _call(channels=torch.tensor([[1, 2]])), ValueError, "channels must be a non-empty 1-D int64/int32"),
    (lambda: _call(channels=torch.tensor([], dtype=torch.int64)), ValueError, "channels must be a non-empty"),
    (lambda: _call(channels=[1, 2]), TypeError, "channels must be a torch.Tensor"),
    (lambda: _call(grad=torch.zeros(7), weight=torch.ones(7), channels=P, dim=1), ValueError,
     r"dim must be in \[-1, 0\] for a 1-D tensor; got 1"),
    (lambda: _call(dim=2), ValueError, r"dim must be in \[-2, 1\] for a 2-D tensor; got 2"),
    (lambda: _call(dim=1.0), TypeError, "dim must be an int"),
    (lambda: _call(grad=torch.zeros(4, 7)), ValueError, r"grad must have the shape of weight \(4, 8\); got \(4, 7\)"),
    (lambda: _call(grad=torch.zeros(4, 8, dtype=torch.int32)), TypeError,
     "grad must have dtype float32, float16, bfloat16; got torch.int32"),
    (lambda: _call(weight=W.double()), TypeError, "weight must have dtype float32, float16, bfloat16"),
    (lambda: _call(weight=torch.ones(2, 2, 2), grad=torch.zeros(2, 2, 2)), ValueError, "weight must be 1-D or 2-D"),
    (lambda: _call(weight=W.numpy()), TypeError, "weight must be a torch.Tensor"),
    (lambda: _call(grad=torch.zeros(8, 4).t()), ValueError, "grad must be contiguous"),
    (lambda: _call(weight=torch.ones(4, 8, device="meta")), ValueError, "tensors must be on one device"),
    (lambda: _call(channels=P.to("meta")), ValueError, "tensors must be on one device"),
    (lambda: _call(norm="l3"), ValueError, "norm must be one of 'l2', 'l1'; got 'l3'"),
    (lambda: _call(norm="L2"), ValueError, "norm must be one of 'l2', 'l1'"),
    (lambda: _call(lam=-0.1), ValueError, "lam must be a float >= 0; got -0.1"),
    (lambda: _call(lam=float("nan")), ValueError, "lam must be a finite float"),
    (lambda: _call(lam=float("inf")), ValueError, "lam must be a finite float"),
    (lambda: _call(lam="0.1"), TypeError, "lam must be a finite float"),
    (lambda: _call(grad=_BUFFER[:32].view(4, 8), weight=_BUFFER[8:40].view(4, 8)), ValueError,
     "grad must not share memory with weight"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_failed_call_leaves_grad_untouched(name):
    grad = torch.randn(4, 8)
    before = grad.clone()
    with ops.use_implementation(name), pytest.raises(ValueError, match="must not repeat"):
        ops.channel_penalty_(grad, W, torch.tensor([6, 2, 6]), 1, 0.1)
    assert torch.equal(grad, before)


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_opcheck(name):
    weight, grad, channels = _inputs((9, 13), 0, torch.bfloat16, torch.float32, "spread", seed=7)
    with ops.use_implementation(name):
        for dim, norm in ((0, "l2"), (1, "l1")):
            torch.library.opcheck(torch.ops.pyprune.channel_penalty_.default,
                                  (grad.clone(), weight, channels, dim, LAM, norm))
