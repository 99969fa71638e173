"""Magnitude pruning: keep the largest |W| per row (or per layer), or n of every m."""
from __future__ import annotations

from ..runtime import engine
from ..patterns import NM, Unstructured
from .base import Method, apply_mask


class Magnitude(Method):
    name = "magnitude"
    patterns = (Unstructured, NM)
    needs_calibration = False
    offload_refusal = None

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        for _, block in engine.resident_blocks(model, write=True):
            for linear in engine.block_linears(block).values():
                apply_mask(linear, pattern.weight_mask(linear.weight))
        return {"scope": getattr(pattern, "scope", None)}
