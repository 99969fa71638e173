"""Linear layers over pruned weights: from the compressed N:M form (any backend, or 2:4 on sparse
tensor cores), and over kept channels only."""
from typing import Optional

import torch
from torch import Tensor

from . import backend, reference
from .conventions import unpack_mask
from . import _validate as check
from ._dispatch import kernels, native, run
from .nm_format import _nm_decompress, check_compressed


def _flatten(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _empty_batch(x: Tensor, out_features: int) -> Optional[Tensor]:
    """The result for an x without rows ([0, in], [2, 0, in]), as F.linear gives it: empty, no
    kernel launched; None for any other x."""
    return x.new_empty(*x.shape[:-1], out_features) if x.numel() == 0 else None


def _triton_nm_linear(x, values, meta, n, m, bias):
    if m & (m - 1):  # the fused kernels read whole groups' bits, which needs a power-of-two m
        dense = kernels("nm_format").nm_decompress(values, meta, n, m)
        return torch.nn.functional.linear(x, dense, bias)
    return kernels("linear").nm_linear(x, values, meta, n, m, bias, backend.triton_interpreted())


#: x with at most this many rows takes the CPU kernel's direct GEMV (csrc/cpu/nm_linear.cpp: AVX-512
#: kernels read the weights once for all rows, AVX2 ones once per 8; which is faster than dense at a
#: given count depends on the CPU, so SparseLinear measures it, pyprune.nn.tuning).
CPU_GEMV_MAX_ROWS = 256
#: Larger x: W is decompressed this many bytes at a time (a block the allocator reuses, warm in
#: cache) and multiplied by BLAS, so no dense copy of W is ever allocated.
CPU_BLOCK_BYTES = 1 << 21


def _cpu_nm_linear(x, values, meta, n, m, bias):
    cpu = native("cpu")
    if x.shape[0] <= CPU_GEMV_MAX_ROWS:
        return cpu.nm_linear_gemv(x, values, meta, n, m, None if bias is None else bias.contiguous())
    n_out, row_bytes = values.shape[0], values.shape[1] // n * m * values.element_size()
    block = max(1, CPU_BLOCK_BYTES // row_bytes)
    out_t = x.new_empty(n_out, x.shape[0])
    for r0 in range(0, n_out, block):
        w = cpu.nm_decompress(values[r0:r0 + block], meta[r0:r0 + block], n, m)
        torch.mm(w, x.t(), out=out_t[r0:r0 + block])
    if bias is not None:
        out_t += bias[:, None]
    return out_t.t().contiguous()


_NM_LINEAR_IMPLS = {"reference": reference.nm_linear, "triton": _triton_nm_linear,
                    "cpu": _cpu_nm_linear}


@torch.library.custom_op("pyprune::nm_linear", mutates_args=())
def _nm_linear(x: Tensor, values: Tensor, meta: Tensor, n: int, m: int, bias: Optional[Tensor]) -> Tensor:
    empty = _empty_batch(x, values.shape[0])
    if empty is not None:
        return empty
    out = run("nm_linear", _NM_LINEAR_IMPLS, x.device, _flatten(x), values.contiguous(),
              meta.contiguous(), n, m, bias)
    return out.reshape(*x.shape[:-1], values.shape[0])


@_nm_linear.register_fake
def _(x, values, meta, n, m, bias):
    return x.new_empty(*x.shape[:-1], values.shape[0])


def _nm_linear_setup(ctx, inputs, output):
    x, values, meta, n, m, bias = inputs
    ctx.save_for_backward(x, values, meta)
    ctx.n, ctx.m, ctx.has_bias = n, m, bias is not None


def _nm_linear_backward(ctx, grad):
    """Gradients of x @ (W ⊙ mask)ᵀ + b: the mask is fixed, so values get the entries of gradᵀx at
    the kept positions (sparse fine-tuning keeps the pattern)."""
    x, values, meta = ctx.saved_tensors
    dense = _nm_decompress(values, meta, ctx.n, ctx.m)
    grad_x = grad_values = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad @ dense
    if ctx.needs_input_grad[1]:
        grad_w = _flatten(grad).t() @ _flatten(x)
        mask = unpack_mask(meta, dense.shape[1])
        grad_values = grad_w[mask].reshape(values.shape)
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias = _flatten(grad).sum(dim=0)
    return grad_x, grad_values, None, None, None, grad_bias


_nm_linear.register_autograd(_nm_linear_backward, setup_context=_nm_linear_setup)


def _check_x_and_bias(x: Tensor, weight: Tensor, weight_name: str, in_features: int,
                      bias: Optional[Tensor], out_features: int) -> None:
    check.tensor("x", x, empty=True)  # an empty batch is a batch, as for nn.Linear
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (its last holds the features); got a 0-D tensor")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and {weight_name} must have one dtype; got {x.dtype} and {weight.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x must have {in_features} features in its last dim; got {x.shape[-1]}")
    if bias is not None:
        check.tensor("bias", bias, dims=(1,))
        if bias.shape[0] != out_features or bias.dtype != x.dtype:
            raise ValueError(f"bias must be [{out_features}] of dtype {x.dtype}; got "
                             f"{tuple(bias.shape)} {bias.dtype}")
    check.same_device(x=x, **{weight_name: weight}, bias=bias)


def nm_linear(x: Tensor, values: Tensor, meta: Tensor, n: int, m: int,
              bias: Optional[Tensor] = None) -> Tensor:
    """x @ (W ⊙ mask)ᵀ + b, reading W from its compressed N:M form (nm_compress)."""
    check_compressed(values, meta, n, m)
    _check_x_and_bias(x, values, "values", values.shape[1] // n * m, bias, values.shape[0])
    return _nm_linear(x, values, meta, n, m, bias)


def nm_linear_prechecked(x: Tensor, values: Tensor, meta: Tensor, n: int, m: int,
                         bias: Optional[Tensor] = None) -> Tensor:
    """:func:`nm_linear` for a caller whose compressed form, bias and x's features are known valid
    (SparseLinear): a decode-size x on the CPU in plain eager inference goes straight to the C++
    GEMV, since Python's argument checks, backend choice and custom-op dispatch (~60 us) cost
    more than the GEMV of a small layer (~20 us for 576x576); anything else is :func:`nm_linear`."""
    if (x.device.type == "cpu" and x.dtype == values.dtype and 0 < x.numel() <= CPU_GEMV_MAX_ROWS * x.shape[-1]
            and _plain_eager_inference(x, values, bias) and backend.forced_backend() in (None, "cpu")
            and native("cpu") is not None):
        out = native("cpu").nm_linear_gemv(_flatten(x), values, meta, n, m, bias)
        return out.reshape(*x.shape[:-1], values.shape[0])
    return nm_linear(x, values, meta, n, m, bias)


def _plain_eager_inference(*tensors: Optional[Tensor]) -> bool:
    """No autograd, no torch.compile / export tracing, plain tensors or parameters (no fake tensor
    or other subclass)."""
    present = [t for t in tensors if t is not None]
    return (not torch.compiler.is_compiling()
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in present)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in present)))


