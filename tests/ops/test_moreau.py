"""MoreauPruner's fused step (pyprune.ops.moreau_step_ / moreau_perturb_) on every implementation.

Each implementation (the reference, the C++ kernel, the Triton kernel in the interpreter or on a GPU) is
checked against an fp64 oracle written here from the spec (§1.5–1.6), with z taken from
pyprune.ops.reference.standard_normal. The generator is checked on its own: Philox words bit-exact
against Triton's tl.randint4x and a published answer, z within float rounding, and the
statistics of z.
"""
import math

import pytest
import torch

from pyprune import ops
from pyprune.ops import reference as R
from pyprune.ops.library import native
from tests.helpers import IMPLEMENTATIONS, DTYPES, HAS_CUDA

SMALL_SHAPES = [(1, 1), (1, 300), (300, 1), (37, 129), (3, 4096)]
LARGE_SHAPES = [(576, 1536)]
DECAY, STEP_SIZE, NOISE_RATIO = 0.999, 0.05, 0.05
#: Largest |z_implementation − z_reference|: the words and uniforms are exact, log/cos differ by a few ulp.
Z_TOLERANCE = 2e-6
#: (rtol, atol) of the perturbed weights: one rounding step of the output dtype.
ONE_ROUNDING = {torch.float32: (1e-5, 1e-6), torch.float16: (2.0 ** -10, 1e-5),
                torch.bfloat16: (2.0 ** -7, 1e-5)}


pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _group_factors(shape, group_dim, seed):
    """Per-group scales over three octaves, so group norms spread and a threshold can fall
    clearly between them."""
    n_groups = shape[group_dim]
    factors = 2.0 ** (torch.randint(0, 4, (n_groups,), generator=_generator(seed)) - 1.5)
    return factors[:, None] if group_dim == 0 else factors[None, :]


def _inputs(shape, dtype, group_dim, seed=0):
    g = _generator(seed)
    factors = _group_factors(shape, group_dim, seed + 1)
    delta = torch.randn(shape, generator=g) * 0.1 * factors
    grad = (torch.randn(shape, generator=g) * factors).to(dtype)
    weight = torch.randn(shape, generator=g).to(dtype)
    return delta, grad, weight


def _displaced64(delta, grad, decay=DECAY, step_size=STEP_SIZE):
    return decay * delta.double() - step_size * grad.double()


def _norms(d64, group_dim):
    return d64.norm(dim=1 - group_dim)


def _threshold(kind, d64, group_dim):
    """0; one that zeroes some groups and shrinks the others (>= 2% from every norm); or one
    above every norm."""
    if kind == "none":
        return 0.0
    norms = _norms(d64, group_dim).sort().values
    if kind == "all":
        return float(norms[-1]) * 2 + 1e-3
    if norms.numel() == 1:
        return float(norms[0]) / 2
    gaps = norms[1:] / norms[:-1]
    i = int(gaps.argmax())
    assert gaps[i] > 1.04, "inputs leave no room for a threshold between group norms"
    return math.sqrt(float(norms[i]) * float(norms[i + 1]))


def _expected_delta(delta, grad, threshold, group_dim, decay=DECAY, step_size=STEP_SIZE):
    """The spec's step in fp64: GST_threshold(decay·δ − step_size·g) per row/column."""
    d = _displaced64(delta, grad, decay, step_size)
    if threshold > 0:
        norms = d.norm(dim=1 - group_dim, keepdim=True)
        d = d * (1 - threshold / norms).clamp_min(0)
    return d


def _expected_perturbed(weight, delta64, noise_ratio, seed):
    w = weight.double()
    z = R.standard_normal(seed, torch.arange(w.numel()).reshape(w.shape)).double()
    return w + delta64 + noise_ratio * w.abs() * z


def _assert_delta(actual, expected64):
    assert actual.dtype == torch.float32
    scale = float(expected64.abs().max()) or 1.0
    torch.testing.assert_close(actual.double().cpu(), expected64, rtol=1e-5, atol=1e-6 * scale)


