"""Per-element importance scores and the activation statistic they use (all fp32)."""

from typing import Optional

import torch
from torch import Tensor

from .. import reference
from . import _validate as check
from ._dispatch import kernels, run

_TAYLOR, _WANDA, _MAGNITUDE = 3, 2, 1


def _reference_score(src: Tensor, aux, kind: int) -> Tensor:
    if kind == _MAGNITUDE:
        return reference.magnitude_score(src)
    if kind == _WANDA:
        return reference.wanda_score(src, aux)
    return reference.taylor_score(src, aux)


_SCORE_IMPLS = {
    "reference": _reference_score,
    "triton": lambda src, aux, kind: kernels("scores").score(src, aux, kind),
}


@torch.library.custom_op("pyprune::score", mutates_args=())
def _score(src: Tensor, aux: Optional[Tensor], kind: int) -> Tensor:
    return run("score", _SCORE_IMPLS, src.device, src.contiguous(),
               None if aux is None else aux.contiguous(), kind)


@_score.register_fake
def _(src, aux, kind):
    return torch.empty(src.shape, dtype=torch.float32, device=src.device)


def magnitude_score(w: Tensor) -> Tensor:
    """|W| in fp32."""
    check.tensor("w", w)
    return _score(w, None, _MAGNITUDE)


def wanda_score(w: Tensor, act_sqnorm: Tensor) -> Tensor:
    """Wanda score |W_ij|·‖X_j‖₂ (Sun et al. 2023, Eq. 1) from the column sums of squares of X."""
    check.tensor("w", w, dims=(2,))
    check.column_vector("act_sqnorm", act_sqnorm, w.shape[1])
    check.same_device(w=w, act_sqnorm=act_sqnorm)
    return _score(w, act_sqnorm.float(), _WANDA)


def taylor_score(w: Tensor, grad: Tensor) -> Tensor:
    """First-order Taylor importance |W ⊙ ∇W| (LLM-Pruner Eq. 4), in fp32."""
    check.tensor("w", w)
    check.tensor("grad", grad)
    check.same_shape("grad", grad, w.shape, "w")
    check.same_device(w=w, grad=grad)
    return _score(w, grad, _TAYLOR)


_SQNORM_IMPLS = {
    "reference": reference.accumulate_sqnorm_,
    "triton": lambda acc, x: kernels("scores").accumulate_sqnorm_(acc, x),
}


@torch.library.custom_op("pyprune::accumulate_sqnorm_", mutates_args=("acc",))
def _accumulate_sqnorm(acc: Tensor, x: Tensor) -> None:
    run("accumulate_sqnorm_", _SQNORM_IMPLS, x.device, acc, x.reshape(-1, x.shape[-1]).contiguous())


def accumulate_sqnorm_(acc: Tensor, x: Tensor) -> Tensor:
    """acc[j] += Σ_tokens x[..., j]² (fp32 accumulator ``acc`` of shape [in]); returns acc.

    Feed it the inputs of a linear layer batch by batch to get Wanda's ‖X_j‖₂² statistic.
    """
    check.tensor("x", x)
    if not isinstance(acc, Tensor) or acc.dtype != torch.float32 or acc.dim() != 1:
        raise TypeError("acc must be a 1-D float32 tensor (statistics accumulate in fp32); got "
                        f"{acc.dtype if isinstance(acc, Tensor) else type(acc).__name__}")
    if acc.shape[0] != x.shape[-1]:
        raise ValueError(f"acc must have one entry per feature of x ({x.shape[-1]}); got {acc.shape[0]}")
    check.contiguous("acc", acc)
    check.same_device(acc=acc, x=x)
    _accumulate_sqnorm(acc, x)
    return acc
