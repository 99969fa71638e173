"""The compressed N:M format: values [rows, in·n/m] + meta (the keep mask packed 8 columns per
byte). decompress(compress(w, mask)) == w ⊙ mask exactly."""
from typing import Tuple

import torch
from torch import Tensor

from . import reference
from . import _validate as check
from ._dispatch import kernels, native, run

_COMPRESS_IMPLS = {
    "reference": reference.nm_compress,
    "triton": lambda w, mask, n, m: kernels("nm_format").nm_compress(w, mask, n, m),
}


@torch.library.custom_op("pyprune::nm_compress", mutates_args=())
def _nm_compress(w: Tensor, mask: Tensor, n: int, m: int) -> Tuple[Tensor, Tensor]:
    # The mask's group counts depend on its values, so they are checked here, where the tensors
    # are real also inside a torch.compile graph (the fake implementation cannot see them).
    kept = mask.reshape(-1, m).sum(dim=1)
    if not bool((kept == n).all()):
        bad = int((kept != n).nonzero()[0, 0])
        row, group = divmod(bad, w.shape[1] // m)
        raise ValueError(f"mask must keep exactly n={n} of every m={m} elements; row {row}, group "
                         f"{group} keeps {int(kept[bad])}")
    return run("nm_compress", _COMPRESS_IMPLS, w.device, w.contiguous(), mask.contiguous(), n, m)


@_nm_compress.register_fake
def _(w, mask, n, m):
    values = w.new_empty(w.shape[0], w.shape[1] * n // m)
    return values, w.new_empty(w.shape[0], (w.shape[1] + 7) // 8, dtype=torch.uint8)


def nm_compress(w: Tensor, mask: Tensor, n: int, m: int) -> Tuple[Tensor, Tensor]:
    """(values [out, in·n/m], meta [out, ceil(in/8)] uint8) of ``w ⊙ mask``; ``mask`` must keep
    exactly n of every m consecutive elements of each row (as nm_mask returns)."""
    check.tensor("w", w, dims=(2,))
    check.nm(n, m, w.shape[1], name="w")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor; got {getattr(mask, 'dtype', type(mask).__name__)}")
    check.same_shape("mask", mask, w.shape, "w")
    check.same_device(w=w, mask=mask)
    return _nm_compress(w, mask, n, m)


def check_compressed(values: Tensor, meta: Tensor, n: int, m: int) -> None:
    """Validate a (values, meta) pair as produced by nm_compress for n:m."""
    check.tensor("values", values, dims=(2,))
    if not isinstance(meta, Tensor) or meta.dtype != torch.uint8 or meta.dim() != 2:
        raise TypeError(f"meta must be a 2-D uint8 tensor from nm_compress; got "
                        f"{getattr(meta, 'dtype', type(meta).__name__)}")
    check.nm_pair(n, m)
    if values.shape[1] % n != 0:
        raise ValueError(f"values must have a multiple of n={n} columns; got {values.shape[1]}")
    cols = values.shape[1] // n * m
    expected = (values.shape[0], (cols + 7) // 8)
    if tuple(meta.shape) != expected:
        raise ValueError(f"meta must have shape {expected} for values {tuple(values.shape)} at "
                         f"{n}:{m}; got {tuple(meta.shape)}")
    check.same_device(values=values, meta=meta)


_DECOMPRESS_IMPLS = {
    "reference": reference.nm_decompress,
    "cpu": lambda values, meta, n, m: native("cpu").nm_decompress(values, meta, n, m),
    "triton": lambda values, meta, n, m: kernels("nm_format").nm_decompress(values, meta, n, m),
}


@torch.library.custom_op("pyprune::nm_decompress", mutates_args=())
def _nm_decompress(values: Tensor, meta: Tensor, n: int, m: int) -> Tensor:
    return run("nm_decompress", _DECOMPRESS_IMPLS, values.device, values.contiguous(),
               meta.contiguous(), n, m)


@_nm_decompress.register_fake
def _(values, meta, n, m):
    return values.new_empty(values.shape[0], values.shape[1] // n * m)


def nm_decompress(values: Tensor, meta: Tensor, n: int, m: int) -> Tensor:
    """Dense ``w ⊙ mask`` [out, in] from the compressed form."""
    check_compressed(values, meta, n, m)
    return _nm_decompress(values, meta, n, m)
