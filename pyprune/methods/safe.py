"""SAFE and SAFE⁺ (Lee et al.): sparsity-constrained sharpness-aware pruning by ADMM, post-training
and block by block on the reconstruction error (spec §1.11, Algorithm 1).

For each decoder block, on its calibration inputs X (the outputs of the blocks already pruned):
targets Y = dense block(X); the 7 linear weights train on fp32 masters with
:class:`pyprune.runtime.optim.SafeOptimizer` on the reconstruction error f over seeded minibatches
(:func:`pyprune.runtime.training.train_block`), Adam β = (0.9, 0.95), linear LR schedule with warm-up;
z₀ = proj(x₀), u₀ = 0, then after every ``dual_interval`` steps the z/u-step projects onto the
pattern by |v| (SAFE) or by |v|·‖X_j‖ (SAFE⁺, P = diag(AᵀA) from the block's calibration inputs,
§1.6.2); the block ends projected (Algorithm 1, line 15) and in the model's dtype. With
``train_norms`` the block's other parameters (RMSNorm gains) train with the same SAM-Adam,
unconstrained (as in the authors' code).

A scale-free penalty. Under Adam only the per-coordinate ratio of the penalty λ(x − z + u) to
∇f in the x-step (Eq. 4–5) matters when the penalty enters the moments (the authors' code,
``penalty="adam"``), and the gradient of the mean squared error grows with the square of the
block's hidden-state scale (SmolLM2's grows with depth and carries massive-activation channels),
so one λ is strong in one block and negligible in another; and once the penalty dominates, Adam
moves each weight by about the learning rate per step whatever λ is, so x reaches z only if
K·lr is of the order of the weights (measured in benchmarks/safe_sweep_smollm2.py). The default,
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
from typing import Optional

import torch

from ..runtime import engine
from .. import ops
from ..runtime.optim import SafeOptimizer
from ..patterns import NM, Unstructured
from ..runtime.training import fp32_master_weights, linear_warmup_decay, train_block
from .base import BlockwiseMethod, LayerSparsityMethod
from .options import at_least_one, block_checkpoint, nonnegative, option, positive


def _below_one(value):
    return None if 0 <= value < 1 else "must be in [0, 1)"


class Safe(LayerSparsityMethod, BlockwiseMethod):
    """SAFE: the z-step projects by magnitude."""

    name = "safe"
    patterns = (Unstructured, NM)
    default_scope = "row"
    #: 64 x 256 tokens, 3 passes (96 steps per block at batch 2): 4x the windows of (16, 256) at 10
    #: passes for about the same steps; held-out block error 0.416 of Wanda's one-shot against 0.455
    #: (benchmarks/safe_sweep_smollm2.py), the calibration fitted less closely
    calibration = (64, 256)
    #: SAFE⁺ scores the projection with P = diag(AᵀA)
    weighted_projection = False

    epochs: int = option(3, "SAFE: passes over the calibration samples per block (paper: 30; the default fits the "
                         "default 64 calibration windows: 96 steps at batch 2)", at_least_one)
    train_batch: int = option(2, "SAFE: calibration samples per training step (paper: 8)", at_least_one)
    lr: float = option(5e-3, "SAFE: Adam learning rate, peak of the linear schedule (paper: 2e-4, for LLaMA weights "
                       "~8x smaller than SmolLM2's)", positive)
    warmup_epochs: float = option(1.0, "SAFE: linear LR warm-up, in epochs (paper: 2)", nonnegative)
    rho: float = option(2e-4, "SAFE: SAM radius ρ (paper: 2e-4)", nonnegative)
    lam: float = option(100.0, "SAFE: augmented-Lagrangian penalty λ; with penalty 'decoupled' each step closes lr·λ "
                        "of the distance to z − u (paper: 1e-3, inside Adam on the 'mse' loss)", nonnegative)
    penalty: str = option("decoupled", "SAFE: the penalty's x-step: 'decoupled' = its own step x -= lr·λ(x − z + u) "
                          "after Adam's (Algorithm 1, lines 12–13), 'adam' = added to the gradient before Adam's "
                          "moments (the authors' code)", choices=("decoupled", "adam"))
    loss: str = option("relative", "SAFE: block loss f: 'relative' = ‖Y − Ŷ‖² / ‖Y‖² (λ means the same in every "
                       "block), 'mse' = the mean squared error (the paper's literal form)", choices=("relative", "mse"))
    train_norms: bool = option(False, "SAFE: also train the block's other parameters (RMSNorm gains) with the same "
                               "SAM-Adam, unconstrained")
    dual_interval: int = option(8, "SAFE: steps between dual (z/u) updates, K (paper: 32)", at_least_one)
    beta2: float = option(0.95, "SAFE: Adam β₂ (β₁ = 0.9)", _below_one)
    final_projection: str = option("same", "SAFE: metric of the last projection: 'same' as the z-step, or "
                                   "'euclidean' (|x|, Alg. 1 line 15)", choices=("same", "euclidean"))
    train_seed: int = option(0, "SAFE: seed of the minibatch order")
    checkpoint: Optional[str] = block_checkpoint()

    def check_options(self, settings):
        if settings["penalty"] == "decoupled" and settings["lr"] * settings["lam"] > 1:
            raise ValueError(f"options lr and lam of method {self.name!r} must have lr * lam <= 1 with penalty "
                             "'decoupled' (each step moves x by that fraction of its distance to z - u); got "
                             f"lr={settings['lr']}, lam={settings['lam']}")

    def working_bytes(self, block):
        """fp32 master weights, their gradients, Adam's two moments and SAM's perturbation: 20
        bytes per parameter of the block."""
        return 20 * sum(p.numel() for p in block.parameters())

    def prune_block(self, ctx: engine.BlockContext, pattern, *, steps: int, warmup: int, progress: bool) -> dict:
        """SAFE on one block (on its calibration inputs ``ctx.inputs``), in place; returns its first
        and last loss and ‖x − z‖/‖x‖ at the initial projection and every dual update."""
        linears = ctx.linears()
        importance = None
        if self.weighted_projection:
            sqnorms = {name: torch.zeros(linear.in_features, dtype=torch.float32, device=linear.weight.device)
                       for name, linear in linears.items()}
            targets = ctx.capture(lambda name, linear, x, y: ops.accumulate_sqnorm_(sqnorms[name], x))
            importance = {linear.weight: sqnorms[name] for name, linear in linears.items()}
        else:
            targets = ctx.forward()
        frozen = [p for p in ctx.block.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            with fp32_master_weights(ctx.block):
                weights = [linear.weight for linear in linears.values()]
                groups = [{"params": weights}]
                if self.train_norms:
                    groups.append({"params": [p for p in frozen if all(p is not w for w in weights)],
                                   "pattern": None})
                trained = [p for group in groups for p in group["params"]]
                for p in trained:
                    p.requires_grad_(True)
                optimizer = SafeOptimizer(groups, pattern, lr=self.lr, betas=(0.9, self.beta2), rho=self.rho,
                                          lam=self.lam, dual_interval=self.dual_interval, importance=importance,
                                          penalty=self.penalty)
                schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(steps, warmup))
                losses = train_block(ctx, targets, optimizer, steps=steps, batch_size=self.train_batch,
                                     seed=self.train_seed + ctx.index, scheduler=schedule,
                                     desc=f"{self.name} block {ctx.index}", progress=progress,
                                     relative=self.loss == "relative")
                optimizer.project_(self.final_projection)
                for p in trained:
                    p.requires_grad_(False)
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return {"block": ctx.index, "loss_first": losses[0], "loss_last": losses[-1],
                "residuals": [round(r, 6) for r in optimizer.residuals]}

    def schedule(self, samples: int):
        """(steps, warm-up steps) per block for ``samples`` calibration samples."""
        steps_per_epoch = math.ceil(samples / min(self.train_batch, samples))
        return self.epochs * steps_per_epoch, round(self.warmup_epochs * steps_per_epoch)

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        steps, warmup = self.schedule(calib.shape[0])

        def process(ctx: engine.BlockContext) -> dict:
            return self.prune_block(ctx, self.block_pattern(pattern, ctx.index), steps=steps, warmup=warmup, progress=progress)

        diagnostics = engine.run_blockwise(model, calib, process, batch_size=batch_size, progress=progress,
                                           desc=self.name, checkpoint=self.block_checkpoint(model, pattern, calib))
        return {"scope": getattr(pattern, "scope", None), "steps_per_block": steps,
                "dual_updates_per_block": steps // self.dual_interval, "blocks": diagnostics}


class SafePlus(Safe):
    """SAFE⁺: the z-step projects by |v|·‖X_j‖ (P = diag(AᵀA), Wanda's statistic)."""

    name = "safe+"
    weighted_projection = True
