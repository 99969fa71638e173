"""Which implementation runs an op: the pure-PyTorch reference, a Triton kernel, or a native kernel.

Automatic choice, per call, by the device of the op's first tensor:

* CUDA tensors: ``cuda`` (the ``csrc/`` extension) > ``triton`` > ``reference``
* CPU tensors:  ``cpu`` (the ``csrc/`` C++/OpenMP extension) > ``reference``

A backend is chosen for an op only when it implements that op. Forcing one — the environment
variable ``PYPRUNE_BACKEND`` or the context manager :func:`use_backend` — makes every op run on it
and raises ``RuntimeError`` where it cannot (no implementation of that op, or wrong device), so a
forced backend is never silently replaced. ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``
set before Triton is imported (that is how the tests run every kernel without a GPU).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from functools import lru_cache
from typing import Callable, Dict, Iterator, Optional

import torch

BACKENDS = ("reference", "triton", "cuda", "cpu")
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pyprune_backend", default=None)


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def forced_backend() -> Optional[str]:
    """The backend forced by :func:`use_backend` or ``PYPRUNE_BACKEND``, or None for automatic."""
    name = _forced.get()
    if name is not None:
        return name
    env = os.environ.get("PYPRUNE_BACKEND", "").strip()
    return _check_name(env, "PYPRUNE_BACKEND") if env else None


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Run the ops inside the block on backend ``name`` (None restores automatic choice)."""
    if name is not None:
        _check_name(name, "backend")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=None)
def native_module(name: str):
    """The compiled extension ``pyprune._C`` (cpu) or ``pyprune._C_cuda`` (cuda), or None."""
    module = {"cpu": "pyprune._C", "cuda": "pyprune._C_cuda"}[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _usable(backend: str, device: torch.device) -> bool:
    if backend == "reference":
        return True
    if backend == "triton":
        return triton_available() and (device.type == "cuda" or triton_interpreted())
    if backend == "cpu":
        return device.type == "cpu" and native_module("cpu") is not None
    if backend == "cuda":
        return device.type == "cuda" and native_module("cuda") is not None
    return False


def select(op: str, impls: Dict[str, Callable], device: torch.device) -> Callable:
    """Pick the implementation of ``op`` (a dict backend -> callable) for tensors on ``device``."""
    forced = forced_backend()
    if forced is not None:
        if forced not in impls:
            raise RuntimeError(f"pyprune op {op!r} has no {forced!r} implementation "
                               f"(it has: {', '.join(sorted(impls))})")
        if not _usable(forced, device):
            raise RuntimeError(f"backend {forced!r} cannot run op {op!r} on {device.type} tensors here")
        return impls[forced]
    for backend in _AUTO_ORDER.get(device.type, ("reference",)):
        if backend in impls and _usable(backend, device):
            return impls[backend]
    return impls["reference"]
