"""Magnitude pruning: keep the largest |W| per row (or per layer), or n of every m (MoE experts:
each expert matrix alone, :func:`pyprune.nn.experts.expert_linears`)."""
from __future__ import annotations

from ..nn.experts import expert_linears
from ..runtime import engine
from ..patterns import NM, Unstructured
from .base import LayerSparsityMethod, apply_mask


class Magnitude(LayerSparsityMethod):
    name = "magnitude"
    patterns = (Unstructured, NM)
    needs_calibration = False
    offload_refusal = None
    data_parallel = True  # the mask needs no data; OWL's statistics are reduced over the ranks

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        for index, block in engine.resident_blocks(model, write=True):
            block_pattern = self.block_pattern(pattern, index)
            with expert_linears(block):
                for linear in engine.block_linears(block).values():
                    apply_mask(linear, block_pattern.weight_mask(linear.weight))
        return {"scope": getattr(pattern, "scope", None)}
