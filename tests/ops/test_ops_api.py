"""The public op API: argument validation, forcing an implementation, torch.compile tracing."""
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import warnings

from pyprune.ops import implementations
from pyprune import ops
from pyprune.ops import reference as R
from pyprune.ops.conventions import sparse24_mma_meta

from tests.helpers import rand, randn, tied_scores

W = torch.randn(4, 8)


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.nm_mask(W, 4, 4), ValueError, "1 <= n < m <= 32"),
    (lambda: ops.nm_mask(W, 2, 64), ValueError, "1 <= n < m <= 32"),
    (lambda: ops.nm_mask(W, 2, 3), ValueError, "m=3 must divide the last dim of scores"),
    (lambda: ops.nm_mask(W, 2.0, 4), TypeError, "n must be an int"),
    (lambda: ops.nm_mask(W.int(), 2, 4), TypeError, "scores must have dtype"),
    (lambda: ops.nm_mask(W.numpy(), 2, 4), TypeError, "scores must be a torch.Tensor"),
    (lambda: ops.nm_mask(torch.empty(0, 4), 2, 4), ValueError, "must not be empty"),
    (lambda: ops.topk_mask(W, 1.0), ValueError, r"sparsity must be in \[0, 1\)"),
    (lambda: ops.topk_mask(W, -0.1), ValueError, r"sparsity must be in \[0, 1\)"),
    (lambda: ops.topk_mask(W, 0.5, scope="column"), ValueError, "scope must be one of 'row', 'tensor'"),
    (lambda: ops.wanda_score(W, torch.ones(7)), ValueError, "act_sqnorm must have one entry per input column"),
    (lambda: ops.score_nm_mask(W[0], 2, 4), ValueError, "w must be 2-D"),
    (lambda: ops.taylor_score(W, torch.ones(4, 7)), ValueError, "grad must have the shape of w"),
    (lambda: ops.accumulate_sqnorm_(torch.zeros(8, dtype=torch.float16), W), TypeError, "acc must be a 1-D float32"),
    (lambda: ops.accumulate_sqnorm_(torch.zeros(16)[::2], W), ValueError, "acc must be contiguous"),
    (lambda: ops.accumulate_abs_outer_(torch.zeros(4, 8), torch.ones(3, 5), W[:3]), ValueError,
     "a must have acc's 4 rows as its last dim"),
    (lambda: ops.group_soft_threshold(W, 1.0, group_dim=2), ValueError, "group_dim must be in"),
    (lambda: ops.channel_penalty_(torch.zeros(4, 8), W, torch.tensor([1, 1]), 1, 0.1), ValueError,
     "channels must not repeat a position"),
    (lambda: ops.channel_penalty_(torch.zeros(4, 8), W, torch.tensor([1]), 1, 0.1, norm="fro"), ValueError,
     "norm must be one of 'l2', 'l1'"),
    (lambda: ops.soft_threshold(W, -1.0), ValueError, "alpha must be a float >= 0"),
    (lambda: ops.nm_compress(W, torch.ones(4, 8, dtype=torch.bool), 2, 4), ValueError,
     "mask must keep exactly n=2 of every m=4 elements; row 0, group 0 keeps 4"),
    (lambda: ops.nm_compress(W, torch.ones(4, 8), 2, 4), TypeError, "mask must be a bool tensor"),
    (lambda: ops.nm_decompress(torch.ones(4, 4), torch.zeros(4, 2, dtype=torch.uint8), 2, 4),
     ValueError, r"meta must have shape \(4, 1\)"),
    (lambda: ops.nm_linear(torch.ones(3, 5), *R.nm_compress(W, R.nm_mask(W, 2, 4), 2, 4), 2, 4),
     ValueError, "x must have 8 features"),
    (lambda: ops.sliced_linear(torch.ones(2, 2), W, in_index=torch.tensor([0, 8])), ValueError,
     r"in_index must hold positions in \[0, 8\)"),
    (lambda: ops.sliced_linear(torch.ones(2, 2), W, in_index=torch.tensor([1, 1])), ValueError,
     "in_index must not repeat"),
    (lambda: ops.sliced_linear(torch.ones(2, 8, dtype=torch.float16), W), TypeError, "x and w must have one dtype"),
    (lambda: ops.admm_dual_update_(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bool), W, n=2), ValueError,
     "give either sparsity .* or both n and m"),
    (lambda: ops.admm_dual_update_(torch.zeros(4, 8).half(), torch.zeros(4, 8, dtype=torch.bool), W,
                                   sparsity=0.5), TypeError, "v must have dtype torch.float32"),
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("implementation", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("statistic", [-1.0, float("nan")])
def test_every_op_taking_act_sqnorm_refuses_a_negative_or_nan_one_on_every_implementation(implementation, statistic):
    """act_sqnorm is a sum of squares: a negative (or NaN) entry would make Wanda scores NaN, so
    every op that reads it refuses it, naming it and the column, on every implementation."""
    sqnorm = torch.rand(8) + 0.1
    sqnorm[5] = statistic
    calls = {"score": lambda: ops.wanda_score(W, sqnorm),
             "nm_mask": lambda: ops.score_nm_mask(W, 2, 4, sqnorm),
             "topk_mask": lambda: ops.score_topk_mask(W, 0.5, "row", sqnorm),
             "admm_dual_update_": lambda: ops.admm_dual_update_(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bool),
                                                                W, n=2, m=4, act_sqnorm=sqnorm)}
    for op, call in calls.items():
        if implementation not in ops.IMPLEMENTATIONS[op]:
            continue
        with ops.use_implementation(implementation):
            with pytest.raises(ValueError, match=r"act_sqnorm must be >= 0 \(a sum of squares of activations\); "
                                                 rf"got {statistic} at column 5"):
                call()


