"""Linear layers over pruned weights: from the compressed N:M form (any implementation, or 2:4 on
sparse tensor cores), and over kept channels only."""
from typing import Optional

import torch
from torch import Tensor

from . import library, reference
from .conventions import unpack_mask
from . import _validate as check
from .implementations import call
from .library import kernels
from .nm_format import SPARSE24_DTYPES, _nm_decompress, check_compressed


def _flatten(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _over_rows(x: Tensor, out_features: int, kernel, *args) -> Tensor:
    """``kernel(x as contiguous rows, *args)`` shaped [..., out_features]; for an x without rows
    ([0, in], [2, 0, in]) the empty result F.linear gives, no kernel launched."""
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    return kernel(_flatten(x), *args).reshape(*x.shape[:-1], out_features)


def _reference_nm_linear(x, values, meta, n, m, bias):
    return _over_rows(x, values.shape[0], reference.nm_linear, values.contiguous(), meta.contiguous(), n, m, bias)


def _triton_rows(x, values, meta, n, m, bias):
    if m & (m - 1):  # the fused kernels read whole groups' bits, which needs a power-of-two m
        dense = kernels("nm_format").nm_decompress(values, meta, n, m)
        return torch.nn.functional.linear(x, dense, bias)
    return kernels("linear").nm_linear(x, values, meta, n, m, bias, library.triton_interpreted())


def _triton_nm_linear(x, values, meta, n, m, bias):
    return _over_rows(x, values.shape[0], _triton_rows, values.contiguous(), meta.contiguous(), n, m, bias)


def _nm_linear_fake(x, values, meta, n, m, bias):
    return x.new_empty(*x.shape[:-1], values.shape[0])


_nm_linear = library.define(
    "nm_linear(Tensor x, Tensor values, Tensor meta, int n, int m, Tensor? bias) -> Tensor",
    reference=_reference_nm_linear, triton=_triton_nm_linear, fake=_nm_linear_fake)


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


library.register_autograd(_nm_linear, _nm_linear_backward, _nm_linear_setup)


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
    return call(_nm_linear, x, values, meta, n, m, bias)


def _reference_sparse24(x, values, mma_meta, bias):
    return _over_rows(x, values.shape[0], reference.sparse24_linear, values.contiguous(), mma_meta.contiguous(),
                      None if bias is None else bias.contiguous())


_sparse24_linear = library.define(
    "sparse24_linear(Tensor x, Tensor values, Tensor mma_meta, Tensor? bias) -> Tensor",
    reference=_reference_sparse24, fake=lambda x, values, mma_meta, bias: x.new_empty(*x.shape[:-1], values.shape[0]))


def sparse24_linear(x: Tensor, values: Tensor, mma_meta: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x @ Wᵀ + b for a 2:4 sparse W on sparse tensor cores (CUDA mma.sp, sm80+; the reference on
    other devices). ``values`` [out, in/2] fp16/bf16 as :func:`pyprune.ops.nm_compress` gives them
    for 2:4, ``mma_meta`` [out, in/16] int16 as
    :func:`pyprune.ops.conventions.sparse24_mma_meta` builds it from nm_compress's meta (or both
    from :func:`pyprune.ops.sparse24_compress`); in % 32 == 0.
    Products and sums are fp32, the result is rounded once to x's dtype. Not differentiable."""
    check.tensor("values", values, dims=(2,))
    if values.dtype not in SPARSE24_DTYPES:
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
    return call(_sparse24_linear, x, values, mma_meta, bias)


def _sliced_rows(kernel):
    """The sliced_linear kernel ``kernel`` behind the op's checks and shapes."""
    def run(x, w, bias, in_index, out_index, check_indices):
        if check_indices:
            # Range and repeats depend on the index values, so they are checked here, where the
            # tensors are real also inside a torch.compile graph (SlicedLinear checks them once).
            check.index_values("in_index", in_index, w.shape[1], "w's input dim")
            check.index_values("out_index", out_index, w.shape[0], "w's output dim")
        n_out = w.shape[0] if out_index is None else out_index.numel()
        return _over_rows(x, n_out, kernel, w.contiguous(), bias, in_index, out_index)
    return run


def _triton_sliced(x, w, bias, in_index, out_index):
    return kernels("linear").sliced_linear(x, w, bias, in_index, out_index, library.triton_interpreted())


def _sliced_fake(x, w, bias, in_index, out_index, check_indices):
    n_out = w.shape[0] if out_index is None else out_index.numel()
    return x.new_empty(*x.shape[:-1], n_out)


_sliced_linear = library.define(
    "sliced_linear(Tensor x, Tensor w, Tensor? bias, Tensor? in_index, Tensor? out_index, bool check_indices)"
    " -> Tensor", reference=_sliced_rows(reference.sliced_linear), triton=_sliced_rows(_triton_sliced),
    fake=_sliced_fake)


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


library.register_autograd(_sliced_linear, _sliced_backward, _sliced_setup)


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
    return call(_sliced_linear, x, w, bias, to_long(in_index), to_long(out_index), True)
