"""SAFE's x-step ops pyprune.ops.sam_perturb_ / sam_adam_step_ on every implementation.

Each implementation (the C++ kernel, the Triton kernel in the interpreter or on a GPU) is checked against
pyprune.ops.reference on lists of tensors of awkward sizes (one element, sizes off every block and
chunk, a tensor of several chunks), in every dtype and in mixed-dtype lists: the norm to fp32
tolerance, anchors bit for bit, x and the Adam moments to their dtype's tolerance, over several
consecutive steps with the moments carried. Every implementation, the reference included, is also checked
against an fp64 oracle written here from the spec (§1.5, §1.8, K4–K5).
"""
import math

import pytest
import torch

from pyprune import ops
from pyprune.ops import sam
from tests.helpers import IMPLEMENTATIONS, DTYPES, HAS_CUDA, NATIVE_IMPLEMENTATIONS, assert_close

#: One element (1-D, 2-D and 0-d), sizes off every block, and 210,000 elements: several chunks
#: of the C++ kernel (32,768) and of the Triton kernel (16,384 on a GPU, 65,536 interpreted).
SHAPES = [(1,), (37, 129), (1, 1), (3, 1000), (), (300, 700)]
#: Every size a multiple of 16: with 16-byte aligned tensors the Triton launch is ALIGNED.
ALIGNED_SHAPES = [(64, 48), (16,), (32, 304)]
RHO = 0.05
HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, lam=0.3)
#: (rtol, atol) against the fp64 oracle: a few fp32 roundings, then (16-bit x) one rounding to
#: nearest, within half an ulp: the unit roundoff 2^-11 (fp16) / 2^-8 (bf16) relative, or half the
#: spacing of fp16 subnormals; truncation (a whole ulp) fails.
ONE_ROUNDING = {torch.float32: (1e-5, 1e-6), torch.float16: (2.0 ** -11 + 2.0 ** -20, 1e-7),
                torch.bfloat16: (2.0 ** -8 + 2.0 ** -20, 1e-7)}
MIXED = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _dtypes(kind, count):
    """``count`` dtypes: all ``kind``, or fp32/bf16/fp16 in turn (shifted by ``kind`` = "mixed<k>")."""
    if isinstance(kind, torch.dtype):
        return [kind] * count
    shift = int(kind[-1])
    return [MIXED[(i + shift) % 3] for i in range(count)]


def _state(shapes, x_dtypes, g_dtypes, seed=0):
    """A SAFE state: x, g, v (fp32, the compact ADMM state), keep (bool) and Adam moments from a
    few earlier steps (m of either sign, s > 0)."""
    g = _generator(seed)
    x = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, x_dtypes)]
    grads = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, g_dtypes)]
    vs = [torch.randn(s, generator=g) * 0.5 for s in shapes]
    keeps = [torch.rand(s, generator=g) < 0.5 for s in shapes]
    exp_avgs = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    exp_avg_sqs = [torch.rand(s, generator=g) * 0.01 + 1e-4 for s in shapes]
    return x, grads, vs, keeps, exp_avgs, exp_avg_sqs


def _on(device, tensors):
    """Copies on ``device`` (never the tensors themselves: the ops write in place)."""
    return [t.to(device, copy=True) for t in tensors]


def _clone(tensors):
    return [t.clone() for t in tensors]


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _assert_equal_bits(actual, expected):
    assert actual.dtype == expected.dtype and torch.equal(_bits(actual.cpu()), _bits(expected.cpu()))


def _perturb(implementation, device, x, grads, rho=RHO):
    """(‖g‖, perturbed x, anchors) from ``implementation`` on copies of the inputs."""
    x, grads = _on(device, x), _on(device, grads)
    anchors = [torch.full_like(t, float("nan")) for t in x]
    with ops.use_implementation(implementation):
        norm = ops.sam_perturb_(x, grads, anchors, rho)
    return norm, x, anchors


