"""The ``pyprune`` op library: each op's schema, declared once, and its implementations registered
under it with PyTorch's dispatcher, which then picks the one for the tensors' device.

The schemas live here, in Python (``torch.library.Library("pyprune", "DEF")``), and the native
extensions only register implementations under them (``TORCH_LIBRARY_IMPL(pyprune, CPU|CUDA, m)`` in
``csrc/*/library.cpp``): pyprune installs and runs without a compiler, so the one place that must
always load is the one that defines the ops; an extension that is absent then costs speed, never an
op. The dispatcher checks each C++ kernel's signature against the schema here when both are loaded.

Per op (:func:`define`):

* ``reference`` (pure PyTorch, :mod:`pyprune.ops.reference`) at ``CompositeExplicitAutograd``: the
  fallback for every device and every key without a kernel of its own;
* ``cpu`` / ``cuda``: the C++/OpenMP and CUDA kernels of ``pyprune._C`` / ``pyprune._C_cuda``,
  registered at the ``CPU`` / ``CUDA`` keys when the extension is imported (below, before any op is
  defined, so that :func:`define` sees which CUDA kernels exist);
* ``triton`` (``pyprune.ops.kernels``) at the ``CUDA`` key where no native CUDA kernel is;
* a fake kernel for torch.compile / meta tensors, and an autograd formula where the op has one.

Which implementations each op has, and forcing one, is :mod:`pyprune.ops.implementations`.
"""
from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

NAMESPACE = "pyprune"
LIB = torch.library.Library(NAMESPACE, "DEF")


def _import_native(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


#: The compiled extensions (None where not built); importing one registers its kernels.
_NATIVE = {"cpu": _import_native("pyprune._C"), "cuda": _import_native("pyprune._C_cuda")}

#: op name -> {"reference": fn, "triton": fn}: the Python kernels registered by :func:`define`,
#: which :mod:`pyprune.ops.implementations` calls directly when one is forced.
PYTHON_KERNELS: Dict[str, Dict[str, Callable]] = {}


def native(kind: str):
    """The extension module ``pyprune._C`` (``"cpu"``) or ``pyprune._C_cuda`` (``"cuda"``), or None
    where it is not built. Its plain functions are helpers (``cpu_isa``…); its ops are ``torch.ops.pyprune``."""
    return _NATIVE[kind]


def kernels(module: str):
    """``pyprune.ops.kernels.<module>`` (Triton), imported on first use so TRITON_INTERPRET can be set first."""
    return importlib.import_module(f"pyprune.ops.kernels.{module}")


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def has_kernel(name: str, key: str) -> bool:
    """Whether ``pyprune::name`` has a kernel registered at dispatch key ``key`` itself."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", key)


def define(schema: str, *, reference: Callable, fake: Callable, triton: Optional[Callable] = None):
    """Declare the op of ``schema`` and register its Python kernels; returns its OpOverload."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIB)
    PYTHON_KERNELS[name] = {"reference": reference}
    if triton is not None:
        PYTHON_KERNELS[name]["triton"] = triton
        if not has_kernel(name, "CUDA"):  # a native CUDA kernel, where built, is the faster one
            LIB.impl(name, triton, "CUDA")
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    torch.library.register_autograd(op, backward, setup_context=setup_context, lib=LIB)


def raise_on_nan_flag(nan_flag: Tensor, what: str) -> None:
    """Kernels set a device flag when they meet a NaN score; turn it into the same error as the
    reference implementation."""
    if int(nan_flag.item()) != 0:
        raise ValueError(f"{what} contain NaN; scores must be finite or ±inf")
