"""OWL (Yin et al., 2024, "Outlier Weighed Layerwise sparsity"): a non-uniform sparsity per
decoder block around the target, from each block's share of outlier weights.

1. Outlier ratio (§3, "Layerwise Outlier Distribution"): D_l = the share of the Wanda scores
   |W_ij|·‖X_j‖₂ of all linear layers of block l together that exceed M × their mean. The inputs X
   are those of the dense model: the blocks run unpruned, one after the other.
2. Allocation (§4): blocks with more outliers keep more weights. As in the authors' code, the
   ratios are scaled linearly onto [0, 2λ] and centred, so that the block sparsities span 2λ
   and average to the target exactly: s_l = S − (2λ·(D_l − min D)/(max D − min D) − mean_l(·)).
   Equal ratios give the uniform target.

Paper settings (LLaMA, 70% sparsity): M = 5, λ = 0.08. The option ``owl`` of every unstructured
method (:class:`pyprune.methods.base.LayerSparsityMethod`) applies it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import Tensor, nn

from .. import ops
from ..runtime import distributed, engine


def new_sqnorms(linear: nn.Linear) -> Tensor:
    """A float64 accumulator of ``linear``'s input column sums of squares (:func:`add_sqnorms`)."""
    return torch.zeros(linear.in_features, dtype=torch.float64, device=linear.weight.device)


def add_sqnorms(acc: Tensor, x: Tensor) -> None:
    """``acc`` += Σ_tokens x_j², one batch's float32 sums added in float64, so that the total does not
    depend on how the batches are split over ranks (:mod:`pyprune.runtime.distributed`)."""
    acc += ops.accumulate_sqnorm_(torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device), x)


def outlier_ratio(linears: Dict[str, nn.Linear], sqnorms: Dict[str, Tensor], m: float) -> float:
    """D: the share of the Wanda scores of all ``linears`` together (``sqnorms``: each layer's
    input column sums of squares) above ``m`` × their mean."""
    total, count = 0.0, 0
    for name, linear in linears.items():
        total += float(ops.wanda_score(linear.weight.detach(), sqnorms[name]).double().sum())
        count += linear.weight.numel()
    threshold = m * total / count
    above = sum(int((ops.wanda_score(linear.weight.detach(), sqnorms[name]) > threshold).sum())
                for name, linear in linears.items())
    return above / count


@torch.no_grad()
def block_outlier_ratios(model: nn.Module, calib: Tensor, m: float, *, batch_size: int,
                         progress: bool) -> List[float]:
    """Every decoder block's outlier ratio D (:func:`outlier_ratio`) on the calibration tokens,
    the blocks run dense in turn (the model is not changed); in a process group, from the input
    statistics summed over the ranks."""

    def measure(ctx: engine.BlockContext) -> float:
        linears = ctx.linears()
        sqnorms = {name: new_sqnorms(linear) for name, linear in linears.items()}
        ctx.next_inputs = ctx.capture(lambda name, linear, x, y: add_sqnorms(sqnorms[name], x))
        return outlier_ratio(linears, {name: distributed.all_reduce_(acc).float() for name, acc in sqnorms.items()}, m)

    return engine.run_blockwise(model, calib, measure, batch_size=batch_size, progress=progress,
                                desc="owl outlier ratios")


def check_spread(target: float, lam: float, blocks: int) -> None:
    """ValueError where λ keeps no allocation of ``blocks`` blocks around ``target`` inside [0, 1),
    whatever their outlier ratios (unless all are equal): checked from the options and the block
    count alone, before a model loads. With s_l = S − (shift_l − mean shift), shift ∈ [0, 2λ] from the
    least to the most outlying block, the sparsities span 2λ, from S − 2λ + μ to S + μ, μ = mean shift
    ∈ [2λ/n, 2λ(n−1)/n] (one block at either end, the rest at the other): some μ fits iff
    2λ < 1, 2λ/n < 1 − S and 2λ/n ≤ S."""
    if lam == 0 or blocks < 2:
        return
    least = 2 * lam / blocks
    if 2 * lam < 1 and least < 1 - target and least <= target:
        return
    bound = min(0.5, blocks * (1 - target) / 2, blocks * target / 2)
    raise ValueError(f"option owl_lambda={lam} spreads the {blocks} block sparsities over 2 x {lam} around "
                     f"{target}, which leaves [0, 1) whatever the outlier ratios; give owl_lambda < {bound:.4g}")


def allocate(ratios: Sequence[float], target: float, lam: float) -> List[float]:
    """Block sparsities from the outlier ratios: ``target`` minus the ratios scaled onto [0, 2λ]
    and centred (their mean is ``target`` exactly, the most outlying block the least sparse);
    ValueError if one falls outside [0, 1)."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    spread = float(ratios.max() - ratios.min())
    if spread == 0.0:
        return [float(target)] * len(ratios)
    shift = 2 * lam * (ratios - ratios.min()) / spread
    sparsities = (target - (shift - shift.mean())).tolist()
    if min(sparsities) < 0 or max(sparsities) >= 1:
        raise ValueError(f"option owl_lambda={lam} spreads sparsity {target} over [{min(sparsities):.4f}, "
                         f"{max(sparsities):.4f}]; every block needs a sparsity in [0, 1): lower owl_lambda")
    return sparsities
