"""SAFE's ADMM dual update (spec §1.4, §1.8, K6) on the compact state; the SAM ascent and the
penalised Adam step are in :mod:`pyprune.ops.sam`.

The compact state (spec §1.8, derived identities): each constrained tensor keeps an fp32 ``v``
(= x + u at the last dual update) and a bool ``keep``; then z = v⊙keep, u = v⊙¬keep and
x − z + u = x + v⊙(1 − 2·keep), so z and u are never stored. Start with v = 0, keep = False.
"""
from typing import Optional

import torch
from torch import Tensor

from . import reference
from .conventions import kept_count
from . import _validate as check
from ._dispatch import kernels, native, raise_on_nan_flag, run

_SCOPES = ("row", "tensor")
_NAN_SUBJECT = "scores of v = x + u (and act_sqnorm)"


def _kernel_args(v, n, m, sparsity, scope):
    """(n, m, keep_count, per_row) of the kernels' admm_dual_update_: m = 0 selects top-k."""
    keep_count = 0 if m else kept_count(v.shape[1] if scope == "row" else v.numel(), sparsity)
    return n, m, keep_count, scope == "row"


def _triton_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    residual, nan_flag = kernels("admm").admm_dual_update_(v, keep, x, act_sqnorm,
                                                           *_kernel_args(v, n, m, sparsity, scope))
    raise_on_nan_flag(nan_flag, _NAN_SUBJECT)
    return residual


def _native_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    return native("cpu").admm_dual_update_(v, keep, x, act_sqnorm, *_kernel_args(v, n, m, sparsity, scope))


def _reference_dual(v, keep, x, act_sqnorm, n, m, sparsity, scope):
    residual = reference.admm_dual_update_(v, keep, x, act_sqnorm, n, m, sparsity, scope)
    # the kernels meet NaN scores while selecting; the reference finds them afterwards, same error
    if bool(torch.isnan(v).any()):
        raise ValueError(f"{_NAN_SUBJECT} contain NaN; scores must be finite or ±inf")
    return residual


_DUAL_IMPLS = {"reference": _reference_dual, "triton": _triton_dual, "cpu": _native_dual}


@torch.library.custom_op("pyprune::admm_dual_update_", mutates_args=("v", "keep"))
def _admm_dual_update(v: Tensor, keep: Tensor, x: Tensor, act_sqnorm: Optional[Tensor], n: int, m: int,
                      sparsity: float, scope: str) -> Tensor:
    check.sums_of_squares("act_sqnorm", act_sqnorm)
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
