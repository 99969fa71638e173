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

With ``dsnot``, as the DSnoT authors' ``--initial_method sparsegpt``: the mask of the saliency
w² / [H⁻¹]²_jj over the whole layer (no sweep, no weight update), refined by DSnoT
(:mod:`pyprune.methods.dsnot`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..nn.experts import expert_linears
from ..runtime import distributed, engine
from ..patterns import NM, Pattern
from .base import LayerwiseMaskMethod
from .dsnot import MaskRefinement
from .options import at_least_one, block_checkpoint, fraction, option


class _Hessian:
    """H = (2/N) Σ x xᵀ over the N calibration tokens of a layer, kept as the float64 sum of each
    batch's float32 xᵀx and the token count, so that ranks add their sums (:meth:`reduced`)."""

    def __init__(self, columns: int, device):
        self.sum = torch.zeros(columns, columns, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum += x.T @ x
        self.tokens += x.shape[0]

    @property
    def H(self) -> Tensor:
        """H in float32 (a new tensor each time)."""
        return (self.sum * (2.0 / self.tokens)).float()

    def reduced(self, dst: Optional[int]) -> Optional["_Hessian"]:
        """This Hessian summed over the ranks (sums and token counts), in place, on every rank or on
        rank ``dst`` alone (None on the others)."""
        tokens = distributed.all_reduce_(torch.tensor([self.tokens], dtype=torch.int64))
        total = distributed.all_reduce_(self.sum) if dst is None else distributed.reduce_(self.sum, dst)
        if total is None:
            return None
        self.tokens = int(tokens)
        return self


class HessianMethod(LayerwiseMaskMethod):
    """A layer-wise method that prunes each layer from its :class:`_Hessian` (SparseGPT, ALPS); in a
    process group a block's layer solves are spread over the ranks."""

    data_parallel = True
    distribute_solves = True

    def new_stats(self, name, linear):
        return _Hessian(linear.in_features, linear.weight.device)

    def update(self, stats, x, y):
        stats.add(x)

    def reduce_stats(self, stats, dst):
        return stats.reduced(dst)


class SparseGPT(MaskRefinement, HessianMethod):
    name = "sparsegpt"
    default_scope = "tensor"
    can_accumulate = True  # H is the mean of 2·x xᵀ over every token seen, of every dataset
    commands = ("prune", "continual")

    blocksize: int = option(128, "SparseGPT: columns per lazy-update block", at_least_one)
    percdamp: float = option(0.01, "SparseGPT: Hessian dampening, a fraction of mean(diag H)", fraction)
    checkpoint: Optional[str] = block_checkpoint()

    def working_bytes(self, block):
        """Every layer's float64 Hessian sum (all are filled in one pass over the block), and for the
        largest layer an fp32 copy of W with its swept block and H with its inverse and Cholesky factor
        (an MoE's expert matrices each a layer)."""
        with expert_linears(block, strict=False):
            linears = list(engine.block_linears(block).values())
        hessians = sum(8 * linear.in_features ** 2 for linear in linears)
        return hessians + max(8 * linear.weight.numel() + 12 * linear.in_features ** 2 for linear in linears)

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
    def mask_scores(self, linear, stats: _Hessian) -> Tensor:
        """The saliency w² / [H⁻¹]²_jj of every weight from the dampened Hessian (dead inputs score 0)."""
        W = linear.weight.detach().float().clone()
        Hinv = self._inverse_cholesky(stats.H, W)
        return W.square() / torch.diag(Hinv).square()

    @torch.no_grad()
    def prune_layer(self, linear, stats: _Hessian, pattern: Pattern) -> None:
        W = linear.weight.detach().float().clone()
        Hinv = self._inverse_cholesky(stats.H, W)
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
