"""SAFE's per-step SAM kernels (spec §1.5–1.7, K4–K5) over all the tensors of a block at once: the
ascent x ← x + ρ·g/‖g‖ (anchoring x) and the penalised Adam step from the anchors; the ADMM dual
update that sets their ``vs``/``keeps`` is in :mod:`pyprune.ops.admm`.
"""
from typing import List

import torch
from torch import Tensor

from . import backend, reference
from . import _validate as check
from ._dispatch import kernels, native, run


def _triton_perturb(*args):
    return kernels("sam").sam_perturb_(*args, backend.triton_interpreted())


def _triton_step(*args):
    kernels("sam").sam_adam_step_(*args, backend.triton_interpreted())


_PERTURB_IMPLS = {"reference": reference.sam_perturb_, "triton": _triton_perturb,
                  "cpu": lambda *args: native("cpu").sam_perturb_(*args)}
_STEP_IMPLS = {"reference": reference.sam_adam_step_, "triton": _triton_step,
               "cpu": lambda *args: native("cpu").sam_adam_step_(*args)}


@torch.library.custom_op("pyprune::sam_perturb_", mutates_args=("params", "anchors"))
def _sam_perturb(params: List[Tensor], grads: List[Tensor], anchors: List[Tensor], rho: float) -> Tensor:
    return run("sam_perturb_", _PERTURB_IMPLS, params[0].device, params, grads, anchors, rho)


@_sam_perturb.register_fake
def _(params, grads, anchors, rho):
    return torch.empty((), dtype=torch.float32, device=params[0].device)


@torch.library.custom_op("pyprune::sam_adam_step_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _sam_adam_step(params: List[Tensor], grads: List[Tensor], anchors: List[Tensor], vs: List[Tensor],
                   keeps: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, lam: float, step: int) -> None:
    run("sam_adam_step_", _STEP_IMPLS, params[0].device, params, grads, anchors, vs, keeps, exp_avgs,
        exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, lam, step)


@_sam_adam_step.register_fake
def _(params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, lam, step):
    return None


def _tensor_lists(names, lists, dtypes=None):
    """Every list as long as the first, each tensor contiguous, of the first list's shapes, on one
    device; ``dtypes`` fixes a list's dtype (else fp32/fp16/bf16)."""
    dtypes = dtypes or {}
    first = lists[0]
    if not isinstance(first, (list, tuple)) or not first:
        raise ValueError(f"{names[0]} must be a non-empty list of tensors")
    for name, values in zip(names, lists):
        if not isinstance(values, (list, tuple)) or len(values) != len(first):
            raise ValueError(f"{name} must be a list of {len(first)} tensors, one per {names[0]} entry")
        for i, (value, reference_tensor) in enumerate(zip(values, first)):
            where = f"{name}[{i}]"
            if name in dtypes:
                check.dtype(where, value, dtypes[name])
            else:
                check.tensor(where, value)
            check.same_shape(where, value, reference_tensor.shape, f"{names[0]}[{i}]")
            check.contiguous(where, value)
            check.same_device(**{where: value, f"{names[0]}[0]": first[0]})


def sam_perturb_(params: List[Tensor], grads: List[Tensor], anchors: List[Tensor], rho: float) -> Tensor:
    """The SAM ascent over all ``params`` at once (spec §1.5, K4): anchor ← x (an exact copy, in x's
    dtype), then x ← x + rho·g/‖g‖₂ with ‖g‖₂ over every tensor (fp32; no move when it is 0).
    Returns ‖g‖₂ (fp32, 0-d). ``anchors`` then restore x in :func:`sam_adam_step_`.
    Kernels (this op and the next) cover all the tensors per launch: Triton one launch per kernel and dtype
    combination over a chunk table (kernels/sam.py), C++ one OpenMP loop over it (csrc/cpu/sam.cpp)."""
    _tensor_lists(("params", "grads", "anchors"), (params, grads, anchors))
    for i, (p, anchor) in enumerate(zip(params, anchors)):
        check.dtype(f"anchors[{i}]", anchor, p.dtype)
    rho = check.nonnegative("rho", check.finite("rho", rho))
    return _sam_perturb(list(params), list(grads), list(anchors), rho)


def sam_adam_step_(params: List[Tensor], grads: List[Tensor], anchors: List[Tensor], vs: List[Tensor],
                   keeps: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *, lr: float,
                   betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0, lam: float,
                   step: int) -> None:
    """SAFE's x-step (Eq. 5 with Adam, spec K5) for all ``params`` at once: x ← anchor (undo the
    SAM ascent), G = g_sam + lam·(x − z + u) at the unperturbed x with x − z + u = x + v⊙(1 −
    2·keep), x ← x·(1 − lr·weight_decay), then Adam on G with bias correction for ``step`` (≥ 1).
    Moments are fp32; each x is computed in fp32 and rounded once to its dtype."""
    _tensor_lists(("params", "grads", "anchors", "vs", "keeps", "exp_avgs", "exp_avg_sqs"),
                  (params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs),
                  {"vs": torch.float32, "keeps": torch.bool, "exp_avgs": torch.float32,
                   "exp_avg_sqs": torch.float32})
    for i, (p, anchor) in enumerate(zip(params, anchors)):
        check.dtype(f"anchors[{i}]", anchor, p.dtype)
    lr = check.nonnegative("lr", check.finite("lr", lr))
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be two numbers (beta1, beta2) in [0, 1); got {betas!r}")
    beta1, beta2 = (check.finite("betas", b) for b in betas)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be two numbers in [0, 1); got {tuple(betas)!r}")
    eps = check.finite("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps must be > 0; got {eps!r}")
    weight_decay = check.nonnegative("weight_decay", check.finite("weight_decay", weight_decay))
    lam = check.nonnegative("lam", check.finite("lam", lam))
    step = check.integer("step", step)
    if step < 1:
        raise ValueError(f"step must be >= 1 (Adam's bias correction counts from 1); got {step}")
    _sam_adam_step(list(params), list(grads), list(anchors), list(vs), list(keeps), list(exp_avgs),
                   list(exp_avg_sqs), lr, beta1, beta2, eps, weight_decay, lam, step)