def _adam(implementation, device, x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, step, **hyper):
    """(x, m, s) after one step of ``implementation`` on copies of the inputs (x starts as NaN: the
    step must take x from the anchors)."""
    x = [torch.full_like(t, float("nan")) for t in _on(device, x)]
    exp_avgs, exp_avg_sqs = _on(device, exp_avgs), _on(device, exp_avg_sqs)
    with ops.use_implementation(implementation):
        out = ops.sam_adam_step_(x, _on(device, grads), _on(device, anchors), _on(device, vs),
                                 _on(device, keeps), exp_avgs, exp_avg_sqs, step=step, **{**HYPER, **hyper})
    assert out is None
    return x, exp_avgs, exp_avg_sqs


# ---- the fp64 oracle (spec §1.5, §1.8) ----------------------------------------------------------

def _oracle_perturb(x, grads, rho=RHO):
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = rho / norm if norm > 0 else 0.0
    return norm, [t.double() + scale * g.double() for t, g in zip(x, grads)]


def _oracle_adam(anchors, grads, vs, keeps, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay, lam):
    beta1, beta2 = betas
    out = []
    for anchor, g, v, keep, m, s in zip(anchors, grads, vs, keeps, exp_avgs, exp_avg_sqs):
        x = anchor.double()
        z, u = v.double() * keep, v.double() * ~keep
        G = g.double() + lam * (x - z + u)
        m = beta1 * m.double() + (1 - beta1) * G
        s = beta2 * s.double() + (1 - beta2) * G * G
        x = x * (1 - lr * weight_decay) - lr * (m / (1 - beta1 ** step)) / ((s / (1 - beta2 ** step)).sqrt() + eps)
        out.append((x, m, s))
    return out


def _assert_near(actual, expected64, dtype):
    assert actual.dtype == dtype
    rtol, atol = ONE_ROUNDING[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected64, rtol=rtol, atol=atol)


def _assert_moment(actual, expected64):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double().cpu(), expected64, rtol=1e-5, atol=1e-7)


def _dtype_cases():
    return [pytest.param(d, id=str(d)[6:]) for d in DTYPES] + [pytest.param("mixed0", id="mixed")]


# ---- sam_perturb_ -------------------------------------------------------------------------------

def _shape_cases():
    return [pytest.param(SHAPES, id="awkward"), pytest.param(ALIGNED_SHAPES, id="aligned")]


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("x_kind", _dtype_cases())
@pytest.mark.parametrize("shapes", _shape_cases())
def test_perturb_matches_oracle(implementation_device, x_kind, shapes):
    """‖g‖₂ over all the tensors, x + rho·g/‖g‖ rounded once, anchors the exact old x."""
    x, grads, *_ = _state(shapes, _dtypes(x_kind, len(shapes)), _dtypes("mixed1", len(shapes)), seed=1)
    expected_norm, expected_x = _oracle_perturb(x, grads)
    norm, got_x, anchors = _perturb(*implementation_device, x, grads)
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert math.isclose(float(norm), expected_norm, rel_tol=1e-6)
    for got, expected, before, anchor in zip(got_x, expected_x, x, anchors):
        _assert_near(got, expected, before.dtype)
        _assert_equal_bits(anchor, before)


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
@pytest.mark.parametrize("x_kind", _dtype_cases())
@pytest.mark.parametrize("g_kind", _dtype_cases())
def test_perturb_matches_reference(implementation_device, x_kind, g_kind):
    x, grads, *_ = _state(SHAPES, _dtypes(x_kind, len(SHAPES)), _dtypes(g_kind, len(SHAPES)), seed=2)
    norm, got_x, anchors = _perturb(*implementation_device, x, grads)
    expected_norm, expected_x, expected_anchors = _perturb("reference", "cpu", x, grads)
    torch.testing.assert_close(norm.cpu(), expected_norm, rtol=1e-6, atol=0)
    for got, expected, anchor, expected_anchor in zip(got_x, expected_x, anchors, expected_anchors):
        assert got.dtype == expected.dtype
        assert_close(got, expected, got.dtype)
        _assert_equal_bits(anchor, expected_anchor)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_zero_gradient_does_not_move_x(implementation_device):
    """‖g‖ = 0: the norm is 0, x keeps its bits, the anchors are the old x."""
    shapes = [(5, 7), (1,), (70000,)]
    x, *_ = _state(shapes, MIXED, MIXED, seed=3)
    grads = [torch.zeros(s, dtype=d) for s, d in zip(shapes, [torch.bfloat16, torch.float32, torch.float16])]
    norm, got_x, anchors = _perturb(*implementation_device, x, grads)
    assert float(norm) == 0.0
    for got, before, anchor in zip(got_x, x, anchors):
        _assert_equal_bits(got, before)
        _assert_equal_bits(anchor, before)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_one_nonzero_gradient_sets_the_norm_for_all(implementation_device):
    """Only the last tensor has a gradient: the others keep their bits, it moves by exactly rho."""
    shapes = [(4, 9), (33,)]
    x, *_ = _state(shapes, [torch.float32, torch.float32], [torch.float32] * 2, seed=4)
    grads = [torch.zeros(4, 9), torch.full((33,), -2.0)]
    norm, got_x, _ = _perturb(*implementation_device, x, grads, rho=0.5)
    assert math.isclose(float(norm), 2.0 * math.sqrt(33), rel_tol=1e-6)
    _assert_equal_bits(got_x[0], x[0])
    torch.testing.assert_close(got_x[1].cpu() - x[1], torch.full((33,), -0.5 / math.sqrt(33)), rtol=1e-5, atol=1e-6)


