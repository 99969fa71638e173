"""Glue between the public ops and the backends: lazy kernel imports and the NaN flag check."""
from __future__ import annotations

import importlib
from typing import Callable, Dict

import torch

from . import backend


def kernels(module: str):
    """``pyprune.ops.kernels.<module>``, imported on first use so TRITON_INTERPRET can be set first."""
    return importlib.import_module(f"pyprune.ops.kernels.{module}")


def native(name: str):
    return backend.native_module(name)


def run(op: str, impls: Dict[str, Callable], device: torch.device, *args):
    return backend.select(op, impls, device)(*args)


def raise_on_nan_flag(nan_flag: torch.Tensor, what: str) -> None:
    """Kernels set a device flag when they meet a NaN score; turn it into the same error as the
    reference path."""
    if int(nan_flag.item()) != 0:
        raise ValueError(f"{what} contain NaN; scores must be finite or ±inf")
