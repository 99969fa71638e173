"""Mask selection: exact top-k (per row or per tensor) and N:M, from given scores or fused with
the magnitude / Wanda score so the score tensor is never written.

Masks are bool, True = keep; among equal scores the lower index is kept; counts are exact.
"""
from typing import Optional

import torch
from torch import Tensor

from . import library, reference
from .conventions import ScoreKind, kept_count
from . import _validate as check
from .implementations import call
from .library import kernels, raise_on_nan_flag

_SCOPES = ("row", "tensor")


def _prepared(src: Tensor, act_sqnorm: Optional[Tensor]):
    """(src, act_sqnorm) as the Python kernels read them: the statistic checked (here, where its
    values are real also inside a torch.compile graph), fp32 and contiguous."""
    check.sums_of_squares("act_sqnorm", act_sqnorm)
    return src.contiguous(), None if act_sqnorm is None else act_sqnorm.float().contiguous()


def _reference_score(src: Tensor, act_sqnorm: Optional[Tensor], kind: int) -> Tensor:
    if kind == ScoreKind.GIVEN:
        scores = src.float()
    elif kind == ScoreKind.MAGNITUDE:
        scores = reference.magnitude_score(src)
    else:
        scores = reference.wanda_score(src, act_sqnorm)
    check.no_nan(_nan_subject(kind), scores)
    return scores


def _nan_subject(kind: int) -> str:
    return "scores" if kind == ScoreKind.GIVEN else "scores of w (and act_sqnorm)"


def _mask_fake(src, *args):
    return torch.empty(src.shape, dtype=torch.bool, device=src.device)


def _reference_nm(src, act_sqnorm, n, m, kind):
    src, act_sqnorm = _prepared(src, act_sqnorm)
    return reference.nm_mask(_reference_score(src, act_sqnorm, kind), n, m)


def _triton_nm(src, act_sqnorm, n, m, kind):
    mask, nan_flag = kernels("masks").nm_mask(*_prepared(src, act_sqnorm), n, m, kind)
    raise_on_nan_flag(nan_flag, _nan_subject(kind))
    return mask


_nm_mask = library.define("nm_mask(Tensor src, Tensor? act_sqnorm, int n, int m, int kind) -> Tensor",
                          reference=_reference_nm, triton=_triton_nm, fake=_mask_fake)


def _reference_topk(src, act_sqnorm, keep, per_row, kind):
    scores = _reference_score(*_prepared(src, act_sqnorm), kind)
    rows = scores.reshape(-1, scores.shape[-1]) if per_row else scores.reshape(1, -1)
    return reference.keep_top(rows, keep).reshape(scores.shape)


def _triton_topk(src, act_sqnorm, keep, per_row, kind):
    mask, nan_flag = kernels("masks").topk_mask(*_prepared(src, act_sqnorm), keep, per_row, kind)
    raise_on_nan_flag(nan_flag, _nan_subject(kind))
    return mask


_topk_mask = library.define(
    "topk_mask(Tensor src, Tensor? act_sqnorm, int keep, bool per_row, int kind) -> Tensor",
    reference=_reference_topk, triton=_triton_topk, fake=_mask_fake)


def _topk(src: Tensor, sparsity: float, scope: str, act_sqnorm: Optional[Tensor], kind: int) -> Tensor:
    sparsity = check.sparsity(sparsity)
    check.choice("scope", scope, _SCOPES)
    count = src.shape[-1] if scope == "row" else src.numel()
    if count >= 2 ** 32:
        raise ValueError(f"scope={scope!r} selects among {count} elements; at most 2**32 - 1 are supported")
    return call(_topk_mask, src, act_sqnorm, kept_count(count, sparsity), scope == "row", kind)


def topk_mask(scores: Tensor, sparsity: float, scope: str = "row") -> Tensor:
    """Keep exactly round((1 − sparsity)·count) highest scores per row (last dim) or per tensor."""
    check.tensor("scores", scores)
    return _topk(scores, sparsity, scope, None, ScoreKind.GIVEN)


def nm_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the n highest of every m consecutive scores along the last dim (any 1 <= n < m <= 32)."""
    check.tensor("scores", scores)
    check.nm(n, m, scores.shape[-1])
    return call(_nm_mask, scores, None, n, m, ScoreKind.GIVEN)


def _fused_args(w: Tensor, act_sqnorm: Optional[Tensor]):
    check.tensor("w", w, dims=(2,))
    check.column_vector("act_sqnorm", act_sqnorm, w.shape[1])
    check.same_device(w=w, act_sqnorm=act_sqnorm)
    return ScoreKind.MAGNITUDE if act_sqnorm is None else ScoreKind.WANDA


def score_nm_mask(w: Tensor, n: int, m: int, act_sqnorm: Optional[Tensor] = None) -> Tensor:
    """N:M mask of |W| (magnitude) or, with ``act_sqnorm``, of the Wanda score |W|·sqrt(Σx²),
    computed in one pass without writing the scores."""
    kind = _fused_args(w, act_sqnorm)
    check.nm(n, m, w.shape[1], name="w")
    return call(_nm_mask, w, act_sqnorm, n, m, kind)


def score_topk_mask(w: Tensor, sparsity: float, scope: str = "row",
                    act_sqnorm: Optional[Tensor] = None) -> Tensor:
    """Top-k mask of |W| or, with ``act_sqnorm``, of the Wanda score, without writing the scores."""
    kind = _fused_args(w, act_sqnorm)
    return _topk(w, sparsity, scope, act_sqnorm, kind)