def test_failed_call_leaves_inputs_untouched():
    acc = torch.zeros(7)
    before = acc.clone()
    with pytest.raises(ValueError):
        ops.accumulate_sqnorm_(acc, W)
    assert torch.equal(acc, before)


def test_non_contiguous_inputs_are_accepted_where_they_are_read_only():
    wt = torch.randn(8, 16).t()
    assert torch.equal(ops.score_nm_mask(wt, 2, 4), R.score_nm_mask(wt.contiguous(), 2, 4))


def test_forced_implementation_is_strict():
    with ops.use_implementation("cuda"):
        with pytest.raises(RuntimeError, match="implementation 'cuda' cannot run op 'nm_mask' on cpu"):
            ops.nm_mask(W, 2, 4)
    with ops.use_implementation("cpu"):
        with pytest.raises(RuntimeError, match="has no 'cpu' implementation"):
            ops.soft_threshold(W, 0.1)
        with pytest.raises(RuntimeError, match="has no 'cpu' implementation"):  # the op called directly
            torch.ops.pyprune.soft_threshold(W, 0.1)
    with pytest.raises(ValueError, match="implementation must be one of"):
        with ops.use_implementation("fast"):
            pass


def test_forcing_nests_and_none_restores_the_dispatchers_choice():
    with ops.use_implementation("cuda"):
        with ops.use_implementation(None):
            assert torch.equal(ops.nm_mask(W, 2, 4), R.nm_mask(W, 2, 4))
        with pytest.raises(RuntimeError, match="cannot run"):
            ops.nm_mask(W, 2, 4)
    assert implementations.forced_implementation() is None


def test_forced_reference_runs_the_reference_under_autograd():
    """Forcing works below autograd: nm_linear's backward formula still applies."""
    w = torch.randn(8, 16)
    values, meta = R.nm_compress(w, R.nm_mask(w.abs(), 2, 4), 2, 4)
    x = torch.randn(3, 16, requires_grad=True)
    with ops.use_implementation("reference"):
        ops.nm_linear(x, values, meta, 2, 4).sum().backward()
    torch.testing.assert_close(x.grad, R.nm_decompress(values, meta, 2, 4).sum(dim=0).expand(3, 16))


def test_reference_implementation_and_dispatchers_choice_agree():
    scores = torch.randint(0, 3, (16, 64)).float()
    with ops.use_implementation("reference"):
        forced = ops.nm_mask(scores, 2, 4)
    assert torch.equal(forced, ops.nm_mask(scores, 2, 4))


def test_environment_variable_selects_the_implementation(monkeypatch):
    monkeypatch.setenv("PYPRUNE_IMPLEMENTATION", "cuda")
    assert implementations.forced_implementation() == "cuda"
    with pytest.raises(RuntimeError, match="implementation 'cuda' cannot run"):
        ops.nm_mask(W, 2, 4)
    monkeypatch.setenv("PYPRUNE_IMPLEMENTATION", "bogus")
    with pytest.raises(ValueError, match="PYPRUNE_IMPLEMENTATION must be one of reference, triton, cpu, cuda"):
        ops.nm_mask(W, 2, 4)


def test_former_names_still_force_with_a_deprecation_warning(monkeypatch):
    monkeypatch.setenv("PYPRUNE_BACKEND", "cuda")
    with pytest.warns(DeprecationWarning, match="PYPRUNE_BACKEND is deprecated"):
        with pytest.raises(RuntimeError, match="implementation 'cuda' cannot run"):
            ops.nm_mask(W, 2, 4)
    monkeypatch.delenv("PYPRUNE_BACKEND")
    with pytest.warns(DeprecationWarning, match="use_backend is deprecated"):
        forcing = ops.use_backend("cuda")
    with forcing, pytest.raises(RuntimeError, match="cannot run"):
        ops.nm_mask(W, 2, 4)
    with pytest.warns(DeprecationWarning, match="BACKENDS is deprecated"):
        assert ops.BACKENDS == implementations.NAMES
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names do not warn
        with ops.use_implementation("reference"):
            ops.nm_mask(W, 2, 4)


