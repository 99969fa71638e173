"""SAFE's ADMM dual update (spec §1.4, §1.8, K6) on the compact state; the SAM ascent and the
penalised Adam step are in :mod:`pyprune.ops.sam`.

The compact state (spec §1.8, derived identities): each constrained tensor keeps an fp32 ``v``
(= x + u at the last dual update) and a bool ``keep``; then z = v⊙keep, u = v⊙¬keep and
x − z + u = x + v⊙(1 − 2·keep), so z and u are never stored. Start with v = 0, keep = False.
"""
from typing import Optional

import torch
from torch import Tensor

from . import library, reference
from .conventions import kept_count
from . import _validate as check
from .implementations import call
from .library import kernels, raise_on_nan_flag

_SCOPES = ("row", "tensor")
_NAN_SUBJECT = "scores of v = x + u (and act_sqnorm)"


def _prepared(x, act_sqnorm):
    """(x, act_sqnorm) as the Python kernels read them: the statistic checked (here, where its
    values are real also inside a torch.compile graph), fp32 and contiguous."""
    check.sums_of_squares("act_sqnorm", act_sqnorm)
    return x.contiguous(), None if act_sqnorm is None else act_sqnorm.float().contiguous()


def _triton_dual(v, keep, x, act_sqnorm, n, m, keep_count, per_row):
    residual, nan_flag = kernels("admm").admm_dual_update_(v, keep, *_prepared(x, act_sqnorm), n, m,
                                                           keep_count, per_row)
    raise_on_nan_flag(nan_flag, _NAN_SUBJECT)
    return residual


def _reference_dual(v, keep, x, act_sqnorm, n, m, keep_count, per_row):
    x, act_sqnorm = _prepared(x, act_sqnorm)
    v.mul_(~keep).add_(x.float())
    if m:
        keep.copy_(reference.score_nm_mask(v, n, m, act_sqnorm))
    else:
        scores = reference.wanda_score(v, act_sqnorm) if act_sqnorm is not None else reference.magnitude_score(v)
        rows = scores if per_row else scores.reshape(1, -1)
        keep.copy_(reference.keep_top(rows, keep_count).reshape(v.shape))
    # the kernels meet NaN scores while selecting; the reference finds them afterwards, same error
    if bool(torch.isnan(v).any()):
        raise ValueError(f"{_NAN_SUBJECT} contain NaN; scores must be finite or ±inf")
    return (x.float() - v * keep).square().sum()


_admm_dual_update = library.define(
    "admm_dual_update_(Tensor(a!) v, Tensor(b!) keep, Tensor x, Tensor? act_sqnorm, int n, int m, "
    "int keep_count, bool per_row) -> Tensor",
    reference=_reference_dual, triton=_triton_dual,
    fake=lambda v, *args: torch.empty((), dtype=torch.float32, device=v.device))


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
        return call(_admm_dual_update, v, keep, x, act_sqnorm, n, m, 0, True)
    sparsity = check.sparsity(sparsity)
    check.choice("scope", scope, _SCOPES)
    if (x.shape[1] if scope == "row" else x.numel()) >= 2 ** 32:
        raise ValueError(f"scope={scope!r} selects among {x.numel()} elements; at most 2**32 - 1 are supported")
    count = x.shape[1] if scope == "row" else x.numel()
    return call(_admm_dual_update, v, keep, x, act_sqnorm, 0, 0, kept_count(count, sparsity), scope == "row")
