"""Block-wise reconstruction training, and the control of SAFE that isolates it.

:class:`BlockTraining` is what SAFE and the control share: per decoder block, on its calibration
inputs X (the outputs of the blocks already pruned), the 7 linear weights train on fp32 masters
for ``epochs`` passes of minibatches of ``train_batch`` samples on the reconstruction error of the
dense block's outputs Y (:func:`pyprune.runtime.training.train_block`), with Adam β = (0.9, β₂), a
linear LR schedule with warm-up and a seeded minibatch order; with ``shard_training``, sharded over
the ranks of a process group (:func:`pyprune.runtime.training.sharded_block`).

:class:`MaskedReconstruction` (``masked-recon``) is SAFE without ADMM and without SAM: each block
is first pruned one-shot by ``start`` (magnitude: SAFE's z₀; Wanda: SAFE⁺'s z₀; SparseGPT: its
pruned and OBS-updated block), then only its kept weights train with the same budget, loss and
schedule (:class:`pyprune.runtime.optim.MaskedAdam`; a pruned weight stays exactly 0 and the mask
never changes). If SAFE beats it, ADMM + SAM is the cause of SAFE's gain over the one-shot
methods; if not, plain reconstruction training is.
"""
from __future__ import annotations

import contextlib
import math
from abc import abstractmethod
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..patterns import NM, Unstructured
from ..runtime import distributed, engine
from ..runtime.optim import MaskedAdam
from ..runtime.training import fp32_master_weights, linear_warmup_decay, sharded_block, train_block
from ..nn.experts import expert_linears
from .base import REGISTRY, BlockwiseMethod, LayerSparsityMethod, LayerwiseMaskMethod, apply_mask
from .options import at_least_one, block_checkpoint, nonnegative, option, positive, shard_training


def _below_one(value):
    return None if 0 <= value < 1 else "must be in [0, 1)"


class BlockTraining(LayerSparsityMethod, BlockwiseMethod):
    """A method that trains each block's weights on its reconstruction error (SAFE; the control);
    with ``owl``, each block at its own sparsity."""

    patterns = (Unstructured, NM)
    uses_gradients = True
    data_parallel = True  # statistics reduced, gradients summed over the ranks (runtime.training.train_block)
    default_scope = "row"
    #: 64 x 256 tokens, 3 passes (96 steps per block at batch 2): 4x the windows of (16, 256) at 10
    #: passes for about the same steps; held-out block error 0.416 of Wanda's one-shot against 0.455
    #: (the ``safe-sweep`` study), the calibration fitted less closely
    calibration = (64, 256)

    epochs: int = option(3, "block training: passes over the calibration samples per block (SAFE paper: 30; the "
                         "default fits the default 64 calibration windows: 96 steps at batch 2)", at_least_one)
    train_batch: int = option(2, "block training: calibration samples per training step (SAFE paper: 8)",
                              at_least_one)
    lr: float = option(5e-3, "block training: Adam learning rate, peak of the linear schedule (SAFE paper: 2e-4, "
                       "for LLaMA weights ~8x smaller than SmolLM2's)", positive)
    warmup_epochs: float = option(1.0, "block training: linear LR warm-up, in epochs (SAFE paper: 2)",
                                  nonnegative)
    loss: str = option("relative", "block training: block loss f: 'relative' = ‖Y − Ŷ‖² / ‖Y‖² (one meaning in "
                       "every block), 'mse' = the mean squared error (the SAFE paper's literal form)",
                       choices=("relative", "mse"))
    beta2: float = option(0.95, "block training: Adam β₂ (β₁ = 0.9)", _below_one)
    train_seed: int = option(0, "block training: seed of the minibatch order")
    shard_training: bool = shard_training()

    def check(self, model: nn.Module, pattern) -> None:
        """:meth:`Method.check`, and ``shard_training`` only in a process group of several ranks."""
        if self.shard_training and not distributed.active():
            raise ValueError(f"option shard_training of method {self.name!r} shards a block's training over the "
                             "ranks of a torch.distributed group: run under torchrun --nproc-per-node N with N >= 2 "
                             "(or in a process group of 2 or more ranks); got one process")
        super().check(model, pattern)

    def working_bytes(self, block):
        """fp32 master weights, their gradients, Adam's two moments and one more copy (SAM's
        perturbation, or the masks): 20 bytes per parameter of the block; with ``shard_training``
        on N ranks, 20/N bytes of them per parameter, and the largest linear's weight gathered in
        fp32 with its gradient before the reduce-scatter (8 bytes per entry)."""
        parameters = sum(p.numel() for p in block.parameters())
        if not self.shard_training:
            return 20 * parameters
        with expert_linears(block, strict=False):
            largest = max(linear.weight.numel() for linear in engine.block_linears(block).values())
        return round(20 * parameters / distributed.world_size()) + 8 * largest

    def schedule(self, samples: int) -> Tuple[int, int]:
        """(steps, warm-up steps) per block for ``samples`` calibration samples."""
        steps_per_epoch = math.ceil(samples / min(self.train_batch, samples))
        return self.epochs * steps_per_epoch, round(self.warmup_epochs * steps_per_epoch)

    def train(self, ctx: engine.BlockContext, targets: Tensor,
              build: Callable[[List[nn.Parameter], nn.Module], Tuple[torch.optim.Optimizer, List[nn.Parameter]]], *,
              steps: int, warmup: int, progress: bool, finish: Optional[Callable] = None):
        """Train the block on fp32 masters: ``build(weights, block)`` gets the linear weights (in
        the order of ``ctx.linears()``) and the block they are in, and returns the optimiser and
        every parameter it trains; the others stay frozen. ``finish(optimizer)`` runs on the fp32
        masters after the last step. With ``shard_training`` the block that trains is its copy
        sharded over the ranks (:func:`pyprune.runtime.training.sharded_block`), whose parameters
        ``build`` gets and whose weights are gathered into the block's after ``finish``. Returns
        (the loss of every step, the optimiser)."""
        frozen = [p for p in ctx.block.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            with self._training(ctx) as training:
                optimizer, trained = build([linear.weight for linear in training.linears().values()], training.block)
                for p in trained:
                    p.requires_grad_(True)
                schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(steps, warmup))
                losses = train_block(training, targets, optimizer, steps=steps, batch_size=self.train_batch,
                                     seed=self.train_seed + ctx.index, scheduler=schedule,
                                     desc=f"{self.name} block {ctx.index}", progress=progress,
                                     relative=self.loss == "relative")
                if finish is not None:
                    finish(optimizer)
                for p in trained:
                    p.requires_grad_(False)
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return losses, optimizer

    @contextlib.contextmanager
    def _training(self, ctx: engine.BlockContext):
        """The block context that trains: ``ctx`` with its block on fp32 masters in train mode, or
        with ``shard_training`` its copy sharded over the ranks."""
        if self.shard_training:
            with sharded_block(ctx) as training:
                yield training
        else:
            with fp32_master_weights(ctx.block):
                yield ctx

    @abstractmethod
    def prune_block(self, ctx: engine.BlockContext, pattern, *, steps: int, warmup: int, progress: bool) -> dict:
        """Prune and train one block in place; returns its diagnostics."""

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        steps, warmup = self.schedule(calib.shape[0])

        def process(ctx: engine.BlockContext) -> dict:
            return self.prune_block(ctx, self.block_pattern(pattern, ctx.index), steps=steps, warmup=warmup,
                                    progress=progress)

        diagnostics = engine.run_blockwise(model, calib, process, batch_size=batch_size, progress=progress,
                                           desc=self.name, checkpoint=self.block_checkpoint(model, pattern, calib))
        return {"scope": getattr(pattern, "scope", None), "steps_per_block": steps, "blocks": diagnostics}


