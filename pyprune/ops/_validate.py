"""Argument checks shared by the ops: each raises before any tensor is touched and names the
argument, what was given and what is allowed."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = "float32, float16, bfloat16"


def tensor(name: str, value, *, dims: Optional[Sequence[int]] = None, floating: bool = True,
           empty: bool = False) -> Tensor:
    """``value`` is a tensor (of a float dtype when ``floating``, of one of ``dims`` dimensions),
    with elements unless ``empty`` allows none."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if floating and value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}; got {value.dtype}")
    if dims is not None and value.dim() not in dims:
        allowed = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {allowed}; got shape {tuple(value.shape)}")
    if value.numel() == 0 and not empty:
        raise ValueError(f"{name} must not be empty; got shape {tuple(value.shape)}")
    return value


def same_device(**tensors: Optional[Tensor]) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"tensors must be on one device; got {listing}")


def same_shape(name: str, value: Tensor, shape, what: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {what} {tuple(shape)}; got {tuple(value.shape)}")


def column_vector(name: str, value: Optional[Tensor], columns: int) -> Optional[Tensor]:
    """A 1-D float tensor with one entry per column (e.g. act_sqnorm), or None."""
    if value is None:
        return None
    tensor(name, value, dims=(1,))
    if value.shape[0] != columns:
        raise ValueError(f"{name} must have one entry per input column ({columns}); got {value.shape[0]}")
    return value


def sums_of_squares(name: str, value: Optional[Tensor]) -> None:
    """Every entry of the activation statistic ``value`` (Σ x², e.g. act_sqnorm) is >= 0: a negative
    or NaN one is not a statistic (its square root would turn scores into NaN). Called by the ops'
    Python kernels, where the values are real also under torch.compile (the C++ kernels check it
    with csrc/cpu/checks.h's sums_of_squares, in the same words)."""
    if value is None:
        return
    bad = ~(value >= 0)
    if bool(bad.any()):
        column = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name} must be >= 0 (a sum of squares of activations); got {float(value[column])} "
                         f"at column {column}")


def nm_pair(n, m) -> None:
    for arg, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{arg} must be an int; got {type(v).__name__}")
    if not 1 <= n < m <= 32:
        raise ValueError(f"n and m must satisfy 1 <= n < m <= 32; got n={n}, m={m}")


def nm(n, m, last_dim: int, name: str = "scores") -> None:
    nm_pair(n, m)
    if last_dim % m != 0:
        raise ValueError(f"m={m} must divide the last dim of {name}; got {last_dim}")


def sparsity(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"sparsity must be a float in [0, 1); got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"sparsity must be in [0, 1); got {value}")
    return float(value)


def choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float >= 0; got {type(value).__name__}")
    if not value >= 0.0:
        raise ValueError(f"{name} must be a float >= 0; got {value}")
    return float(value)


def finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite float; got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float; got {value}")
    return float(value)


def integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    return value


def dim_index(name: str, value, ndim: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if not -ndim <= value < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim - 1}] for a {ndim}-D tensor; got {value}")
    return value % ndim


def index(name: str, value: Optional[Tensor], size: int, dim_name: str) -> Optional[Tensor]:
    """A 1-D int64 index tensor of distinct positions in [0, size)."""
    if value is None:
        return None
    index_type(name, value)
    index_values(name, value, size, dim_name)
    return value


def index_type(name: str, value: Optional[Tensor]) -> None:
    """The checks of :func:`index` that need no tensor values (so they also run while tracing)."""
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64; got {type(value).__name__}")
    if value.dtype not in (torch.int64, torch.int32) or value.dim() != 1 or value.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D int64/int32 tensor; got "
                         f"dtype {value.dtype}, shape {tuple(value.shape)}")


def index_values(name: str, value: Optional[Tensor], size: int, dim_name: str) -> None:
    """The checks of :func:`index` on its values: distinct positions in [0, size)."""
    if value is None:
        return
    if int(value.min()) < 0 or int(value.max()) >= size:
        raise ValueError(f"{name} must hold positions in [0, {size}) of {dim_name}; got "
                         f"values in [{int(value.min())}, {int(value.max())}]")
    if torch.unique(value).numel() != value.numel():
        raise ValueError(f"{name} must not repeat a position")


def dtype(name: str, value: Tensor, allowed: torch.dtype) -> None:
    if value.dtype != allowed:
        raise TypeError(f"{name} must have dtype {allowed}; got {value.dtype}")


def disjoint(written: Sequence[str], **tensors: Optional[Tensor]) -> None:
    """The tensors named in ``written`` (written in place) share no memory with any other tensor."""
    if torch.compiler.is_compiling():  # fake tensors have no addresses
        return
    spans = {}
    for name, value in tensors.items():
        if value is not None:
            extent = sum((size - 1) * abs(stride) for size, stride in zip(value.shape, value.stride()))
            spans[name] = (value.data_ptr(), value.data_ptr() + (extent + 1) * value.element_size())
    for name in written:
        if name not in spans:
            continue
        start, end = spans[name]
        for other, (other_start, other_end) in spans.items():
            if other != name and start < other_end and other_start < end:
                raise ValueError(f"{name} must not share memory with {other} (it is written in place)")


def contiguous(name: str, value: Tensor) -> None:
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def no_nan(name: str, value: Tensor) -> None:
    if bool(torch.isnan(value).any()):
        raise ValueError(f"{name} contains NaN; scores must be finite or ±inf")