# ---- sam_adam_step_ -----------------------------------------------------------------------------

@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("x_kind", _dtype_cases())
@pytest.mark.parametrize("shapes", _shape_cases())
def test_adam_step_matches_oracle(implementation_device, x_kind, shapes):
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state(shapes, _dtypes(x_kind, len(shapes)),
                                                        _dtypes("mixed2", len(shapes)), seed=5)
    step = 7
    got_x, got_m, got_s = _adam(*implementation_device, x, grads, x, vs, keeps, exp_avgs, exp_avg_sqs, step)
    expected = _oracle_adam(x, grads, vs, keeps, exp_avgs, exp_avg_sqs, step, **HYPER)
    for i, (ex, em, es) in enumerate(expected):
        _assert_near(got_x[i], ex, x[i].dtype)
        _assert_moment(got_m[i], em)
        _assert_moment(got_s[i], es)


@pytest.mark.parametrize("implementation_device", NATIVE_IMPLEMENTATIONS)
@pytest.mark.parametrize("x_kind", _dtype_cases())
@pytest.mark.parametrize("g_kind", [torch.float32, "mixed1"], ids=["g_float32", "g_mixed"])
def test_safe_steps_match_reference(implementation_device, x_kind, g_kind):
    """Four x-steps as SAFE runs them (perturb, a gradient at the perturbed point, restore and Adam),
    from zero moments: every step's results against the reference's from the same state, and the
    implementation's own x, m and s carried to the next step."""
    implementation, device = implementation_device
    x_dtypes, g_dtypes = _dtypes(x_kind, len(SHAPES)), _dtypes(g_kind, len(SHAPES))
    x, _, vs, keeps, _, _ = _state(SHAPES, x_dtypes, g_dtypes, seed=6)
    exp_avgs = [torch.zeros(s) for s in SHAPES]
    exp_avg_sqs = [torch.zeros(s) for s in SHAPES]
    g = _generator(60)
    for step in range(1, 5):
        grads = [torch.randn(s, generator=g).to(d) for s, d in zip(SHAPES, g_dtypes)]
        _, perturbed, anchors = _perturb(implementation, device, x, grads)
        _, expected_perturbed, expected_anchors = _perturb("reference", "cpu", x, grads)
        for got, expected in zip(perturbed, expected_perturbed):
            assert_close(got, expected, got.dtype)
        grads_sam = [torch.randn(s, generator=g).to(d) for s, d in zip(SHAPES, g_dtypes)]
        state = (grads_sam, [a.cpu() for a in anchors], vs, keeps, exp_avgs, exp_avg_sqs)
        got_x, got_m, got_s = _adam(implementation, device, x, *state, step)
        expected_x, expected_m, expected_s = _adam("reference", "cpu", x, *state, step)
        for i in range(len(SHAPES)):
            assert_close(got_x[i], expected_x[i], x_dtypes[i])
            assert_close(got_m[i], expected_m[i], torch.float32)
            assert_close(got_s[i], expected_s[i], torch.float32)
        x, exp_avgs, exp_avg_sqs = [t.cpu() for t in got_x], [t.cpu() for t in got_m], [t.cpu() for t in got_s]
    assert all(bool(m.abs().sum() > 0) for m in exp_avgs)


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_anchors_restore_x_exactly(implementation_device, dtype):
    """perturb, then a step with lr = 0: x is the pre-perturbation x bit for bit (the moments still
    take the step)."""
    implementation, device = implementation_device
    shapes = [(3, 1000), (1,), (37, 129)]
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state(shapes, [dtype] * 3, [dtype] * 3, seed=7)
    x_dev = _on(device, x)
    anchors = [torch.empty_like(t) for t in x_dev]
    exp_avgs_dev = _on(device, exp_avgs)
    with ops.use_implementation(implementation):
        ops.sam_perturb_(x_dev, _on(device, grads), anchors, 0.5)
        assert not any(torch.equal(a, t) for a, t in zip(anchors, x_dev))
        ops.sam_adam_step_(x_dev, _on(device, grads), anchors, _on(device, vs), _on(device, keeps), exp_avgs_dev,
                           _on(device, exp_avg_sqs), lr=0.0, weight_decay=0.1, lam=0.3, step=1)
    for got, before in zip(x_dev, x):
        _assert_equal_bits(got, before)
    assert not any(torch.equal(m.cpu(), before) for m, before in zip(exp_avgs_dev, exp_avgs))