_SPARSE24_IMPLS = {"reference": reference.sparse24_linear,
                   "cuda": lambda *args: native("cuda").sparse24_linear(*args)}
_SPARSE24_DTYPES = (torch.float16, torch.bfloat16)


@torch.library.custom_op("pyprune::sparse24_linear", mutates_args=())
def _sparse24_linear(x: Tensor, values: Tensor, mma_meta: Tensor, bias: Optional[Tensor]) -> Tensor:
    empty = _empty_batch(x, values.shape[0])
    if empty is not None:
        return empty
    out = run("sparse24_linear", _SPARSE24_IMPLS, x.device, _flatten(x), values.contiguous(),
              mma_meta.contiguous(), None if bias is None else bias.contiguous())
    return out.reshape(*x.shape[:-1], values.shape[0])


@_sparse24_linear.register_fake
def _(x, values, mma_meta, bias):
    return x.new_empty(*x.shape[:-1], values.shape[0])


def sparse24_linear(x: Tensor, values: Tensor, mma_meta: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x @ Wᵀ + b for a 2:4 sparse W on sparse tensor cores (CUDA mma.sp, sm80+; the reference on
    other devices). ``values`` [out, in/2] fp16/bf16 as :func:`pyprune.ops.nm_compress` gives them
    for 2:4, ``mma_meta`` [out, in/16] int16 as
    :func:`pyprune.ops.conventions.sparse24_mma_meta` builds it from nm_compress's meta; in % 32 == 0.
    Products and sums are fp32, the result is rounded once to x's dtype. Not differentiable."""
    check.tensor("values", values, dims=(2,))
    if values.dtype not in _SPARSE24_DTYPES:
        raise TypeError(f"values must have dtype float16 or bfloat16; got {values.dtype}")
    in_features = values.shape[1] * 2
    if in_features % 32:
        raise ValueError(f"values must be [out, in/2] with in a multiple of 32; got {values.shape[1]} "
                         f"columns (in = {in_features})")
    if not isinstance(mma_meta, Tensor) or mma_meta.dtype != torch.int16:
        raise TypeError("mma_meta must be an int16 tensor from sparse24_mma_meta; got "
                        f"{getattr(mma_meta, 'dtype', type(mma_meta).__name__)}")
    check.same_shape("mma_meta", mma_meta, (values.shape[0], in_features // 16), "[out, in/16]")
    _check_x_and_bias(x, values, "values", in_features, bias, values.shape[0])
    check.same_device(values=values, mma_meta=mma_meta)
    return _sparse24_linear(x, values, mma_meta, bias)


def _triton_sliced(x, w, bias, in_index, out_index):
    return kernels("linear").sliced_linear(x, w, bias, in_index, out_index, backend.triton_interpreted())


_SLICED_IMPLS = {"reference": reference.sliced_linear, "triton": _triton_sliced}


@torch.library.custom_op("pyprune::sliced_linear", mutates_args=())
def _sliced_linear(x: Tensor, w: Tensor, bias: Optional[Tensor], in_index: Optional[Tensor],
                   out_index: Optional[Tensor], check_indices: bool) -> Tensor:
    if check_indices:
        # Range and repeats depend on the index values, so they are checked here, where the
        # tensors are real also inside a torch.compile graph (SlicedLinear checks them once).
        check.index_values("in_index", in_index, w.shape[1], "w's input dim")
        check.index_values("out_index", out_index, w.shape[0], "w's output dim")
    n_out = w.shape[0] if out_index is None else out_index.numel()
    empty = _empty_batch(x, n_out)
    if empty is not None:
        return empty
    out = run("sliced_linear", _SLICED_IMPLS, x.device, _flatten(x), w.contiguous(), bias,
              in_index, out_index)
    return out.reshape(*x.shape[:-1], n_out)


@_sliced_linear.register_fake
def _(x, w, bias, in_index, out_index, check_indices):
    n_out = w.shape[0] if out_index is None else out_index.numel()
    return x.new_empty(*x.shape[:-1], n_out)


def _sliced_setup(ctx, inputs, output):
    x, w, bias, in_index, out_index, _ = inputs
    ctx.save_for_backward(x, w, in_index, out_index)
    ctx.has_bias = bias is not None


def _sliced_backward(ctx, grad):
    """Gradients flow to the kept block of w (and of the bias) only; the rest of w gets zeros."""
    x, w, in_index, out_index = ctx.saved_tensors
    rows = torch.arange(w.shape[0], device=w.device) if out_index is None else out_index
    cols = torch.arange(w.shape[1], device=w.device) if in_index is None else in_index
    grad_x = grad_w = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad @ w[rows][:, cols]
    if ctx.needs_input_grad[1]:
        grad_w = torch.zeros_like(w)
        grad_w[rows[:, None], cols[None, :]] = _flatten(grad).t() @ _flatten(x)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = w.new_zeros(w.shape[0])
        grad_bias[rows] = _flatten(grad).sum(dim=0)
    return grad_x, grad_w, grad_bias, None, None, None


_sliced_linear.register_autograd(_sliced_backward, setup_context=_sliced_setup)


def sliced_linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
                  in_index: Optional[Tensor] = None, out_index: Optional[Tensor] = None) -> Tensor:
    """x @ W[out_index][:, in_index]ᵀ + b[out_index] without building the sliced weight.

    ``x`` holds only the kept input channels, in ``in_index`` order ([..., len(in_index)]), as
    the output of a layer sliced by ``out_index`` does; the result has len(out_index) features.
    ``bias`` is the full [out] bias of ``w``.
    """
    check.tensor("w", w, dims=(2,))
    check.index_type("in_index", in_index)
    check.index_type("out_index", out_index)
    in_features = w.shape[1] if in_index is None else in_index.numel()
    _check_x_and_bias(x, w, "w", in_features, bias, w.shape[0])
    check.same_device(w=w, in_index=in_index, out_index=out_index)
    to_long = lambda index: None if index is None else index.long()  # noqa: E731
    return _sliced_linear(x, w, bias, to_long(in_index), to_long(out_index), True)
