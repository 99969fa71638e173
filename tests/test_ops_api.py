"""The public op API: argument validation, backend choice, torch.compile tracing."""
import os
import subprocess
import sys

import pytest
import torch

from pyprune import backend, ops
from pyprune import reference as R

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
    (lambda: ops.group_soft_threshold(W, 1.0, group_dim=2), ValueError, "group_dim must be in"),
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
])
def test_bad_arguments_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
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


def test_forced_backend_is_strict():
    with ops.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="cannot run op 'nm_mask' on cpu"):
            ops.nm_mask(W, 2, 4)
    with ops.use_backend("cpu"):
        with pytest.raises(RuntimeError, match="has no 'cpu' implementation"):
            ops.soft_threshold(W, 0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        with ops.use_backend("fast"):
            pass


def test_reference_backend_and_automatic_choice_agree():
    scores = torch.randint(0, 3, (16, 64)).float()
    with ops.use_backend("reference"):
        forced = ops.nm_mask(scores, 2, 4)
    assert torch.equal(forced, ops.nm_mask(scores, 2, 4))


def test_environment_variable_selects_the_backend(monkeypatch):
    monkeypatch.setenv("PYPRUNE_BACKEND", "cuda")
    assert backend.forced_backend() == "cuda"
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run"):
        ops.nm_mask(W, 2, 4)
    monkeypatch.setenv("PYPRUNE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="PYPRUNE_BACKEND must be one of reference, triton, cuda, cpu"):
        ops.nm_mask(W, 2, 4)


def test_cpu_tensors_use_the_native_kernel_when_built():
    impls = {"reference": "ref", "cpu": "native"}
    chosen = backend.select("nm_mask", impls, torch.device("cpu"))
    assert chosen == ("native" if backend.native_module("cpu") is not None else "ref")


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


def test_importing_pyprune_does_not_import_triton_kernels():
    code = "import sys, pyprune.ops; print(any(k.startswith('pyprune.kernels.') for k in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYPRUNE_BACKEND": ""})
    assert out.stdout.strip() == "False"