@pytest.mark.parametrize("implementation_device", IMPLEMENTATIONS)
def test_penalty_pulls_kept_entries_to_z_and_pruned_ones_to_minus_u(implementation_device):
    """With g = 0 and λ > 0 the step descends the penalty alone: G = λ(x − z + u) moves a kept
    entry toward z = v and a pruned one toward −u = −v (spec §1.5, §1.8)."""
    shape = (6, 11)
    x = torch.full(shape, 1.0)
    vs = [torch.full(shape, 0.25)]
    keeps = [torch.arange(66).reshape(shape) % 3 == 0]
    got_x, _, _ = _adam(*implementation_device, [x], [torch.zeros(shape)], [x], vs, keeps, [torch.zeros(shape)],
                        [torch.zeros(shape)], 1, lr=0.1, weight_decay=0.0, lam=1.0)
    # Adam's first step moves every entry by lr·sign(G): kept G = 1 − 0.25 > 0, pruned G = 1.25 > 0
    torch.testing.assert_close(got_x[0].cpu(), torch.full(shape, 0.9), rtol=1e-6, atol=1e-6)
    got_x, got_m, _ = _adam(*implementation_device, [x], [torch.zeros(shape)], [x], vs, keeps, [torch.zeros(shape)],
                            [torch.zeros(shape)], 1, lr=0.0, weight_decay=0.0, lam=1.0)
    expected_m = torch.where(keeps[0], 0.75, 1.25) * (1 - HYPER["betas"][0])
    torch.testing.assert_close(got_m[0].cpu(), expected_m, rtol=1e-6, atol=1e-7)


def _shifted(t, elements=1):
    """A copy of ``t`` whose data starts ``elements`` elements past an allocation's start (off
    16-byte alignment for one element)."""
    storage = torch.empty(t.numel() + elements, dtype=t.dtype)
    return storage[elements:].view(t.shape).copy_(t)


