"""Wanda (Sun et al., 2023): score |W_ij|·‖X_j‖₂ from each layer's calibration inputs, compared
within each output row (or n of every m); no weight update. With ``dsnot``, DSnoT refines the mask
(:mod:`pyprune.methods.dsnot`)."""
from __future__ import annotations

from typing import Optional

from .. import ops
from .base import apply_mask
from .dsnot import MaskRefinement
from .owl import add_sqnorms, new_sqnorms
from .options import block_checkpoint


class Wanda(MaskRefinement):
    name = "wanda"
    can_accumulate = True  # Σ‖x_j‖² sums over datasets as over batches
    data_parallel = True
    commands = ("prune", "continual")
    checkpoint: Optional[str] = block_checkpoint()

    def new_stats(self, name, linear):
        return new_sqnorms(linear)

    def update(self, stats, x, y):
        add_sqnorms(stats, x)

    def prune_layer(self, linear, stats, pattern):
        apply_mask(linear, pattern.weight_mask(linear.weight, stats.float()))

    def mask_scores(self, linear, stats):
        return ops.wanda_score(linear.weight.detach(), stats.float())