def test_ops_trace_under_torch_compile():
    w = torch.randn(16, 32)
    sqnorm = torch.rand(32) + 0.1
    x = torch.randn(3, 32)
    values, meta = R.nm_compress(w, R.nm_mask(w.abs(), 2, 4), 2, 4)

    def pipeline(w, sqnorm, x, values, meta):
        mask = ops.score_nm_mask(w, 2, 4, sqnorm)
        shrunk = ops.group_soft_threshold(w * mask, 0.5, 0)
        return mask, shrunk, ops.nm_linear(x, values, meta, 2, 4), ops.wanda_score(w, sqnorm)

    compiled = torch.compile(pipeline, backend="aot_eager", fullgraph=True)
    for got, expected in zip(compiled(w, sqnorm, x, values, meta), pipeline(w, sqnorm, x, values, meta)):
        assert torch.equal(got, expected)


def _compile_cases(dtype):
    """{public op: (function of tensors, its tensor arguments)}, on awkward shapes and tied scores."""
    w = randn((6, 24), dtype, seed=1)
    grad = randn((6, 24), dtype, seed=2)
    sqnorm = rand((24,), seed=3) + 0.1
    scores = tied_scores((6, 24), dtype, seed=4)
    mask = R.nm_mask(w.float().abs(), 2, 4)
    values, meta = R.nm_compress(w, mask, 2, 4)
    x = randn((2, 3, 24), dtype, seed=5)
    bias = randn((6,), dtype, seed=6)
    in_index, out_index = torch.tensor([3, 0, 17, 8, 23]), torch.tensor([5, 1, 2])
    delta, perturbed = randn((6, 24), seed=7) * 0.1, torch.zeros(6, 24, dtype=dtype)
    half = torch.float16 if dtype == torch.float32 else dtype  # sparse24_linear is fp16/bf16 only
    w24 = randn((6, 32), half, seed=16)  # its in_features are a multiple of 32
    values24, meta24 = R.nm_compress(w24, R.nm_mask(w24.float().abs(), 2, 4), 2, 4)

    def moreau_steps(d, g, w, p):
        ops.moreau_step_(d, g, w, p, decay=0.99, step_size=0.1, threshold=0.3, group_dim=1, seed=3)
        ops.moreau_step_(d, g, w, None, decay=0.99, step_size=0.1, seed=4)
        return d.clone(), p.clone()  # graph outputs (returning an input would bypass the graph)

    def moreau_perturb(p, w, d):
        ops.moreau_perturb_(p, w, d, noise_ratio=0.05, seed=5)
        return p.clone()

    def channel_penalties(g, w, g_norm, w_norm):
        """DReSS: input columns (ℓ2), output rows (ℓ1) and an RMSNorm scale."""
        norms = (ops.channel_penalty_(g, w, in_index, 1, 0.1),
                 ops.channel_penalty_(g, w, out_index, 0, 0.2, "l1"),
                 ops.channel_penalty_(g_norm, w_norm, in_index, 0, 0.3))
        return (*norms, g.clone(), g_norm.clone())

    def dual_updates(v, keep, x, a):
        """SAFE's dual update: N:M by |v|, an odd N:M by the Wanda score, top-k per row and tensor."""
        residuals = (ops.admm_dual_update_(v, keep, x, n=2, m=4),
                     ops.admm_dual_update_(v, keep, x, n=3, m=8, act_sqnorm=a),
                     ops.admm_dual_update_(v, keep, x, sparsity=0.5, scope="row", act_sqnorm=a),
                     ops.admm_dual_update_(v, keep, x, sparsity=0.7, scope="tensor"))
        return (*residuals, v.clone(), keep.clone())

    def sam_perturb(x, b, g, gb, anchor, anchor_b):
        """SAFE's ascent over two tensors (a weight and a bias-like vector)."""
        norm = ops.sam_perturb_([x, b], [g, gb], [anchor, anchor_b], 0.05)
        return norm, x.clone(), b.clone(), anchor.clone(), anchor_b.clone()

    def sam_adam_step(x, g, anchor, v, keep, m, s):
        ops.sam_adam_step_([x], [g], [anchor], [v], [keep], [m], [s], lr=0.01, weight_decay=0.1, lam=0.3,
                           step=2)
        return x.clone(), m.clone(), s.clone()

    return {
        "magnitude_score": (ops.magnitude_score, (w,)),
        "wanda_score": (ops.wanda_score, (w, sqnorm)),
        "taylor_score": (ops.taylor_score, (w, grad)),
        "accumulate_sqnorm_": (ops.accumulate_sqnorm_, (torch.ones(24), x)),
        "accumulate_abs_outer_": (lambda acc, dy, x: ops.accumulate_abs_outer_(acc, dy, x, alpha=2.0),
                                  (torch.ones(6, 24), randn((2, 3, 6), dtype, seed=8), x)),
        "topk_mask": (lambda s: (ops.topk_mask(s, 0.4), ops.topk_mask(s, 0.7, scope="tensor")), (scores,)),
        "nm_mask": (lambda s: (ops.nm_mask(s, 2, 4), ops.nm_mask(s, 5, 8)), (scores,)),
        "score_nm_mask": (lambda w, a: (ops.score_nm_mask(w, 2, 4), ops.score_nm_mask(w, 1, 3, a)), (w, sqnorm)),
        "score_topk_mask": (lambda w, a: (ops.score_topk_mask(w, 0.5, "tensor"),
                                          ops.score_topk_mask(w, 0.3, "row", a)), (w, sqnorm)),
        "soft_threshold": (lambda x: ops.soft_threshold(x, 0.5), (w,)),
        "group_soft_threshold": (lambda x: (ops.group_soft_threshold(x, 2.0, 0),
                                            ops.group_soft_threshold(x, 1.5, 1)), (w,)),
        "nm_compress": (lambda w, mask: ops.nm_compress(w, mask, 2, 4), (w, mask)),
        "nm_decompress": (lambda v, meta: ops.nm_decompress(v, meta, 2, 4), (values, meta)),
        "sparse24_compress": (ops.sparse24_compress, (w24, R.nm_mask(w24.float().abs(), 2, 4))),
        "nm_linear": (lambda x, v, meta, b: ops.nm_linear(x, v, meta, 2, 4, b), (x, values, meta, bias)),
        "sparse24_linear": (lambda x, v, meta, b: ops.sparse24_linear(x, v, meta, b),
                            (randn((2, 3, 32), half, seed=17), values24, sparse24_mma_meta(meta24, 32),
                             bias.to(half))),
        "sliced_linear": (lambda x, w, b, i, o: ops.sliced_linear(x, w, b, i, o),
                          (x[..., :5].contiguous(), w, bias, in_index, out_index)),
        "moreau_step_": (moreau_steps, (delta, grad, w, perturbed)),
        "moreau_perturb_": (moreau_perturb, (perturbed, w, delta)),
        "channel_penalty_": (channel_penalties,
                             (grad, w, randn((24,), dtype, seed=9), randn((24,), dtype, seed=10))),
        "admm_dual_update_": (dual_updates, (randn((6, 24), seed=11), rand((6, 24), seed=12) < 0.5, w, sqnorm)),
        "sam_perturb_": (sam_perturb, (w, bias, grad, randn((6,), seed=11), torch.zeros_like(w),
                                       torch.zeros_like(bias))),
        "sam_adam_step_": (sam_adam_step, (w, grad, (w.float() * 1.01).to(dtype), randn((6, 24), seed=12),
                                           rand((6, 24), seed=13) < 0.5, randn((6, 24), seed=14),
                                           rand((6, 24), seed=15))),
    }