@pytest.mark.parametrize("implementation_device", [p for p in IMPLEMENTATIONS if p.id != "triton-cuda"])
def test_tensors_off_alignment_and_at_odd_addresses(implementation_device):
    """Tensors one element off 16-byte alignment and an fp32 x at an odd byte address (from a
    buffer): the Triton kernels group tensors by address residue, so each is reached at its own
    address. Results against the oracle."""
    implementation, device = implementation_device
    shapes = [(5, 16), (33,), (16,)]
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state(shapes, [torch.float32, torch.bfloat16, torch.float32],
                                                        [torch.float32, torch.float16, torch.float32], seed=11)
    odd = torch.frombuffer(bytearray(4 * 16 + 1), dtype=torch.float32, offset=1, count=16)
    assert odd.data_ptr() % 4 == 1
    x = [_shifted(x[0]), _shifted(x[1]), odd.copy_(x[2])]
    grads = [_shifted(g) for g in grads]
    anchors = [torch.empty_like(t) for t in x]
    expected_norm, expected_x = _oracle_perturb(x, grads)
    moments = _clone(exp_avgs), _clone(exp_avg_sqs)
    with ops.use_implementation(implementation):
        norm = ops.sam_perturb_(x, grads, anchors, RHO)
        assert math.isclose(float(norm), expected_norm, rel_tol=1e-6)
        for got, expected in zip(x, expected_x):
            _assert_near(got, expected, got.dtype)
        ops.sam_adam_step_(x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, step=2, **HYPER)
    for got, (expected, _, _) in zip(x, _oracle_adam(anchors, grads, vs, keeps, *moments, 2, **HYPER)):
        _assert_near(got, expected, got.dtype)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
def test_triton_launch_is_aligned_only_when_every_tensor_is():
    """The ALIGNED launches (16-byte vector accesses on a GPU) are those whose tensors all start on
    16 bytes and hold a multiple of 16 elements."""
    from pyprune.ops.kernels import sam

    def aligned(make, shapes):
        lists = [[make(torch.zeros(s)) for s in shapes] for _ in range(2)]
        return [sam._Launch(lists, indices, True).aligned for indices in sam._groups(lists).values()]

    assert aligned(lambda t: t, ALIGNED_SHAPES) == [True]
    assert aligned(lambda t: t, SHAPES) == [False]
    assert aligned(_shifted, ALIGNED_SHAPES) == [False]


@pytest.mark.parametrize("name", ["perturb", "adam"])
def test_cpu_kernel_does_not_depend_on_the_thread_count(name):
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state(SHAPES, _dtypes("mixed0", len(SHAPES)),
                                                        _dtypes("mixed2", len(SHAPES)), seed=8)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            if name == "perturb":
                norm, got_x, _ = _perturb("cpu", "cpu", x, grads)
                results.append([norm, *got_x])
            else:
                results.append([t for out in _adam("cpu", "cpu", x, grads, x, vs, keeps, exp_avgs, exp_avg_sqs, 3)
                                for t in out])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        _assert_equal_bits(one, two)


# ---- argument checks, tracing -------------------------------------------------------------------

X = [torch.ones(4, 6), torch.ones(5, dtype=torch.bfloat16)]


def _perturb_call(**overrides):
    args = {"params": _clone(X), "grads": [torch.ones(4, 6), torch.ones(5)],
            "anchors": [torch.empty_like(t) for t in X], "rho": 0.05}
    args.update(overrides)
    return ops.sam_perturb_(**args)


def _step_call(**overrides):
    args = {"params": _clone(X), "grads": [torch.ones(4, 6), torch.ones(5)], "anchors": _clone(X),
            "vs": [torch.zeros(4, 6), torch.zeros(5)], "keeps": [torch.zeros(4, 6, dtype=torch.bool),
                                                                torch.zeros(5, dtype=torch.bool)],
            "exp_avgs": [torch.zeros(4, 6), torch.zeros(5)], "exp_avg_sqs": [torch.zeros(4, 6), torch.zeros(5)],
            "lr": 0.01, "lam": 0.1, "step": 1}
    args.update(overrides)
    return ops.sam_adam_step_(**args)


