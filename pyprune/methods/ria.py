"""RIA (Zhang et al., ICLR 2024, "Plug-and-Play: An Efficient Post-training Pruning Method for
Large Language Models"): Relative Importance and Activations.

Score (Eq. 4): RIA_ij = (|W_ij| / Σ_k |W_kj| + |W_ij| / Σ_k |W_ik|) · (‖X_j‖₂)^a, a = 0.5: the
weight's share of its input channel's and of its output row's total magnitude, times the input
channel's activation norm to the power a. Compared within the layer (unstructured scope "tensor",
the authors' default; "row" is their ``--per_outneuron``) or n of every m; no weight update.

With ``channel_permutation`` (N:M only; §3.3, :mod:`pyprune.methods.channel_permutation`) the N:M
mask is chosen on the scores with the input channels permuted, and put back in place: the layer's
weights stay where they are, so the model computes what the masked weights compute, as the
authors apply it (``W_mask[:, index] = W_mask_permute``). Its weights are then N:M along the
permuted channels, ``permutations[name]`` (a layer's weight ``W[:, perm]``), not along the stored
order: a 2:4 kernel gathers the input ``x[..., perm]`` first. Permuting the stored columns instead
would need the producer's outputs permuted to match, which the residual stream, read through one
norm by several layers with different permutations, cannot give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from ..patterns import NM
from ..runtime import distributed
from .base import LayerwiseMaskMethod, apply_mask
from .channel_permutation import kept_score, nm_channel_permutation
from .options import block_checkpoint, nonnegative, option
from .owl import add_sqnorms, new_sqnorms


def ria_score(weight: Tensor, sqnorm: Tensor, power: float) -> Tensor:
    """RIA's score (Eq. 4) of ``weight`` [out, in] from its input columns' sums of squares ``sqnorm``
    (‖X_j‖₂ = sqrt(sqnorm_j)); a column or row of zeros contributes 0 for its relative term."""
    magnitude = weight.detach().float().abs()
    column_total = magnitude.sum(dim=0, keepdim=True)
    row_total = magnitude.sum(dim=1, keepdim=True)
    relative = (torch.where(column_total > 0, magnitude / column_total, 0.0)
                + torch.where(row_total > 0, magnitude / row_total, 0.0))
    return relative * sqnorm.double().sqrt().pow(power).float()


@dataclass
class _LayerNorms:
    """A layer's qualified name (the key of its permutation) and Σ_tokens x_j² of its inputs."""
    name: str
    sqnorm: Tensor


class RIA(LayerwiseMaskMethod):
    name = "ria"
    default_scope = "tensor"
    data_parallel = True

    activation_power: float = option(0.5, "RIA: the exponent a of the activation norm (paper: 0.5)", nonnegative)
    channel_permutation: bool = option(False, "RIA: permute each layer's input channels so that the N:M mask keeps "
                                       "more of the score (heuristic allocation + linear sum assignment; N:M "
                                       "patterns); the mask is applied in place")
    checkpoint: Optional[str] = block_checkpoint()

    def __init__(self, **values):
        super().__init__(**values)
        #: each layer's channel permutation (qualified name -> perm, ``W[:, perm]`` is N:M) of the last run
        self.permutations: Dict[str, Tensor] = {}
        self._gains = []

    def check(self, model, pattern):
        if self.channel_permutation and not isinstance(pattern, NM):
            raise ValueError(f"option channel_permutation of method 'ria' permutes input channels for an N:M "
                             f"pattern (e.g. 2:4); got pattern {pattern}")
        super().check(model, pattern)

    def new_stats(self, name, linear):
        return _LayerNorms(name, new_sqnorms(linear))

    def update(self, stats, x, y):
        add_sqnorms(stats.sqnorm, x)

    def reduce_stats(self, stats, dst):
        sqnorm = distributed.all_reduce_(stats.sqnorm) if dst is None else distributed.reduce_(stats.sqnorm, dst)
        return None if sqnorm is None else _LayerNorms(stats.name, sqnorm)

    def prune_layer(self, linear, stats, pattern):
        scores = ria_score(linear.weight, stats.sqnorm, self.activation_power)
        if not self.channel_permutation:
            apply_mask(linear, pattern.keep_mask(scores))
            return
        perm = nm_channel_permutation(scores, pattern.n, pattern.m)
        keep = torch.empty_like(scores, dtype=torch.bool)
        keep[:, perm] = pattern.keep_mask(scores[:, perm])
        apply_mask(linear, keep)
        self.permutations[stats.name] = perm.cpu()
        self._gains.append(kept_score(scores[:, perm], pattern.n, pattern.m) / kept_score(scores, pattern.n, pattern.m))

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        self.permutations, self._gains = {}, []
        report = super()._prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        if self.channel_permutation:
            report["channel_permutation"] = {
                "layers": len(self._gains),
                "kept_score_gain_mean": sum(self._gains) / len(self._gains) if self._gains else None}
        return report