def _assert_perturbed(actual, expected64, dtype):
    assert actual.dtype == dtype
    rtol, atol = ONE_ROUNDING[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64, rtol=rtol, atol=atol)


def _run_step(implementation, device, delta, grad, weight, perturbed, **kwargs):
    delta, grad, weight = delta.to(device), grad.to(device), weight.to(device)
    perturbed = None if perturbed is None else perturbed.to(device)
    with ops.use_implementation(implementation):
        out = ops.moreau_step_(delta, grad, weight, perturbed, **kwargs)
    assert out is None
    return delta, perturbed


def _step_cases():
    def case(shape, dtype, kind, group_dim):
        name = f"{shape[0]}x{shape[1]}-{str(dtype)[6:]}-threshold_{kind}-group_dim{group_dim}"
        return pytest.param(shape, dtype, kind, group_dim, id=name)

    for shape in SMALL_SHAPES:
        for dtype in DTYPES:
            for kind in ("none", "some", "all"):
                for group_dim in (0, 1):
                    yield case(shape, dtype, kind, group_dim)
    for shape in LARGE_SHAPES:  # the interpreter takes seconds per call here: fewer cases
        for dtype in DTYPES:
            yield case(shape, dtype, "none", 0)
            for group_dim in (0, 1):
                yield case(shape, dtype, "some", group_dim)


# ---- the step against the oracle ----------------------------------------------------------------

@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,dtype,kind,group_dim", list(_step_cases()))
def test_step_matches_oracle(implementation_device, shape, dtype, kind, group_dim):
    implementation, device = implementation_device
    delta, grad, weight = _inputs(shape, dtype, group_dim, seed=sum(shape))
    threshold = _threshold(kind, _displaced64(delta, grad), group_dim)
    expected = _expected_delta(delta, grad, threshold, group_dim)
    perturbed = torch.full(shape, float("nan"), dtype=dtype)
    weight_before = weight.clone()
    delta, perturbed = _run_step(implementation, device, delta, grad, weight, perturbed, decay=DECAY,
                                 step_size=STEP_SIZE, threshold=threshold, group_dim=group_dim,
                                 noise_ratio=NOISE_RATIO, seed=12345)
    _assert_delta(delta, expected)
    _assert_perturbed(perturbed, _expected_perturbed(weight_before, expected, NOISE_RATIO, 12345), dtype)
    if kind == "some":
        zeroed = _norms(expected, group_dim) == 0
        assert 0 < int(zeroed.sum()) < zeroed.numel() or zeroed.numel() == 1
        assert torch.equal(_norms(delta.double().cpu(), group_dim) == 0, zeroed)  # zero is exact
    if kind == "all":
        assert not bool(delta.any())


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
@pytest.mark.parametrize("kind,group_dim", [("none", 0), ("some", 0), ("some", 1)])
def test_step_without_perturbed_writes_delta_only(implementation_device, shape, kind, group_dim):
    implementation, device = implementation_device
    delta, grad, weight = _inputs(shape, torch.float32, group_dim, seed=7)
    threshold = _threshold(kind, _displaced64(delta, grad), group_dim)
    expected = _expected_delta(delta, grad, threshold, group_dim)
    grad_before, weight_before = grad.clone(), weight.clone()
    delta, _ = _run_step(implementation, device, delta, grad, weight, None, decay=DECAY,
                         step_size=STEP_SIZE, threshold=threshold, group_dim=group_dim)
    _assert_delta(delta, expected)
    assert torch.equal(grad, grad_before) and torch.equal(weight, weight_before)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_mixed_dtypes_and_non_contiguous_reads(implementation_device):
    """grad bf16, weight fp16 (a transposed view), perturbed fp32: each is loaded/stored as is."""
    implementation, device = implementation_device
    delta, grad, _ = _inputs((40, 70), torch.bfloat16, 0, seed=3)
    weight = torch.randn(70, 40, generator=_generator(4)).to(torch.float16).t()
    threshold = _threshold("some", _displaced64(delta, grad), 0)
    expected = _expected_delta(delta, grad, threshold, 0)
    perturbed = torch.empty(40, 70)
    delta, perturbed = _run_step(implementation, device, delta, grad, weight, perturbed, decay=DECAY,
                                 step_size=STEP_SIZE, threshold=threshold, group_dim=0, seed=9)
    _assert_delta(delta, expected)
    _assert_perturbed(perturbed, _expected_perturbed(weight, expected, 0.05, 9), torch.float32)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_steps_chain_like_the_method(implementation_device):
    """Five steps from δ = 0 with a new seed each: δ and the final perturbed weights follow the
    oracle (the model's weight tensor always holds the next perturbed weights)."""
    implementation, device = implementation_device
    shape = (24, 56)
    g = _generator(5)
    weight = torch.randn(shape, generator=g).to(torch.bfloat16)
    delta = torch.zeros(shape)
    expected = torch.zeros(shape, dtype=torch.float64)
    perturbed = weight.clone().to(device)
    delta, weight_d = delta.to(device), weight.to(device)
    for step in range(5):
        grad = torch.randn(shape, generator=g).to(torch.bfloat16)
        expected = _expected_delta(expected, grad, 0.01, 1, decay=0.99, step_size=0.1)
        with ops.use_implementation(implementation):
            ops.moreau_step_(delta, grad.to(device), weight_d, perturbed, decay=0.99, step_size=0.1,
                             threshold=0.01, group_dim=1, seed=1000 + step)
        _assert_delta(delta, expected)
    _assert_perturbed(perturbed, _expected_perturbed(weight, expected, 0.05, 1004), torch.bfloat16)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SMALL_SHAPES + LARGE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_perturb_matches_oracle(implementation_device, shape, dtype):
    implementation, device = implementation_device
    delta, _, weight = _inputs(shape, dtype, 0, seed=11)
    perturbed = torch.empty(shape, dtype=dtype, device=device)
    with ops.use_implementation(implementation):
        ops.moreau_perturb_(perturbed, weight.to(device), delta.to(device), noise_ratio=0.3, seed=77)
    _assert_perturbed(perturbed, _expected_perturbed(weight, delta.double(), 0.3, 77), dtype)