#: the one-shot methods a control can start from
STARTS = ("magnitude", "wanda", "sparsegpt")


class MaskedReconstruction(BlockTraining):
    """The control of SAFE: the start method's one-shot block, then its kept weights trained with
    SAFE's budget, no ADMM, no SAM."""

    name = "masked-recon"

    start: str = option("wanda", "masked-recon: the one-shot method that prunes each block before its kept weights "
                        "train (wanda: SAFE⁺'s z₀; magnitude: SAFE's z₀; sparsegpt: its OBS-updated block)",
                        choices=STARTS)
    checkpoint: Optional[str] = block_checkpoint()

    def resolve(self, pattern):
        """An unstructured pattern without a scope gets the start method's default scope."""
        return REGISTRY[self.start]().resolve(pattern)

    def prune_block(self, ctx: engine.BlockContext, pattern, *, steps: int, warmup: int, progress: bool) -> dict:
        """The start's one-shot pruning of the block (on its calibration inputs, as the start alone
        would prune it), then MaskedAdam on its kept weights; the targets are the dense block's
        outputs. Returns the first and last loss and the fraction of kept entries (the mask)."""
        linears = ctx.linears()
        start = REGISTRY[self.start]()
        if isinstance(start, LayerwiseMaskMethod):
            stats = {name: start.layer_statistics(f"{ctx.name}.{name}", linear) for name, linear in linears.items()}
            tokens = dict.fromkeys(linears, 0)

            def observe(name, linear, x, y):
                tokens[name] += x.numel() // x.shape[-1]
                start.observe(stats[name], x, y)

            targets = ctx.capture(observe)
            with torch.no_grad():
                start.prune_block_layers(linears, stats, tokens, pattern)
        else:  # magnitude, which needs no statistics
            targets = ctx.forward()
            with torch.no_grad():
                for linear in linears.values():
                    apply_mask(linear, pattern.weight_mask(linear.weight))
        weights = [linear.weight for linear in linears.values()]
        kept = sum(int((w != 0).sum()) for w in weights) / sum(w.numel() for w in weights)  # the masks' density

        def build(weights, block):
            masks = {w: distributed.local(w) != 0 for w in weights}
            return MaskedAdam(weights, masks, lr=self.lr, betas=(0.9, self.beta2)), weights

        losses, _ = self.train(ctx, targets, build, steps=steps, warmup=warmup, progress=progress)
        return {"block": ctx.index, "loss_first": losses[0], "loss_last": losses[-1], "kept": round(kept, 6)}
