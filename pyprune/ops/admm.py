"""SAFE's per-step kernels (spec §1.4–1.8, K4–K6): the ADMM dual update on the compact state and the
SAM ascent and penalised Adam step over all the tensors of a block at once.

The compact state (spec §1.8, derived identities): each constrained tensor keeps an fp32 ``v``
(= x + u at the last dual update) and a bool ``keep``; then z = v⊙keep, u = v⊙¬keep and
x − z + u = x + v⊙(1 − 2·keep), so z and u are never stored. Start with v = 0, keep = False.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .. import backend, reference
from ..conventions import kept_count
from . import _validate as check
from ._dispatch import kernels, native, raise_on_nan_flag, run

_SCOPES = ("row", "tensor")
_NAN_SUBJECT = "scores of v = x + u (and act_sqnorm)"


def _kept_count(v: Tensor, sparsity: float, scope: str) -> int:
    return kept_count(v.shape[1] if scope == "row" else v.numel(), sparsity)


def _triton_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    admm = kernels("admm")
    if m:
        residual, nan_flag = admm.dual_update_nm(v, keep, x, act_sqnorm, n, m)
    else:
        residual, nan_flag = admm.dual_update_topk(v, keep, x, act_sqnorm, _kept_count(v, sparsity, scope),
                                                   scope == "row")
    raise_on_nan_flag(nan_flag, _NAN_SUBJECT)
    return residual


def _native_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    if m:
        return native("cpu").admm_dual_update_nm(v, keep, x, act_sqnorm, n, m)
    return native("cpu").admm_dual_update_topk(v, keep, x, act_sqnorm, _kept_count(v, sparsity, scope),
                                               scope == "row")


def _reference_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    residual = reference.admm_dual_update_(v, keep, x, act_sqnorm, n, m, sparsity, scope)
    # the kernels meet NaN scores while selecting; the reference finds them afterwards, same error
    negative = act_sqnorm is not None and bool((act_sqnorm < 0).any())
    if negative or bool(torch.isnan(v).any()):
        raise ValueError(f"{_NAN_SUBJECT} contain NaN; scores must be finite or ±inf")
    return residual


_DUAL_IMPLS = {"reference": _reference_dual, "triton": _triton_dual, "cpu": _native_dual}


@torch.library.custom_op("pyprune::admm_dual_update_", mutates_args=("v", "keep"))
def _admm_dual_update(v: Tensor, keep: Tensor, x: Tensor, act_sqnorm: Optional[Tensor], n: int, m: int,
                      sparsity: float, scope: str) -> Tensor:
    act_sqnorm = None if act_sqnorm is None else act_sqnorm.float().contiguous()
    return run("admm_dual_update_", _DUAL_IMPLS, v.device, v, keep, x.contiguous(), act_sqnorm, n, m,
               sparsity, scope)


@_admm_dual_update.register_fake
def _(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    return torch.empty((), dtype=torch.float32, device=v.device)


def admm_dual_update_(v: Tensor, keep: Tensor, x: Tensor, *, sparsity: Optional[float] = None,
                      scope: str = "row", n: Optional[int] = None, m: Optional[int] = None,
                      act_sqnorm: Optional[Tensor] = None) -> Tensor:
    """SAFE's z-step and u-step (Algorithm 1, lines 4–10) in place on (v, keep).

    With u = v⊙¬keep: v ← x + u; keep ← the support of the projection of v onto the constraint:
    N:M (``n``, ``m``: the n largest of every m consecutive along the last dim) or top-k
    (``sparsity`` per ``scope`` "row" or "tensor"), scored by |v| (SAFE, Euclidean projection) or
    by |v|·sqrt(act_sqnorm) (SAFE⁺, P = diag(AᵀA), §1.6.2: P decides which entries are kept; kept
    entries keep their values). Ties and counts as :func:`pyprune.ops.score_topk_mask` /
    :func:`~pyprune.ops.score_nm_mask`. Returns ‖x − z‖² (fp32, 0-d) with the new z = v⊙keep.

    v: fp32 [out, in] contiguous; keep: bool, v's shape, contiguous; x: [out, in] fp32/fp16/bf16;
    act_sqnorm: fp32 [in] (Σ over tokens of x_j²) or None.

    Fused (C++ and Triton): N:M is one pass (update, score, select, write v and keep, residual);
    C++ top-k per row is one pass per row; top-k per tensor (and Triton's per row) is an update
    pass, the top-k masks' radix select over v, then one pass writing keep and the residual.
    """
    check.tensor("x", x, dims=(2,))
    check.tensor("v", v, dims=(2,))
    check.dtype("v", v, torch.float32)
    if not isinstance(keep, Tensor):
        raise TypeError(f"keep must be a torch.Tensor of bool; got {type(keep).__name__}")
    check.same_shape("v", v, x.shape, "x")
    check.contiguous("v", v)
    check.dtype("keep", keep, torch.bool)
    check.same_shape("keep", keep, x.shape, "x")
    check.contiguous("keep", keep)
    check.column_vector("act_sqnorm", act_sqnorm, x.shape[1])
    check.same_device(v=v, keep=keep, x=x, act_sqnorm=act_sqnorm)
    check.disjoint(("v", "keep"), v=v, keep=keep, x=x, act_sqnorm=act_sqnorm)
    if (n is None) != (m is None) or (n is None) == (sparsity is None):
        raise ValueError("give either sparsity (with scope) or both n and m; got "
                         f"sparsity={sparsity!r}, n={n!r}, m={m!r}")
    if m is not None:
        check.nm(n, m, x.shape[1], name="x")
        return _admm_dual_update(v, keep, x, act_sqnorm, n, m, 0.0, "row")
    sparsity = check.sparsity(sparsity)
    check.choice("scope", scope, _SCOPES)
    if (x.shape[1] if scope == "row" else x.numel()) >= 2 ** 32:
        raise ValueError(f"scope={scope!r} selects among {x.numel()} elements; at most 2**32 - 1 are supported")
    return _admm_dual_update(v, keep, x, act_sqnorm, 0, 0, sparsity, scope)


def _triton_perturb(*args):
    return kernels("sam").sam_perturb_(*args, backend.triton_interpreted())


def _triton_step(*args):
    kernels("sam").sam_adam_step_(*args, backend.triton_interpreted())


_PERTURB_IMPLS = {"reference": reference.sam_perturb_, "triton": _triton_perturb,
                  "cpu": lambda *args: native("cpu").sam_perturb(*args)}
_STEP_IMPLS = {"reference": reference.sam_adam_step_, "triton": _triton_step,
               "cpu": lambda *args: native("cpu").sam_adam_step(*args)}


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
