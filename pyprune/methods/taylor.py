"""LLM-Pruner-style Taylor structured pruning (Ma et al., 2023) of dense decoder blocks
(every family of :mod:`pyprune.nn.families`).

Importance is first order (LLM-Pruner / MoreauPruner Eq. 3): the gradient of the mean next-token
loss over the calibration tokens (:func:`pyprune.runtime.engine.loss_gradients`) times the weights,
``|W ⊙ ∇W|`` per element (:func:`pyprune.ops.taylor_score`). Grouping, the GQA rule, the layer
range and compaction are :mod:`pyprune.methods.structured`'s, shared with MoreauPruner.
"""
from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor, nn

from .. import ops
from .structured import StructuredMethod, gradients_for
from .structured import group_scores as _group_scores


def gradient_taylor_score(param: nn.Parameter) -> Optional[Tensor]:
    """|p ⊙ ∇p| (fp32) from ``param.grad``; None without a gradient."""
    if param is None or param.grad is None:
        return None
    return ops.taylor_score(param.detach(), param.grad.detach())


def group_scores(block: nn.Module) -> Dict[str, Tensor]:
    """Taylor importance of the coupled groups of ``block`` from the ``.grad`` of its weights
    (missing gradients count as zero); see :func:`pyprune.methods.structured.group_scores`."""
    return _group_scores(block, gradient_taylor_score)


class Taylor(StructuredMethod):
    """Taylor structured pruning of attention heads and MLP channels."""

    name = "taylor"

    def element_scores(self, model, params, calib, *, batch_size, progress):
        with gradients_for(model, params):
            grads = self.calibration_gradients(model, params, calib, batch_size=batch_size, progress=progress)
            return {id(p): ops.taylor_score(p.detach(), grad) for p, grad in zip(params, grads)}