# ---- the generator ------------------------------------------------------------------------------

def _z(implementation, device, shape, seed):
    """z itself, through the public op: with W = 1, δ = −1 and noise_ratio 1 the perturbed
    weights are (1 − 1) + 1·z = z exactly in fp32."""
    perturbed = torch.empty(shape, device=device)
    with ops.use_implementation(implementation):
        ops.moreau_perturb_(perturbed, torch.ones(shape, device=device),
                            torch.full(shape, -1.0, device=device), noise_ratio=1.0, seed=seed)
    return perturbed.cpu()


def test_philox_known_answer():
    """Random123's published Philox4x32-10 answer for counter 0, key 0."""
    words = R.philox_uint32(0, torch.zeros(1, dtype=torch.int64))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D]


_OFFSETS = torch.cat([torch.arange(4096), torch.tensor([2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32,
                                                          2 ** 32 + 1, 3 * 2 ** 40 + 17, 2 ** 62 + 5])])
_SEEDS = [0, 1, 2 ** 31 + 7, 2 ** 32, 2 ** 40 + 5, 2 ** 63 - 1]


@pytest.mark.parametrize("seed", _SEEDS)
def test_philox_words_cpu_kernel_exact(seed):
    words = native("cpu").philox_uint32(seed, _OFFSETS)
    expected = R.philox_uint32(seed, _OFFSETS)
    assert torch.equal(words[:, 0], expected[0]) and torch.equal(words[:, 1], expected[1])


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("seed", _SEEDS)
def test_philox_words_triton_exact(seed):
    """pyprune.ops.reference.philox_uint32 is tl.randint4x(seed, offsets)[:2], bit for bit."""
    from pyprune.ops.kernels import moreau
    words = moreau.philox_uint32(seed, _OFFSETS)
    expected = R.philox_uint32(seed, _OFFSETS)
    assert torch.equal(words[0], expected[0]) and torch.equal(words[1], expected[1])


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_z_matches_reference(implementation_device):
    implementation, device = implementation_device
    shape = (257, 1031)
    expected = R.standard_normal(31337, torch.arange(shape[0] * shape[1]).reshape(shape))
    z = _z(implementation, device, shape, 31337)
    assert float((z - expected).abs().max()) <= Z_TOLERANCE


