"""DSnoT (Zhang et al., ICLR 2024, "Dynamic Sparse No Training"): a training-free refinement of a
one-shot mask by swaps that each keep a row's count of kept weights.

From each layer's calibration inputs: the expected reconstruction error of output row i,
ε_i = Σ_{j pruned} W_ij·E[x_j] (Eq. 3, summed over one calibration sequence as in the authors'
code), and the variance Var(x_j) of every input channel. Then, row by row in parallel, for at most
``dsnot_cycles`` cycles while |ε_i| > ``dsnot_threshold`` (Eq. 8):
- grow (Eq. 6): the pruned weight whose W_ij·E[x_j] / Var(x_j)^p is largest when ε_i > 0 (most
  negative when ε_i ≤ 0), each weight at most once, from the two ends of that order;
- prune (Eq. 7), unstructured: among the kept weights, those with W_ij·E[x_j] < 0 in rising Wanda
  score when ε_i ≥ 0, else those with W_ij·E[x_j] ≥ 0 in rising Wanda score, each at most once;
  N:M: the kept weight of the grown weight's group of m with the lowest initial score (a weight
  grown or pruned by a swap is not chosen again), and the swap is made only if ε keeps its sign;
- ε_i += W_prune·E[x_prune] − W_grow·E[x_grow]. A row stops for good at its first refused swap.
A row's kept count never changes, so the sparsity (and N:M) of the initial mask is kept exactly.

As the authors: the initial mask is the base method's score alone, compared per output row by
default (Wanda: |W|·‖X‖; SparseGPT: its saliency w² / [H⁻¹]²_jj, without its OBS weight update),
and by default only the attention's linears are refined (their ``--skip_layer mlp``), a layer
being of the attention when a part of its name holds "attn" or "attention". Every
:class:`MaskRefinement` method has the option ``dsnot``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..patterns import NM, Pattern, Unstructured
from ..runtime import distributed
from .base import LayerwiseMaskMethod, apply_mask
from .options import at_least_one, nonnegative, option

#: which layers DSnoT refines (the others keep the initial mask): the authors' --skip_layer
LAYERS = ("attention", "mlp", "all")


class InputMoments:
    """A layer's calibration inputs per channel, float64: Σx, Σx², Σ over sequences of the
    squared deviations from the sequence's mean, and the counts of tokens and sequences."""

    def __init__(self, columns: int, device):
        self.sums = torch.zeros(3, columns, dtype=torch.float64, device=device)
        self.counts = torch.zeros(2, dtype=torch.int64)  # tokens, sequences

    def add(self, x: Tensor) -> None:
        x = x.float()
        sequences = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() >= 3 else x[None]
        tokens = sequences.shape[0] * sequences.shape[1]
        total = sequences.sum(dim=1)  # [sequences, columns]
        squares = sequences.square().sum(dim=(0, 1)).double()
        self.sums[0] += total.sum(dim=0).double()
        self.sums[1] += squares
        self.sums[2] += squares - (total.double().square() / sequences.shape[1]).sum(dim=0)
        self.counts += torch.tensor([tokens, sequences.shape[0]])

    def reduced(self, dst: Optional[int]) -> Optional["InputMoments"]:
        self.counts = distributed.all_reduce_(self.counts)
        sums = distributed.all_reduce_(self.sums) if dst is None else distributed.reduce_(self.sums, dst)
        return None if sums is None else self

    @property
    def sqnorm(self) -> Tensor:
        """Σ_tokens x_j² (Wanda's ‖X_j‖₂²)."""
        return self.sums[1]

    @property
    def sequence_sum(self) -> Tensor:
        """E[x_j] summed over one calibration sequence: Σ_tokens x_j / sequences (the authors' units)."""
        return self.sums[0] / int(self.counts[1])

    @property
    def variance(self) -> Tensor:
        """The mean over tokens of the squared deviation from their sequence's mean (the authors'
        running combination of each sequence's population variance)."""
        return self.sums[2].clamp_min(0.0) / int(self.counts[0])


@dataclass
class _Refining:
    """A layer's statistics under DSnoT: the base method's, the input moments, and whether the
    layer is refined."""
    base: Any
    moments: InputMoments
    refined: bool


def is_attention(name: str) -> bool:
    """A linear of the attention: a part of its (qualified) name holds "attn" or "attention"."""
    return any("attn" in part or "attention" in part for part in name.lower().split("."))


class _Queue:
    """Per row, a list of column indices (padded) read from its two ends, each entry at most once."""

    def __init__(self, order: Tensor, length: Tensor):
        self.order, self.front, self.back = order, torch.zeros_like(length), length - 1

    @property
    def exhausted(self) -> Tensor:
        return self.front > self.back

    def take(self, from_back: Tensor) -> Tensor:
        slot = torch.where(from_back, self.back, self.front).clamp(0, self.order.shape[1] - 1)
        taken = self.order.gather(1, slot[:, None])[:, 0]
        self.back -= from_back.long()
        self.front += (~from_back).long()
        return taken


def _ascending(key: Tensor, members: Tensor) -> _Queue:
    """The ``members`` of every row in rising ``key`` (ties by column), as a queue."""
    order = torch.sort(torch.where(members, key, torch.inf), dim=1, stable=True).indices
    return _Queue(order, members.sum(dim=1))


def _prune_queue(keep: Tensor, effect: Tensor, wanda: Tensor) -> _Queue:
    """The kept weights of every row: those with effect < 0 in rising Wanda score, then those with
    effect ≥ 0 in falling Wanda score (so that the back of the queue is the lowest of them)."""
    by_score = torch.sort(torch.where(keep, wanda, torch.inf), dim=1, stable=True).indices
    count = keep.sum(dim=1, keepdim=True)
    position = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    inside = position < count
    columns = keep.shape[1]
    key = torch.where(inside & (effect.gather(1, by_score) < 0), position,
                      torch.where(inside, 2 * columns - position, 3 * columns + position))
    return _Queue(by_score.gather(1, torch.sort(key, dim=1).indices), count[:, 0])