PUBLIC_OPS = sorted(set(ops.__all__) - {"IMPLEMENTATIONS", "use_implementation"})


def test_every_public_op_has_a_compile_case():
    assert sorted(_compile_cases(torch.float32)) == PUBLIC_OPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", PUBLIC_OPS)
def test_every_public_op_traces_into_one_graph(name, dtype):
    fn, args = _compile_cases(dtype)[name]
    eager_args = [a.clone() for a in args]  # the accumulate_*_ ops write their first argument
    expected = torch.utils._pytree.tree_leaves(fn(*eager_args))
    traced = []  # the graph's outputs as traced: what the fake implementations said

    def aot_eager_recording(graph, example_inputs):
        output = next(node for node in graph.graph.nodes if node.op == "output")
        traced.extend(node.meta["example_value"] for node in torch.utils._pytree.tree_leaves(output.args))
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_eager_recording, fullgraph=True)
    compiled_args = [a.clone() for a in args]
    got = torch.utils._pytree.tree_leaves(compiled(*compiled_args))
    assert len(got) == len(expected) == len(traced)
    for g, e, fake in zip(got, expected, traced):
        assert (fake.shape, fake.dtype) == (e.shape, e.dtype), name
        assert g.dtype == e.dtype and torch.equal(g, e), name
    for g, e in zip(compiled_args, eager_args):
        assert torch.equal(g, e), name  # and the same in-place writes


def test_importing_pyprune_does_not_import_triton_kernels():
    code = "import sys, pyprune.ops; print(any(k.startswith('pyprune.ops.kernels.') for k in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYPRUNE_IMPLEMENTATION": ""})
    assert out.stdout.strip() == "False"