def test_z_statistics():
    """10⁶ draws of the CPU kernel (within 2e-6 of the reference's, test_z_matches_reference): mean
    0 and std 1 within 5 standard errors, the N(0, 1) distribution (KS test), no correlation
    between neighbours or between seeds, the same draws for the same seed."""
    n = 1_000_000

    def draw(seed):
        return _z("cpu", "cpu", (1000, 1000), seed).reshape(-1)

    z = draw(2024).double()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 * math.sqrt(0.5 / n)
    cdf = 0.5 * (1 + torch.erf(z.sort().values / math.sqrt(2)))
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert float((cdf - ranks).abs().max()) < 1.95 / math.sqrt(n)  # KS at the 0.1% level
    for lag in (1, 2, 1000):
        assert abs(float(torch.corrcoef(torch.stack([z[:-lag], z[lag:]]))[0, 1])) < 5 / math.sqrt(n)
    other = draw(2025).double()
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < 5 / math.sqrt(n)
    assert torch.equal(draw(2024).double(), z)


# ---- argument checks, tracing -------------------------------------------------------------------

D, G, W = torch.zeros(4, 6), torch.ones(4, 6), torch.ones(4, 6)


def _step(**overrides):
    tensors = {"delta": D.clone(), "grad": G, "weight": W, "perturbed": torch.empty(4, 6)}
    scalars = {"decay": 0.9, "step_size": 0.1, "threshold": 0.0, "group_dim": 0, "noise_ratio": 0.05,
               "seed": 0}
    for name, value in overrides.items():
        (tensors if name in tensors else scalars)[name] = value
    ops.moreau_step_(*tensors.values(), **scalars)


_BUFFER = torch.zeros(48)


