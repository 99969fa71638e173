"""The compressed N:M format: values [rows, in·n/m] + meta (the keep mask packed 8 columns per
byte). decompress(compress(w, mask)) == w ⊙ mask exactly."""
from typing import Tuple

import torch
from torch import Tensor

from . import library, reference
from . import _validate as check
from .conventions import sparse24_mma_meta
from .implementations import call
from .library import kernels


def _check_groups(mask: Tensor, n: int, m: int) -> None:
    """Every group of the mask keeps n: checked in the kernels, where the mask's values are real
    also inside a torch.compile graph (the fake kernel cannot see them)."""
    kept = mask.reshape(-1, m).sum(dim=1)
    if not bool((kept == n).all()):
        bad = int((kept != n).nonzero()[0, 0])
        row, group = divmod(bad, mask.shape[1] // m)
        raise ValueError(f"mask must keep exactly n={n} of every m={m} elements; row {row}, group "
                         f"{group} keeps {int(kept[bad])}")


def _reference_compress(w, mask, n, m):
    _check_groups(mask, n, m)
    return reference.nm_compress(w.contiguous(), mask.contiguous(), n, m)


def _triton_compress(w, mask, n, m):
    _check_groups(mask, n, m)
    return kernels("nm_format").nm_compress(w.contiguous(), mask.contiguous(), n, m)


def _compress_fake(w, mask, n, m):
    values = w.new_empty(w.shape[0], w.shape[1] * n // m)
    return values, w.new_empty(w.shape[0], (w.shape[1] + 7) // 8, dtype=torch.uint8)


_nm_compress = library.define("nm_compress(Tensor w, Tensor mask, int n, int m) -> (Tensor, Tensor)",
                              reference=_reference_compress, triton=_triton_compress, fake=_compress_fake)


def nm_compress(w: Tensor, mask: Tensor, n: int, m: int) -> Tuple[Tensor, Tensor]:
    """(values [out, in·n/m], meta [out, ceil(in/8)] uint8) of ``w ⊙ mask``; ``mask`` must keep
    exactly n of every m consecutive elements of each row (as nm_mask returns)."""
    check.tensor("w", w, dims=(2,))
    check.nm(n, m, w.shape[1], name="w")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor; got {getattr(mask, 'dtype', type(mask).__name__)}")
    check.same_shape("mask", mask, w.shape, "w")
    check.same_device(w=w, mask=mask)
    return call(_nm_compress, w, mask, n, m)


def _reference_sparse24_compress(w, mask):
    _check_groups(mask, 2, 4)
    values, meta = reference.nm_compress(w.contiguous(), mask.contiguous(), 2, 4)
    return values, sparse24_mma_meta(meta, w.shape[1])


def _sparse24_compress_fake(w, mask):
    return w.new_empty(w.shape[0], w.shape[1] // 2), w.new_empty(w.shape[0], w.shape[1] // 16, dtype=torch.int16)


_sparse24_compress = library.define("sparse24_compress(Tensor w, Tensor mask) -> (Tensor, Tensor)",
                                    reference=_reference_sparse24_compress, fake=_sparse24_compress_fake)

#: The dtypes of the 2:4 sparse tensor-core form (mma.sp .f16/.bf16).
SPARSE24_DTYPES = (torch.float16, torch.bfloat16)


def sparse24_compress(w: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(values [out, in/2], mma_meta [out, in/16] int16) of ``w ⊙ mask`` for
    :func:`pyprune.ops.sparse24_linear`: ``mask`` keeps exactly 2 of every 4 consecutive elements
    of each row; values as :func:`nm_compress` gives them for 2:4, mma_meta as
    :func:`pyprune.ops.conventions.sparse24_mma_meta` builds it (one CUDA kernel on a GPU).
    fp16/bf16, in % 32 == 0."""
    check.tensor("w", w, dims=(2,))
    if w.dtype not in SPARSE24_DTYPES:
        raise TypeError(f"w must have dtype float16 or bfloat16; got {w.dtype}")
    if w.shape[1] % 32:
        raise ValueError(f"w must have a multiple of 32 columns; got {w.shape[1]}")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor; got {getattr(mask, 'dtype', type(mask).__name__)}")
    check.same_shape("mask", mask, w.shape, "w")
    check.same_device(w=w, mask=mask)
    return call(_sparse24_compress, w, mask)


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


def _decompress_fake(values, meta, n, m):
    return values.new_empty(values.shape[0], values.shape[1] // n * m)


_nm_decompress = library.define(
    "nm_decompress(Tensor values, Tensor meta, int n, int m) -> Tensor",
    reference=lambda values, meta, n, m: reference.nm_decompress(values.contiguous(), meta.contiguous(), n, m),
    triton=lambda values, meta, n, m: kernels("nm_format").nm_decompress(values.contiguous(),
                                                                        meta.contiguous(), n, m),
    fake=_decompress_fake)


def nm_decompress(values: Tensor, meta: Tensor, n: int, m: int) -> Tensor:
    """Dense ``w ⊙ mask`` [out, in] from the compressed form."""
    check_compressed(values, meta, n, m)
    return call(_nm_decompress, values, meta, n, m)