@torch.no_grad()
def refine_mask(keep: Tensor, effect: Tensor, variance: Tensor, wanda: Tensor, initial: Tensor,
                nm: Optional[NM], *, cycles: int, threshold: float, var_power: float) -> Tensor:
    """DSnoT's swaps on the keep mask ``keep`` [out, in] (a new mask; each row's count unchanged).
    ``effect``: W_ij·E[x_j] per sequence; ``variance``: Var(x_j); ``wanda``: the Wanda scores that
    order the unstructured pruning; ``initial``: the initial scores that choose within an N:M group."""
    keep = keep.clone()
    effect = effect.double()
    rows = torch.arange(keep.shape[0], device=keep.device)
    error = (effect * ~keep).sum(dim=1)
    initial_sign = torch.sign(error)
    growth_key = effect / variance.double().clamp_min(torch.finfo(torch.float64).tiny).pow(var_power)
    grow_queue = _ascending(growth_key, ~keep)
    if nm is None:
        prune_queue = _prune_queue(keep, effect, wanda.double())
    else:
        choosable = torch.where(keep, initial.double(), torch.inf)
        group = torch.arange(nm.m, device=keep.device)
    active = torch.ones_like(error, dtype=torch.bool)
    for _ in range(cycles):
        active &= (error.abs() > threshold) & ~grow_queue.exhausted
        if nm is None:
            active &= ~prune_queue.exhausted
        if not bool(active.any()):
            break
        grow = grow_queue.take(error > 0)
        if nm is None:
            prune = prune_queue.take(error < 0)
        else:
            members = (grow - grow % nm.m)[:, None] + group
            lowest, within = choosable.gather(1, members).min(dim=1)
            prune = members.gather(1, within[:, None])[:, 0]
            active &= torch.isfinite(lowest)
        after = error + effect[rows, prune] - effect[rows, grow]
        if nm is not None:
            active &= torch.sign(after) == initial_sign
            choosable[rows, prune] = torch.inf
        swapped = rows[active]
        keep[swapped, prune[active]] = False
        keep[swapped, grow[active]] = True
        error = torch.where(active, after, error)
    return keep


class MaskRefinement(LayerwiseMaskMethod):
    """A layer-wise mask method that DSnoT can refine (option ``dsnot``): it gives its initial
    scores (:meth:`mask_scores`); with ``dsnot`` the layer's mask is the refined mask of those
    scores, the weights otherwise unchanged."""

    dsnot: bool = option(False, "DSnoT: refine the mask by error-driven grow/prune swaps that keep each row's count "
                         "(training-free; the weights are masked, not updated)")
    dsnot_cycles: int = option(50, "DSnoT: most swap cycles per row (authors: 50)", at_least_one)
    dsnot_threshold: float = option(0.1, "DSnoT: a row stops when its expected error, summed over one calibration "
                                    "sequence, is within this (authors: 0.1)", nonnegative)
    dsnot_var_power: float = option(1.0, "DSnoT: growth criterion divides by Var(x_j) to this power (authors: 1)",
                                    nonnegative)
    dsnot_layers: str = option("attention", "DSnoT: the layers refined, the others keep the initial mask "
                               "(authors: attention, --skip_layer mlp)", choices=LAYERS)

    def mask_scores(self, linear: nn.Linear, stats) -> Tensor:
        """The initial scores of ``linear``'s weights from the method's statistics (higher is kept)."""
        raise NotImplementedError(f"method {self.name!r} gives no initial scores for DSnoT")

    def resolve(self, pattern: Pattern) -> Pattern:
        """With ``dsnot``, an unstructured pattern without a scope compares per row, as the authors."""
        if self.dsnot and isinstance(pattern, Unstructured) and pattern.scope is None:
            return Unstructured(pattern.sparsity, "row")
        return super().resolve(pattern)

    def _refines(self, name: str) -> bool:
        return self.dsnot_layers == "all" or is_attention(name) == (self.dsnot_layers == "attention")

    def layer_statistics(self, name, linear):
        base = self.new_stats(name, linear)
        if not self.dsnot:
            return base
        return _Refining(base, InputMoments(linear.in_features, linear.weight.device), self._refines(name))

    def observe(self, stats, x, y):
        if not self.dsnot:
            return self.update(stats, x, y)
        self.update(stats.base, x, y)
        stats.moments.add(x)

    def reduce_layer(self, stats, dst):
        if not self.dsnot:
            return self.reduce_stats(stats, dst)
        base = self.reduce_stats(stats.base, dst)
        moments = stats.moments.reduced(dst)
        return None if base is None else _Refining(base, moments, stats.refined)

    def prune_from(self, linear, stats, pattern):
        if not self.dsnot:
            return self.prune_layer(linear, stats, pattern)
        scores = self.mask_scores(linear, stats.base)
        keep = pattern.keep_mask(scores)
        if stats.refined:
            moments = stats.moments
            weight = linear.weight.detach().double()
            keep = refine_mask(keep, weight * moments.sequence_sum, moments.variance,
                               ops.wanda_score(linear.weight.detach(), moments.sqnorm.float()), scores,
                               pattern if isinstance(pattern, NM) else None, cycles=self.dsnot_cycles,
                               threshold=self.dsnot_threshold, var_power=self.dsnot_var_power)
        apply_mask(linear, keep)