@pytest.mark.parametrize("call,error,message", [
    (lambda: _step(delta=D.double()), TypeError, "delta must have dtype float32, float16, bfloat16"),
    (lambda: _step(delta=D.half()), TypeError, "delta must have dtype torch.float32"),
    (lambda: _step(delta=torch.zeros(24)), ValueError, "delta must be 2-D"),
    (lambda: _step(delta=torch.zeros(6, 4).t()), ValueError, "delta must be contiguous"),
    (lambda: _step(grad=torch.ones(4, 5)), ValueError, r"grad must have the shape of delta \(4, 6\)"),
    (lambda: _step(grad=G.int()), TypeError, "grad must have dtype"),
    (lambda: _step(weight=W.numpy()), TypeError, "weight must be a torch.Tensor"),
    (lambda: _step(perturbed=torch.empty(6, 4).t()), ValueError, "perturbed must be contiguous"),
    (lambda: _step(perturbed=torch.empty(4, 7)), ValueError, "perturbed must have the shape of delta"),
    (lambda: _step(weight=torch.ones(4, 6, device="meta")), ValueError, "tensors must be on one device"),
    (lambda: _step(decay=float("nan")), ValueError, "decay must be a finite float"),
    (lambda: _step(decay="0.9"), TypeError, "decay must be a finite float"),
    (lambda: _step(step_size=float("inf")), ValueError, "step_size must be a finite float"),
    (lambda: _step(threshold=-0.1), ValueError, "threshold must be a float >= 0"),
    (lambda: _step(threshold=float("inf")), ValueError, "threshold must be a finite float"),
    (lambda: _step(noise_ratio=-1.0), ValueError, "noise_ratio must be a float >= 0"),
    (lambda: _step(group_dim=2), ValueError, "group_dim must be one of 0, 1; got 2"),
    (lambda: _step(group_dim=-1), ValueError, "group_dim must be one of 0, 1"),
    (lambda: _step(group_dim=True), TypeError, "group_dim must be an int"),
    (lambda: _step(group_dim=1.0), TypeError, "group_dim must be an int"),
    (lambda: _step(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*63 - 1\]"),
    (lambda: _step(seed=2 ** 63), ValueError, r"seed must be an int in \[0, 2\*\*63 - 1\]"),
    (lambda: _step(seed=1.0), TypeError, "seed must be an int"),
    (lambda: _step(delta=_BUFFER[:24].view(4, 6), perturbed=_BUFFER[20:44].view(4, 6)), ValueError,
     "delta must not share memory with perturbed"),
    (lambda: _step(delta=_BUFFER[:24].view(4, 6), grad=_BUFFER[:24].view(4, 6)), ValueError,
     "delta must not share memory with grad"),
    (lambda: ops.moreau_perturb_(torch.empty(4, 6), W, D.half(), noise_ratio=0.05, seed=0), TypeError,
     "delta must have dtype torch.float32"),
    (lambda: ops.moreau_perturb_(torch.empty(4, 6), torch.ones(4, 5), D, noise_ratio=0.05, seed=0),
     ValueError, "weight must have the shape of delta"),
    (lambda: ops.moreau_perturb_(torch.empty(4, 6), W, D, noise_ratio=float("nan"), seed=0), ValueError,
     "noise_ratio must be a finite float"),
    (lambda: ops.moreau_perturb_(W, W, D, noise_ratio=0.05, seed=0), ValueError,
     "perturbed must not share memory with weight"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_failed_call_leaves_inputs_untouched():
    delta, perturbed = torch.randn(4, 6), torch.randn(4, 6)
    before = delta.clone(), perturbed.clone()
    with pytest.raises(ValueError):
        ops.moreau_step_(delta, G, W, perturbed, decay=0.9, step_size=0.1, group_dim=3)
    assert torch.equal(delta, before[0]) and torch.equal(perturbed, before[1])


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
def test_opcheck(implementation):
    delta, grad, weight = _inputs((5, 9), torch.bfloat16, 1, seed=2)
    perturbed = torch.empty(5, 9, dtype=torch.bfloat16)
    with ops.use_implementation(implementation):
        torch.library.opcheck(torch.ops.pyprune.moreau_step_.default,
                              (delta, grad, weight, perturbed, 0.99, 0.1, 0.05, 1, 0.05, 3))
        torch.library.opcheck(torch.ops.pyprune.moreau_step_.default,
                              (delta, grad, weight, None, 0.99, 0.1, 0.0, 0, 0.05, 3))
        torch.library.opcheck(torch.ops.pyprune.moreau_perturb_.default,
                              (perturbed, weight, delta, 0.05, 4))


def test_ops_trace_into_one_graph_under_torch_compile():
    delta, grad, weight = _inputs((6, 10), torch.float32, 0, seed=8)

    def two_steps(delta, grad, weight, perturbed):
        ops.moreau_step_(delta, grad, weight, perturbed, decay=0.99, step_size=0.1, threshold=0.02,
                         group_dim=0, seed=1)
        ops.moreau_step_(delta, grad * 2, weight, None, decay=0.99, step_size=0.1, group_dim=1, seed=2)
        ops.moreau_perturb_(perturbed, weight, delta, noise_ratio=0.1, seed=3)
        return perturbed.sum()

    compiled = torch.compile(two_steps, backend="aot_eager", fullgraph=True)
    eager_delta, compiled_delta = delta.clone(), delta.clone()
    eager_perturbed, compiled_perturbed = torch.empty(6, 10), torch.empty(6, 10)
    expected = two_steps(eager_delta, grad, weight, eager_perturbed)
    assert torch.equal(compiled(compiled_delta, grad, weight, compiled_perturbed), expected)
    assert torch.equal(compiled_delta, eager_delta) and torch.equal(compiled_perturbed, eager_perturbed)
