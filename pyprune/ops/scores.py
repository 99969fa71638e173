"""Per-element importance scores and the activation statistic they use (all fp32)."""

from typing import Optional

import torch
from torch import Tensor

from . import library, reference
from . import _validate as check
from .conventions import ScoreKind
from .implementations import call
from .library import kernels


def _prepared(src: Tensor, aux: Optional[Tensor], kind: int):
    """(src, aux) contiguous; a Wanda statistic checked here, where its values are real also
    inside a torch.compile graph."""
    if kind == ScoreKind.WANDA:
        check.sums_of_squares("act_sqnorm", aux)
    return src.contiguous(), None if aux is None else aux.contiguous()


def _reference_score(src: Tensor, aux: Optional[Tensor], kind: int) -> Tensor:
    src, aux = _prepared(src, aux, kind)
    if kind == ScoreKind.MAGNITUDE:
        return reference.magnitude_score(src)
    if kind == ScoreKind.WANDA:
        return reference.wanda_score(src, aux)
    return reference.taylor_score(src, aux)


def _triton_score(src: Tensor, aux: Optional[Tensor], kind: int) -> Tensor:
    return kernels("scores").score(*_prepared(src, aux, kind), kind)


def _score_fake(src, aux, kind):
    return torch.empty(src.shape, dtype=torch.float32, device=src.device)


_score = library.define("score(Tensor src, Tensor? aux, int kind) -> Tensor",
                        reference=_reference_score, triton=_triton_score, fake=_score_fake)


def magnitude_score(w: Tensor) -> Tensor:
    """|W| in fp32."""
    check.tensor("w", w)
    return call(_score, w, None, ScoreKind.MAGNITUDE)


def wanda_score(w: Tensor, act_sqnorm: Tensor) -> Tensor:
    """Wanda score |W_ij|·‖X_j‖₂ (Sun et al. 2023, Eq. 1) from the column sums of squares of X."""
    check.tensor("w", w, dims=(2,))
    check.column_vector("act_sqnorm", act_sqnorm, w.shape[1])
    check.same_device(w=w, act_sqnorm=act_sqnorm)
    return call(_score, w, act_sqnorm.float(), ScoreKind.WANDA)


def taylor_score(w: Tensor, grad: Tensor) -> Tensor:
    """First-order Taylor importance |W ⊙ ∇W| (LLM-Pruner Eq. 4), in fp32."""
    check.tensor("w", w)
    check.tensor("grad", grad)
    check.same_shape("grad", grad, w.shape, "w")
    check.same_device(w=w, grad=grad)
    return call(_score, w, grad, ScoreKind.TAYLOR)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _accumulate_fake(acc, *args):
    return None


def _reference_sqnorm(acc, x):
    reference.accumulate_sqnorm_(acc, _rows(x))


def _triton_sqnorm(acc, x):
    kernels("scores").accumulate_sqnorm_(acc, _rows(x))


_accumulate_sqnorm = library.define("accumulate_sqnorm_(Tensor(a!) acc, Tensor x) -> ()",
                                    reference=_reference_sqnorm, triton=_triton_sqnorm,
                                    fake=_accumulate_fake)


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
    call(_accumulate_sqnorm, acc, x)
    return acc


def _reference_abs_outer(acc, a, b, alpha):
    reference.accumulate_abs_outer_(acc, _rows(a), _rows(b), alpha)


def _triton_abs_outer(acc, a, b, alpha):
    kernels("scores").accumulate_abs_outer_(acc, _rows(a), _rows(b), alpha, library.triton_interpreted())


_accumulate_abs_outer = library.define(
    "accumulate_abs_outer_(Tensor(a!) acc, Tensor a, Tensor b, float alpha) -> ()",
    reference=_reference_abs_outer, triton=_triton_abs_outer, fake=_accumulate_fake)


def accumulate_abs_outer_(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """acc += alpha·|a|ᵀ|b|, summed over the tokens; returns acc.

    acc is a contiguous fp32 [M, D]; a [..., M] and b [..., D] share their leading (token) dims
    and may each be fp32/fp16/bf16. COPAL (Malla et al., Eqs. 10–11) accumulates its sensitivity
    G += 2·|DY|ᵀ|X| this way for a linear layer [M, D], with DY the output sensitivity and X the
    input, batch after batch. Products and sums are fp32; no |a| or |b| copy is made.
    """
    check.tensor("acc", acc, dims=(2,))
    check.dtype("acc", acc, torch.float32)
    check.contiguous("acc", acc)
    for name, x, features, what in (("a", a, acc.shape[0], "rows"), ("b", b, acc.shape[1], "columns")):
        check.tensor(name, x)
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"{name} must have acc's {features} {what} as its last dim; got shape "
                             f"{tuple(x.shape)}")
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"a and b must have the same leading (token) dims; got {tuple(a.shape[:-1])} "
                         f"and {tuple(b.shape[:-1])}")
    check.same_device(acc=acc, a=a, b=b)
    check.disjoint(("acc",), acc=acc, a=a, b=b)
    alpha = check.finite("alpha", alpha)
    call(_accumulate_abs_outer, acc, a, b, alpha)
    return acc
