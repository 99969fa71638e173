"""Which implementation runs a pyprune op: the list per op, and forcing one.

Every op is one schema with its implementations registered under it (:mod:`pyprune.ops.library`);
PyTorch's dispatcher picks one by the device of the tensors:

* CPU tensors:  ``cpu`` (``pyprune._C``, C++/OpenMP) where the op has one, else ``reference``;
* CUDA tensors: ``cuda`` (``pyprune._C_cuda``) > ``triton`` > ``reference``;
* any other device, or an extension that is not built: ``reference`` (pure PyTorch).

:data:`IMPLEMENTATIONS` lists, per op, the implementations the source tree has (tools and docs read
it; ``tests/ops/test_registration.py`` checks it against what is registered).

Forcing one — the context manager :func:`use_implementation` or the environment variable
``PYPRUNE_IMPLEMENTATION`` — makes every pyprune op run on it and raises ``RuntimeError`` where it
cannot (the op has no such implementation, or not for that device here), so a forced
implementation is never silently replaced. It works on the registered kernels: a dispatch mode
(:class:`~torch.utils._python_dispatch.TorchDispatchMode`, below autograd, so backward formulas
still apply) calls the forced op's Python kernel (reference, triton) directly, or lets the
dispatcher run the native kernel registered for the tensors' device (cpu, cuda). ``triton`` on CPU
tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported (how the tests run every kernel
without a GPU).

``use_backend``, ``BACKENDS`` and ``PYPRUNE_BACKEND`` are the former names; they still work, with a
DeprecationWarning, until the next release.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from typing import Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from . import library

#: Every implementation name: the pure-PyTorch reference, Triton, the native CPU and CUDA kernels.
NAMES = ("reference", "triton", "cpu", "cuda")

#: op -> the implementations it has, in this source tree (a native one runs where its extension is built).
IMPLEMENTATIONS = {
    "score": ("reference", "triton"),
    "accumulate_sqnorm_": ("reference", "triton"),
    "accumulate_abs_outer_": ("reference", "triton", "cpu"),
    "nm_mask": ("reference", "triton", "cpu", "cuda"),
    "topk_mask": ("reference", "triton", "cpu"),
    "soft_threshold": ("reference", "triton"),
    "group_soft_threshold": ("reference", "triton"),
    "moreau_perturb_": ("reference", "triton", "cpu"),
    "moreau_step_": ("reference", "triton", "cpu"),
    "nm_compress": ("reference", "triton"),
    "nm_decompress": ("reference", "triton", "cpu"),
    "nm_linear": ("reference", "triton", "cpu"),
    "sliced_linear": ("reference", "triton"),
    "sparse24_compress": ("reference", "cuda"),
    "sparse24_linear": ("reference", "cuda"),
    "channel_penalty_": ("reference", "triton", "cpu"),
    "admm_dual_update_": ("reference", "triton", "cpu"),
    "sam_perturb_": ("reference", "triton", "cpu"),
    "sam_adam_step_": ("reference", "triton", "cpu"),
}

_ENV = "PYPRUNE_IMPLEMENTATION"
_OLD_ENV = "PYPRUNE_BACKEND"
_UNSET = object()
_forced: contextvars.ContextVar = contextvars.ContextVar("pyprune_implementation", default=_UNSET)


def _check_name(name: str, where: str) -> str:
    if name not in NAMES:
        raise ValueError(f"{where} must be one of {', '.join(NAMES)}; got {name!r}")
    return name


def forced_implementation() -> Optional[str]:
    """The implementation forced by :func:`use_implementation` or ``PYPRUNE_IMPLEMENTATION``, or
    None for the dispatcher's choice."""
    name = _forced.get()
    if name is not _UNSET and name is not None:
        return name
    env = os.environ.get(_ENV, "").strip()
    if env:
        return _check_name(env, _ENV)
    old = os.environ.get(_OLD_ENV, "").strip()
    if old:
        warnings.warn(f"{_OLD_ENV} is deprecated; set {_ENV}", DeprecationWarning, stacklevel=2)
        return _check_name(old, _OLD_ENV)
    return None


def available(op: str, name: str, device: torch.device) -> bool:
    """Whether implementation ``name`` of ``op`` can run on ``device`` here."""
    if name not in IMPLEMENTATIONS[op]:
        return False
    if name == "reference":
        return True
    if name == "triton":
        return library.triton_available() and (device.type == "cuda" or library.triton_interpreted())
    return device.type == name and library.native(name) is not None


def _first_device(args) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0].device
    raise RuntimeError("a pyprune op without tensor arguments")  # every schema starts with tensors


def _real(args) -> bool:
    """Every tensor argument is a plain tensor holding data (not a fake, meta or other subclass)."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"
               for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


class _Forcing(TorchDispatchMode):
    """Runs each pyprune op on the forced implementation; every other op as it is."""

    #: higher-order operators (auto_functionalized around a mutating op, met while tracing, on
    #: fake tensors) run as they are
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = forced_implementation()
        if (name is None or isinstance(func, torch._ops.HigherOrderOperator)
                or func.namespace != library.NAMESPACE or not _real(args)):
            return func(*args, **kwargs)  # as it is (fake and meta tensors: to the op's fake kernel)
        op = func._schema.name.split("::", 1)[1]
        if name not in IMPLEMENTATIONS[op]:
            raise RuntimeError(f"pyprune op {op!r} has no {name!r} implementation "
                               f"(it has: {', '.join(IMPLEMENTATIONS[op])})")
        device = _first_device(args)
        if not available(op, name, device):
            raise RuntimeError(f"implementation {name!r} cannot run op {op!r} on {device.type} tensors here")
        if name in ("cpu", "cuda"):  # the native kernel the dispatcher has at this device's key
            return func(*args, **kwargs)
        return library.PYTHON_KERNELS[op][name](*args, **kwargs)


def _forcing_active() -> bool:
    return any(isinstance(mode, _Forcing) for mode in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def use_implementation(name: Optional[str]) -> Iterator[None]:
    """Run the pyprune ops inside the block (called through pyprune.ops or torch.ops.pyprune) on
    implementation ``name``; None restores the dispatcher's choice."""
    if name is not None:
        _check_name(name, "implementation")
    token = _forced.set(name)
    try:
        if name is None or _forcing_active():
            yield
        else:
            with _Forcing():
                yield
    finally:
        _forced.reset(token)


def call(op, *args):
    """``op(*args)`` for the public functions: under ``PYPRUNE_IMPLEMENTATION`` on the implementation
    it forces (:func:`use_implementation` has its own dispatch mode; torch.compile traces the op)."""
    if torch.compiler.is_compiling() or _forcing_active() or forced_implementation() is None:
        return op(*args)
    with _Forcing():
        return op(*args)


def use_backend(name: Optional[str]):
    """Deprecated name of :func:`use_implementation`."""
    warnings.warn("pyprune.ops.use_backend is deprecated; use pyprune.ops.use_implementation",
                  DeprecationWarning, stacklevel=2)
    if name is not None:
        _check_name(name, "backend")
    return use_implementation(name)