_BUFFER = torch.zeros(40)


@pytest.mark.parametrize("call,error,message", [
    (lambda: _perturb_call(params=[]), ValueError, "params must be a non-empty list of tensors"),
    (lambda: _perturb_call(params=X[0]), ValueError, "params must be a non-empty list of tensors"),
    (lambda: _perturb_call(grads=[torch.ones(4, 6)]), ValueError, "grads must be a list of 2 tensors, one per params"),
    (lambda: _perturb_call(anchors=[torch.empty(4, 6)] * 3), ValueError, "anchors must be a list of 2 tensors"),
    (lambda: _perturb_call(grads=[torch.ones(4, 6), torch.ones(6)]), ValueError,
     r"grads\[1\] must have the shape of params\[1\] \(5,\); got \(6,\)"),
    (lambda: _perturb_call(grads=[torch.ones(4, 6, dtype=torch.int32), torch.ones(5)]), TypeError,
     r"grads\[0\] must have dtype float32, float16, bfloat16; got torch.int32"),
    (lambda: _perturb_call(params=[torch.ones(4, 6).double(), X[1].clone()]), TypeError,
     r"params\[0\] must have dtype float32, float16, bfloat16"),
    (lambda: _perturb_call(anchors=[torch.empty(4, 6), torch.empty(5)]), TypeError,
     r"anchors\[1\] must have dtype torch.bfloat16; got torch.float32"),
    (lambda: _perturb_call(params=[torch.ones(6, 4).t(), X[1].clone()]), ValueError,
     r"params\[0\] must be contiguous"),
    (lambda: _perturb_call(grads=[torch.ones(4, 6), torch.ones(5, device="meta")]), ValueError,
     "tensors must be on one device"),
    (lambda: _perturb_call(grads=[torch.ones(4, 6), [1.0] * 5]), TypeError, r"grads\[1\] must be a torch.Tensor"),
    (lambda: _perturb_call(params=[torch.ones(0, 6), X[1].clone()]), ValueError, r"params\[0\] must not be empty"),
    (lambda: _perturb_call(rho=-0.1), ValueError, "rho must be a float >= 0; got -0.1"),
    (lambda: _perturb_call(rho=float("nan")), ValueError, "rho must be a finite float"),
    (lambda: _perturb_call(rho="0.1"), TypeError, "rho must be a finite float"),
    (lambda: _step_call(vs=[torch.zeros(4, 6), torch.zeros(5, dtype=torch.float16)]), TypeError,
     r"vs\[1\] must have dtype torch.float32; got torch.float16"),
    (lambda: _step_call(keeps=[torch.zeros(4, 6), torch.zeros(5, dtype=torch.bool)]), TypeError,
     r"keeps\[0\] must have dtype torch.bool; got torch.float32"),
    (lambda: _step_call(exp_avgs=[torch.zeros(4, 6)]), ValueError, "exp_avgs must be a list of 2 tensors"),
    (lambda: _step_call(exp_avg_sqs=[torch.zeros(4, 6), torch.zeros(1, 5)]), ValueError,
     r"exp_avg_sqs\[1\] must have the shape of params\[1\] \(5,\); got \(1, 5\)"),
    (lambda: _step_call(exp_avgs=[torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(5)]), TypeError,
     r"exp_avgs\[0\] must have dtype torch.float32"),
    (lambda: _step_call(keeps=[torch.zeros(6, 4, dtype=torch.bool).t(), torch.zeros(5, dtype=torch.bool)]),
     ValueError, r"keeps\[0\] must be contiguous"),
    (lambda: _step_call(anchors=[torch.ones(4, 6)]), ValueError, "anchors must be a list of 2 tensors"),
    (lambda: _step_call(lr=-1e-3), ValueError, "lr must be a float >= 0"),
    (lambda: _step_call(lr=float("inf")), ValueError, "lr must be a finite float"),
    (lambda: _step_call(betas=(1.0, 0.95)), ValueError, r"betas must be two numbers in \[0, 1\); got \(1.0, 0.95\)"),
    (lambda: _step_call(betas=(0.9, -0.1)), ValueError, r"betas must be two numbers in \[0, 1\)"),
    (lambda: _step_call(betas=(0.9, float("nan"))), ValueError, "betas must be a finite float"),
    (lambda: _step_call(eps=0.0), ValueError, "eps must be > 0; got 0.0"),
    (lambda: _step_call(eps=float("nan")), ValueError, "eps must be a finite float"),
    (lambda: _step_call(weight_decay=-0.1), ValueError, "weight_decay must be a float >= 0"),
    (lambda: _step_call(lam=-1.0), ValueError, "lam must be a float >= 0"),
    (lambda: _step_call(betas=(0.9,)), ValueError, r"betas must be two numbers \(beta1, beta2\)"),
    (lambda: _step_call(anchors=[torch.zeros(4, 6, dtype=torch.float16), torch.zeros(5, dtype=torch.bfloat16)]),
     TypeError, r"anchors\[0\] must have dtype torch.float32"),
    (lambda: _step_call(step=0), ValueError, "step must be >= 1"),
    (lambda: _step_call(step=1.0), TypeError, "step must be an int"),
    (lambda: _step_call(step=True), TypeError, "step must be an int"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_failed_call_leaves_inputs_untouched(name):
    params, anchors = [torch.randn(4, 6), torch.randn(5)], [torch.randn(4, 6), torch.randn(5)]
    exp_avgs = [torch.randn(4, 6), torch.randn(5)]
    before = [_clone(params), _clone(anchors), _clone(exp_avgs)]
    with ops.use_implementation(name):
        with pytest.raises(TypeError, match=r"grads\[1\]"):
            ops.sam_perturb_(params, [torch.ones(4, 6), torch.ones(5, dtype=torch.int64)], anchors, 0.1)
        with pytest.raises(ValueError, match="step must be >= 1"):
            _step_call(params=params, anchors=anchors, exp_avgs=exp_avgs, step=0)
    for now, then in zip([params, anchors, exp_avgs], before):
        assert all(torch.equal(a, b) for a, b in zip(now, then))


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_opcheck(name):
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state([(5, 9), (7,)], [torch.bfloat16, torch.float32],
                                                        [torch.float32, torch.float16], seed=9)
    anchors = [torch.empty_like(t) for t in x]
    with ops.use_implementation(name):
        torch.library.opcheck(torch.ops.pyprune.sam_perturb_.default, (x, grads, anchors, RHO))
        torch.library.opcheck(torch.ops.pyprune.sam_adam_step_.default,
                              (x, grads, _clone(x), vs, keeps, exp_avgs, exp_avg_sqs, 0.01, 0.9, 0.95, 1e-8, 0.1,
                               0.3, 2))


def test_a_safe_step_traces_into_one_graph_under_torch_compile():
    shapes = [(6, 10), (3,)]
    x, grads, vs, keeps, exp_avgs, exp_avg_sqs = _state(shapes, [torch.float32, torch.bfloat16],
                                                        [torch.float32, torch.float32], seed=10)

    def safe_step(x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs):
        norm = ops.sam_perturb_(x, grads, anchors, RHO)
        ops.sam_adam_step_(x, [g * 2 for g in grads], anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr=0.01,
                           weight_decay=0.1, lam=0.3, step=2)
        return norm * 1

    compiled = torch.compile(safe_step, backend="aot_eager", fullgraph=True)
    eager_state = [_clone(x), grads, [torch.empty_like(t) for t in x], vs, keeps, _clone(exp_avgs),
                   _clone(exp_avg_sqs)]
    compiled_state = [_clone(x), grads, [torch.empty_like(t) for t in x], vs, keeps, _clone(exp_avgs),
                      _clone(exp_avg_sqs)]
    assert torch.equal(compiled(*compiled_state), safe_step(*eager_state))
    for got, expected in zip(compiled_state, eager_state):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
