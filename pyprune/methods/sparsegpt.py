"""SparseGPT (Frantar & Alistarh, 2023): one-shot pruning with an approximate OBS weight update.

Per linear layer, with H = (2/N) Σ x xᵀ over the N calibration tokens:
1. dampen H += λ·mean(diag H)·I (dead inputs get H_jj = 1 and W_:j = 0), take the upper Cholesky
   factor of H⁻¹;
2. sweep the input columns in blocks of ``blocksize``; at the start of a block (unstructured) or
   of every group of m columns (N:M) select the mask from w² / [H⁻¹]_jj² with the pattern's exact
   selection; for each column, zero the pruned weights and spread the error (w − q)/[H⁻¹]_jj over
   the remaining columns of the block along row j of the Cholesky factor; then update the columns
   after the block with the block's accumulated errors (lazy batch update).

Unstructured masks are chosen inside each column block: scope "tensor" (the paper's choice, the
default) keeps exactly the block's share over all its rows, scope "row" keeps it per row.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..nn.experts import expert_linears
from ..runtime import engine
from ..patterns import NM, Pattern
from .base import LayerwiseMaskMethod
from .options import at_least_one, block_checkpoint, fraction, option


class _Hessian:
    def __init__(self, columns: int, device):
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        total = self.tokens + x.shape[0]
        self.H.mul_(self.tokens / total)
        self.H.addmm_(x.T, x, alpha=2.0 / total)
        self.tokens = total


class SparseGPT(LayerwiseMaskMethod):
    name = "sparsegpt"
    default_scope = "tensor"
    can_accumulate = True  # H is the mean of 2·x xᵀ over every token seen, of every dataset
    commands = ("prune", "continual")

    blocksize: int = option(128, "SparseGPT: columns per lazy-update block", at_least_one)
    percdamp: float = option(0.01, "SparseGPT: Hessian dampening, a fraction of mean(diag H)", fraction)
    checkpoint: Optional[str] = block_checkpoint()

    def working_bytes(self, block):
        """Every layer's fp32 Hessian (all are filled in one pass over the block), and for the
        largest layer an fp32 copy of W with its swept block and H⁻¹ with its Cholesky factor (an MoE's
        expert matrices each a layer)."""
        with expert_linears(block, strict=False):
            linears = list(engine.block_linears(block).values())
        hessians = sum(4 * linear.in_features ** 2 for linear in linears)
        return hessians + max(8 * linear.weight.numel() + 8 * linear.in_features ** 2 for linear in linears)

    def new_stats(self, name, linear):
        return _Hessian(linear.in_features, linear.weight.device)

    def update(self, stats, x, y):
        stats.add(x)

    def _inverse_cholesky(self, H: Tensor, W: Tensor) -> Tensor:
        dead = torch.diag(H) == 0
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
        H += torch.eye(H.shape[0], device=H.device) * (self.percdamp * torch.diag(H).mean())
        factor, info = torch.linalg.cholesky_ex(H)
        if int(info) != 0:
            raise RuntimeError("SparseGPT: the dampened Hessian is not positive definite; "
                               "raise percdamp or use more calibration samples")
        return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)

    @torch.no_grad()
    def prune_layer(self, linear, stats: _Hessian, pattern: Pattern) -> None:
        W = linear.weight.detach().float().clone()
        # the inversion dampens H in place: on a copy when the statistics are kept for the next call
        Hinv = self._inverse_cholesky(stats.H if self._kept_stats is None else stats.H.clone(), W)
        columns = W.shape[1]
        nm = pattern if isinstance(pattern, NM) else None
        blocksize = self.blocksize if nm is None else nm.m * math.ceil(self.blocksize / nm.m)
        for start in range(0, columns, blocksize):
            stop = min(start + blocksize, columns)
            block = W[:, start:stop].t().contiguous()  # [columns of the block, rows]: rows contiguous
            Hinv1 = Hinv[start:stop, start:stop]
            diag = torch.diag(Hinv1)
            errors = torch.empty_like(block)
            if nm:
                keep = torch.empty_like(block, dtype=torch.bool)
            else:
                keep = pattern.keep_mask(block.square().t() / diag.square()).t()
            for i in range(stop - start):
                if nm and i % nm.m == 0:
                    group = slice(i, i + nm.m)
                    keep[group] = nm.keep_mask((block[group].square() / diag[group, None].square()).t()).t()
                q = block[i] * keep[i]
                torch.div(block[i] - q, diag[i], out=errors[i])
                block[i + 1:].addr_(Hinv1[i, i + 1:], errors[i], alpha=-1.0)
                block[i] = q
            W[:, start:stop] = block.t()
            W[:, stop:].addmm_(errors.t(), Hinv[start:stop, stop:], alpha=-1.0)
        linear.weight.copy_(W.to(linear.weight.dtype))
