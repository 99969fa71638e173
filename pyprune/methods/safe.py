"""SAFE and SAFE⁺ (Lee et al.): sparsity-constrained sharpness-aware pruning by ADMM, post-training
and block by block on the reconstruction error (spec §1.11, Algorithm 1).

For each decoder block, on its calibration inputs X (the outputs of the blocks already pruned):
targets Y = dense block(X); the 7 linear weights train on fp32 masters with
:class:`pyprune.runtime.optim.SafeOptimizer` on the reconstruction error f over seeded minibatches
(:func:`pyprune.runtime.training.train_block`), Adam β = (0.9, 0.95), linear LR schedule with warm-up;
z₀ = proj(x₀), u₀ = 0 (``dual_init="box"``: u₀ = x₀ − z₀), then after every ``dual_interval``
steps the z/u-step projects onto the pattern by |v| (SAFE) or by |v|·‖X_j‖ (SAFE⁺, P = diag(AᵀA)
from the block's calibration inputs, §1.6.2); the block ends projected (Algorithm 1, line 15) and
in the model's dtype. With ``train_norms`` the block's other parameters (RMSNorm gains) train with
the same SAM-Adam, unconstrained (as in the authors' code).

A scale-free penalty. Under Adam only the per-coordinate ratio of the penalty λ(x − z + u) to
∇f in the x-step (Eq. 4–5) matters when the penalty enters the moments (the authors' code,
``penalty="adam"``), and the gradient of the mean squared error grows with the square of the
block's hidden-state scale (SmolLM2's grows with depth and carries massive-activation channels),
so one λ is strong in one block and negligible in another; and once the penalty dominates, Adam
moves each weight by about the learning rate per step whatever λ is, so x reaches z only if
K·lr is of the order of the weights (measured by the ``safe-sweep`` study). The default,
``penalty="decoupled"``, is Algorithm 1's lines 12–13 with Adam in line 12 only: after Adam's step
on ∇f(x + ε), x ← x − ηλ(x − z + u), which closes the fraction ηλ of the distance to z − u every
step whatever the scale of f or of the weights, so λ (with the learning rate) means the same in
every block and model. ``loss="relative"`` divides the block's error by the dense targets' mean
square, f = ‖Y − Ŷ‖² / ‖Y‖² (1 for Ŷ = 0; the paper leaves f's normalisation open): unchanged
when inputs and targets scale together, it gives the "adam" penalty one meaning across blocks and
makes the reported losses comparable; ``loss="mse"`` is the paper's literal mean.

Paper settings (LLaMA, GPU): 30 epochs, batch 8, lr 2e-4, ρ = 2e-4, λ = 1e-3, K = 32, 128 × 2048
C4 tokens. The defaults here are for a CPU (see ``options``); every paper value is one option
away.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ..patterns import Unstructured
from ..runtime import distributed, engine
from ..runtime.optim import SafeOptimizer
from .base import RunWarning
from .options import at_least_one, block_checkpoint, nonnegative, option
from .owl import add_sqnorms, new_sqnorms
from .reconstruction import BlockTraining


class Safe(BlockTraining):
    """SAFE: the z-step projects by magnitude."""

    name = "safe"
    #: SAFE⁺ scores the projection with P = diag(AᵀA)
    weighted_projection = False

    rho: float = option(2e-4, "SAFE: SAM radius ρ, the norm of the ascent over a block's weights (paper: 2e-4)",
                        nonnegative)
    lam: float = option(100.0, "SAFE: augmented-Lagrangian penalty λ; with penalty 'decoupled' each step closes lr·λ "
                        "of the distance to z − u (paper: 1e-3, inside Adam on the 'mse' loss)", nonnegative)
    penalty: str = option("decoupled", "SAFE: the penalty's x-step: 'decoupled' = its own step x -= lr·λ(x − z + u) "
                          "after Adam's (Algorithm 1, lines 12–13), 'adam' = added to the gradient before Adam's "
                          "moments (the authors' code)", choices=("decoupled", "adam"))
    lam_schedule: str = option("constant", "SAFE: λ over a block's steps: 'constant', or 'cosine' = ramped from 0 to "
                               "lam along a half cosine over the block's steps, so that x can leave z₀ before the "
                               "penalty binds (the paper's penalty schedule for vision, App. B; its LLM runs keep λ "
                               "constant)", choices=("constant", "cosine"))
    dual_init: str = option("zero", "SAFE: the scaled dual at the start: 'zero' = u₀ = 0 (Algorithm 1, line 2), "
                            "'box' = u₀ = x₀ − z₀ (the printed box's u-step run at t = 0)", choices=("zero", "box"))
    train_norms: bool = option(False, "SAFE: also train the block's other parameters (RMSNorm gains) with the same "
                               "SAM-Adam, unconstrained")
    dual_interval: int = option(8, "SAFE: steps between dual (z/u) updates, K (paper: 32)", at_least_one)
    final_projection: str = option("same", "SAFE: metric of the last projection: 'same' as the z-step, or "
                                   "'euclidean' (|x|, Alg. 1 line 15)", choices=("same", "euclidean"))
    checkpoint: Optional[str] = block_checkpoint()

    def check_options(self, settings):
        if settings["penalty"] == "decoupled" and settings["lr"] * settings["lam"] > 1:
            raise ValueError(f"options lr and lam of method {self.name!r} must have lr * lam <= 1 with penalty "
                             "'decoupled' (each step moves x by that fraction of its distance to z - u); got "
                             f"lr={settings['lr']}, lam={settings['lam']}")

    def check(self, model, pattern) -> None:
        """:meth:`BlockTraining.check`; with ``shard_training``, a projection that needs a weight's
        rows alone (N:M, or unstructured of scope row), as each rank holds rows of every weight."""
        super().check(model, pattern)
        resolved = self.resolve(pattern)
        if self.shard_training and isinstance(resolved, Unstructured) and resolved.scope != "row":
            raise ValueError(f"option shard_training of method {self.name!r} shards each weight by rows, and the "
                             f"projection of scope {resolved.scope!r} needs whole weights: give an N:M pattern or "
                             "scope 'row'")

    def check_samples(self, nsamples: int) -> None:
        """At least one dual (z/u) update a block: fewer steps than ``dual_interval`` would train
        the weights with the penalty towards z₀ alone and never run ADMM's projection again."""
        steps, _ = self.schedule(nsamples)
        if steps < self.dual_interval:
            warnings.warn(f"method {self.name!r}: {nsamples} calibration samples, {self.epochs} epochs of batches of "
                          f"{self.train_batch} give {steps} steps a block, fewer than dual_interval="
                          f"{self.dual_interval}, so no dual update will run; raise nsamples or epochs, or "
                          "lower dual_interval", RunWarning)

    def prune_block(self, ctx: engine.BlockContext, pattern, *, steps: int, warmup: int, progress: bool) -> dict:
        """SAFE on one block (on its calibration inputs ``ctx.inputs``), in place; returns its first
        and last loss, ‖x − z‖/‖x‖ at the initial projection and every dual update, how far the
        final mask moved from z₀ (the fraction of z₀'s kept entries pruned at the end), and the SAM
        ascent's size: ρ/‖w‖ over the block's final weights, its per-weight RMS ρ/√n, and the mean norm
        of a step's Adam move (before the decoupled penalty) over ρ."""
        linears = ctx.linears()
        importance = None
        if self.weighted_projection:
            sqnorms = {name: new_sqnorms(linear) for name, linear in linears.items()}
            targets = ctx.capture(lambda name, linear, x, y: add_sqnorms(sqnorms[name], x))
            importance = [distributed.all_reduce_(sqnorms[name]).float() for name in linears]
        else:
            targets = ctx.forward()
        first_masks = {}
        counts = torch.zeros(2, dtype=torch.float64)  # z₀'s kept entries, those of them pruned at the end

        def build(weights, block):
            groups = [{"params": weights}]
            if self.train_norms:
                groups.append({"params": [p for p in block.parameters() if all(p is not w for w in weights)],
                               "pattern": None})
            optimizer = SafeOptimizer(groups, pattern, lr=self.lr, betas=(0.9, self.beta2), rho=self.rho,
                                      lam=self.lam, dual_interval=self.dual_interval,
                                      importance=None if importance is None else dict(zip(weights, importance)),
                                      penalty=self.penalty, dual_init=self.dual_init,
                                      lam_schedule=self.lam_schedule, lam_steps=steps)
            first_masks.update(optimizer.masks())  # z₀'s support (of this rank's rows, when sharded)
            return optimizer, [p for group in groups for p in group["params"]]

        def finish(optimizer):
            optimizer.project_(self.final_projection)
            for w, first in first_masks.items():
                counts[0] += int(first.sum())
                counts[1] += int((first & (distributed.local(w) == 0)).sum())
            distributed.sum_shards_(counts, next(iter(first_masks)))

        losses, optimizer = self.train(ctx, targets, build, steps=steps, warmup=warmup, progress=progress,
                                       finish=finish)
        weights = [linear.weight for linear in linears.values()]
        kept_first, moved = (int(count) for count in counts)
        weight_norm = math.sqrt(sum(float(w.detach().float().square().sum()) for w in weights))
        count = sum(w.numel() for w in weights)
        return {"block": ctx.index, "loss_first": losses[0], "loss_last": losses[-1],
                "residuals": [round(r, 6) for r in optimizer.residuals],
                "mask_moved": round(moved / kept_first, 6) if kept_first else 0.0,
                "sam_relative": self.rho / weight_norm if weight_norm > 0 else 0.0,
                "sam_per_weight": self.rho / math.sqrt(count),
                "step_over_sam": (sum(optimizer.step_norms) / len(optimizer.step_norms) / self.rho
                                  if self.rho > 0 else None)}

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        report = super()._prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        report["dual_updates_per_block"] = report["steps_per_block"] // self.dual_interval
        return report


class SafePlus(Safe):
    """SAFE⁺: the z-step projects by |v|·‖X_j‖ (P = diag(AᵀA), Wanda's statistic)."""

    name = "safe+"
    weighted_projection = True
