"""The sparsity patterns a method can produce: one vocabulary for methods, the CLI and reports.

* :class:`Unstructured` — a fraction of the weights of each row (or whole tensor) is zero.
* :class:`NM` — n of every m consecutive weights along the input dim are kept (2:4, 4:8, ...).
* :class:`Structured` — a fraction of whole channels/heads is removed and the layers shrink.

``pattern.keep_mask(scores)`` turns per-weight scores into the exact keep mask of the pattern;
``pattern.weight_mask(w, act_sqnorm)`` does it for magnitude/Wanda scores in one fused op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor

from . import ops


@dataclass(frozen=True)
class Unstructured:
    """``scope`` is "row" (each output row keeps its share), "tensor" (each layer does), or None
    for the method's own default."""

    sparsity: float
    scope: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)) \
                or not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity must be a number in [0, 1); got {self.sparsity!r}")
        if self.scope not in (None, "row", "tensor"):
            raise ValueError(f"scope must be 'row' or 'tensor'; got {self.scope!r}")

    def keep_mask(self, scores: Tensor) -> Tensor:
        return ops.topk_mask(scores, self.sparsity, self.scope or "row")

    def weight_mask(self, w: Tensor, act_sqnorm: Optional[Tensor] = None) -> Tensor:
        """Mask of |W| (or of the Wanda score with ``act_sqnorm``), fused: no score tensor."""
        return ops.score_topk_mask(w, self.sparsity, self.scope or "row", act_sqnorm)

    @property
    def density(self) -> float:
        return 1.0 - self.sparsity

    def __str__(self) -> str:
        return f"unstructured {self.sparsity:g}"


def max_kept_per_group(weight: Tensor, m: int) -> int:
    """The largest number of nonzeros in any group of m consecutive weights along the last dim."""
    if weight.shape[-1] % m:
        raise ValueError(f"m={m} must divide the last dim of weight; got {weight.shape[-1]}")
    return int((weight.reshape(-1, m) != 0).sum(dim=1).max()) if weight.numel() else 0


@dataclass(frozen=True)
class NM:
    n: int
    m: int

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not isinstance(self.m, int) \
                or not 1 <= self.n < self.m <= 32:
            raise ValueError(f"pattern N:M needs integers 1 <= N < M <= 32; got {self.n}:{self.m}")

    def keep_mask(self, scores: Tensor) -> Tensor:
        return ops.nm_mask(scores, self.n, self.m)

    def weight_mask(self, w: Tensor, act_sqnorm: Optional[Tensor] = None) -> Tensor:
        """Mask of |W| (or of the Wanda score with ``act_sqnorm``), fused: no score tensor."""
        return ops.score_nm_mask(w, self.n, self.m, act_sqnorm)

    def fits(self, weight: Tensor) -> bool:
        """Whether ``weight`` already has this pattern: at most n nonzeros in every group of m
        along its last dim (which m must divide)."""
        return weight.shape[-1] % self.m == 0 and max_kept_per_group(weight, self.m) <= self.n

    def check_layer(self, name: str, in_features: int) -> None:
        if in_features % self.m:
            raise ValueError(f"pattern {self} needs M={self.m} to divide the input features of "
                             f"every pruned layer; {name} has {in_features}")

    @property
    def density(self) -> float:
        return self.n / self.m

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


@dataclass(frozen=True)
class Structured:
    ratio: float
    uniform: bool = False

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"structured ratio must be a number in [0, 1); got {self.ratio!r}")

    def __str__(self) -> str:
        return f"structured {self.ratio:g}" + (" uniform" if self.uniform else "")


Pattern = Union[Unstructured, NM, Structured]


def parse(spec: Union[str, float, Pattern]) -> Pattern:
    """``"2:4"`` -> NM(2, 4); ``0.5`` or ``"0.5"`` -> Unstructured(0.5); a Pattern passes through."""
    if isinstance(spec, (Unstructured, NM, Structured)):
        return spec
    if isinstance(spec, str) and ":" in spec:
        left, _, right = spec.partition(":")
        if not (left.strip().isdigit() and right.strip().isdigit()):
            raise ValueError(f"pattern must look like N:M (e.g. 2:4, 4:8) or be a sparsity in [0, 1); "
                             f"got {spec!r}")
        return NM(int(left), int(right))
    try:
        return Unstructured(float(spec))
    except (TypeError, ValueError):
        raise ValueError(f"pattern must look like N:M (e.g. 2:4, 4:8) or be a sparsity in [0, 1); "
                         f"got {spec!r}") from None


def written_as(kind: type, like: Pattern) -> str:
    """How a pattern of class ``kind`` is written in a ``pyprune.prune`` call, with the amount of
    ``like`` where it has one: the hint of a refused pattern (``Structured(0.2)``, ``0.2``, ``"2:4"``)."""
    amount = getattr(like, "sparsity", getattr(like, "ratio", 0.5))
    if kind is Structured:
        return f"Structured({amount:g})"
    if kind is Unstructured:
        return f"{amount:g}"
    return '"2:4"'
