"""The training routines of the methods that train: :func:`train` for a whole model (DReSS's
regularisation, LoRA recovery) and :func:`train_block` for one decoder block on its reconstruction
error (SAFE; any block-wise reconstruction method). Both draw seeded shuffled minibatches; a
16-bit model trains on fp32 master weights (:func:`fp32_master_weights`) and gets its dtype back.
In a process group a block, or a model, can train sharded over the ranks (:func:`sharded_copy`, FSDP2).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import distributed, engine
from .checkpoint import Checkpoint


def backward_shared(params: Sequence[Tensor], share: Optional[Callable[[], Tensor]], device) -> Tensor:
    """One minibatch's backward, data-parallel: zero the gradients of ``params``, backward this
    rank's share of the minibatch loss (``share()``: the loss of its rows of the minibatch times
    their fraction of it; None when it holds none of them), then sum the gradients and the loss over
    the ranks (:func:`pyprune.runtime.distributed.all_reduce_gradients_`), so that every rank holds
    the whole minibatch's and takes the same step. Returns the minibatch loss. In one process, a
    plain backward of the minibatch loss. Parameters sharded by :func:`sharded_copy` get their
    gradients summed by FSDP's backward (each rank this sum's rows of them), and every rank must
    give a ``share``."""
    for p in params:
        p.grad = None
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if share is not None:
        loss = share()
        loss.backward()
    if not any(distributed.sharded(p) for p in params):
        distributed.all_reduce_gradients_(params)
    return distributed.all_reduce_(loss.detach().reshape(1)).reshape(())


def minibatches(nsamples: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Index batches without end: each epoch a fresh permutation cut into whole batches (the
    last ``nsamples % batch_size`` samples of an epoch wait for the next one)."""
    order = torch.empty(0, dtype=torch.long)
    while True:
        if order.numel() < batch_size:
            order = torch.randperm(nsamples, generator=generator)
        yield order[:batch_size]
        order = order[batch_size:]


@contextlib.contextmanager
def fp32_master_weights(model: nn.Module):
    """Train ``model`` in fp32 and in train mode; its dtype and mode come back afterwards."""
    dtype, was_training = next(model.parameters()).dtype, model.training
    model.float().train()
    try:
        yield model
    finally:
        model.to(dtype).train(was_training)


class TrainingCheckpoint:
    """Where and how often :func:`train` saves: a :class:`~pyprune.runtime.checkpoint.Checkpoint`
    state ``name`` in ``directory`` of the model's and the optimizer's tensors, the step, the log
    and the optimizer's other values in its metadata; ``key`` identifies the run (settings, model),
    and a checkpoint with another key is refused."""

    def __init__(self, directory: str, every: int, key: dict, name: str = "train-checkpoint.safetensors"):
        self.states = Checkpoint(directory, key, "training checkpoint")
        self.every, self.name = every, name

    def check(self, parts=None) -> None:
        """StateError when the directory holds a checkpoint of another run (compared in ``parts``
        of the key if given: e.g. the settings alone, before the model is loaded)."""
        self.states.meta(self.name, parts)

    def saved_step(self) -> int:
        """The steps a saved run of this key has done (0 when none is saved): where :func:`train` goes on."""
        meta = self.states.meta(self.name)
        return 0 if meta is None else meta["step"]

    def save(self, model: nn.Module, optimizer, step: int, log: Dict) -> None:
        tensors = {f"model.{name}": value for name, value in model.state_dict().items()}
        saved = optimizer.state_dict()
        scalars = {}
        for index, values in saved["state"].items():
            for name, value in values.items():
                if isinstance(value, Tensor):
                    tensors[f"optimizer.{index}.{name}"] = value
                else:
                    scalars[f"{index}.{name}"] = value
        self.states.save(self.name, tensors, {
            "step": step, "log": log, "optimizer": {"param_groups": saved["param_groups"], "scalars": scalars}})

    def load(self, model: nn.Module, optimizer, log: Dict) -> int:
        """Restore a saved run into ``model``, ``optimizer`` and ``log``; the step to go on from."""
        state = self.states.load(self.name)  # the optimizer casts its state
        if state is None:
            return 0
        tensors, meta = state
        model.load_state_dict({name[len("model."):]: value for name, value in tensors.items()
                               if name.startswith("model.")})
        restored: Dict[int, dict] = {}
        for name, value in list(tensors.items()) + list(meta["optimizer"]["scalars"].items()):
            if not name.startswith("model."):
                index, field = name.removeprefix("optimizer.").split(".", 1)
                restored.setdefault(int(index), {})[field] = value
        optimizer.load_state_dict({"state": restored, "param_groups": meta["optimizer"]["param_groups"]})
        log.update(meta["log"])
        return meta["step"]


def train(model: nn.Module, params: List[nn.Parameter], tokens: Tensor, *, steps: int, lr: float,
          batch_size: int, seed: int, after_backward: Optional[Callable[[nn.Module], Dict[str, float]]] = None,
          after_step: Optional[Callable[[nn.Module], None]] = None, checkpoint: Optional[TrainingCheckpoint] = None,
          desc: str = "train", progress: bool = True, shard: Sequence[nn.Module] = ()) -> Dict[str, list]:
    """``steps`` AdamW steps (constant ``lr``, weight decay 0) of ``params`` on the mean next-token
    loss of seeded shuffled minibatches of ``tokens`` ([nsamples, seqlen] ids).
    ``after_backward(trained)`` runs between backward and the step and returns values to log (e.g. a
    penalty); ``after_step(trained)`` runs after each step (e.g. a proximal step on the updated
    weights); ``trained`` is the module that trains (``model``, or its sharded copy). Returns the log:
    ``loss`` per step and each logged value per step. A non-finite loss raises FloatingPointError.
    With ``checkpoint``, saved every ``checkpoint.every`` steps and at the end (by rank 0 in a
    process group), and resumed from.

    In a process group every rank holds ``tokens`` and draws the same minibatches; each runs its
    part of every minibatch (:func:`backward_shared`: gradients summed over the ranks before
    ``after_backward`` and the step), so the ranks train one model as one process would, up to the
    rounding of the sums. With ``shard`` (submodules of ``model``, e.g. its decoder blocks; in a
    process group only, without ``checkpoint``), a copy of the model sharded over the ranks trains
    (:func:`sharded_copy`, each of ``shard`` a unit, in the model's dtype), and the trained
    parameters come back into ``model`` at the end; a rank without rows in a minibatch runs its
    first row of it, weighted 0. The hooks then get the copy, whose parameters and gradients hold
    this rank's rows (:func:`pyprune.runtime.distributed.local`): what they compute over whole
    tensors they sum over the ranks, and every rank must call them alike (they may hold collectives)."""
    if shard and not distributed.active():
        raise ValueError("train: shard needs a process group of 2 or more ranks")
    if shard and checkpoint is not None:
        raise ValueError("train: a sharded run takes no checkpoint")
    with sharded_copy(model, shard, fp32=False) if shard else contextlib.nullcontext(model) as training:
        names = {id(p): name for name, p in model.named_parameters()}
        copied = dict(training.named_parameters())
        return _train(training, [copied[names[id(p)]] for p in params], tokens, steps=steps, lr=lr,
                      batch_size=batch_size, seed=seed, after_backward=after_backward, after_step=after_step,
                      checkpoint=checkpoint, desc=desc, progress=progress, sharded=bool(shard))


def _train(model: nn.Module, params: List[nn.Parameter], tokens: Tensor, *, steps: int, lr: float,
           batch_size: int, seed: int, after_backward, after_step, checkpoint: Optional[TrainingCheckpoint],
           desc: str, progress: bool, sharded: bool) -> Dict[str, list]:
    """:func:`train` on ``model`` (a sharded copy when ``sharded``)."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = minibatches(tokens.shape[0], min(batch_size, tokens.shape[0]), torch.Generator().manual_seed(seed))
    log: Dict[str, list] = {"loss": []}
    saved = checkpoint.saved_step() if checkpoint is not None else 0
    if saved > steps:  # refused before the saved run is loaded into the model
        raise ValueError(f"{desc}: steps={steps} is fewer than the {saved} steps the checkpoint in "
                         f"{checkpoint.states.directory} has done; set steps >= {saved} or remove the checkpoint")
    start = checkpoint.load(model, optimizer, log) if saved else 0
    for _ in range(start):  # the minibatches the finished steps drew
        next(batches)
    with tqdm(total=steps, initial=min(start, steps), desc=desc, unit="step", disable=not progress) as bar:
        for step in range(start, steps):
            index = next(batches)
            mine = index.tensor_split(distributed.world_size())[distributed.rank()]
            weight = mine.numel() / index.numel()
            if sharded and not mine.numel():
                mine = index[:1]
            batch = tokens[mine].to(device=device, dtype=torch.long)

            def share() -> Tensor:
                return model(input_ids=batch, labels=batch, use_cache=False).loss * weight

            value = float(backward_shared(params, share if mine.numel() else None, device))
            if not math.isfinite(value):
                raise FloatingPointError(f"{desc}: the training loss is {value} at step {step} (try a smaller lr)")
            for key, extra in (after_backward(model) if after_backward is not None else {}).items():
                log.setdefault(key, []).append(extra)
            optimizer.step()
            if after_step is not None:
                after_step(model)
            log["loss"].append(value)
            if checkpoint is not None and distributed.is_main() and (
                    (step + 1) % checkpoint.every == 0 or step + 1 == steps):
                checkpoint.save(model, optimizer, step + 1, log)
            bar.set_postfix(loss=f"{value:.4f}")
            bar.update()
    optimizer.zero_grad(set_to_none=True)
    return log


def linear_warmup_decay(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """LR factor of step t: t/warmup up to ``warmup_steps``, then linear decay to 0 at ``total_steps``
    (SAFE's "linear schedule with warm-up", Table 5)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return factor


@contextlib.contextmanager
def sharded_copy(module: nn.Module, units: Sequence[nn.Module], fp32: bool) -> Iterator[nn.Module]:
    """A copy of ``module``'s modules, in train mode, sharded over the ranks by PyTorch's FSDP2
    (``torch.distributed.fsdp.fully_shard``), to train what does not fit one device: every
    parameter holds this rank's rows (dim 0, a ``DTensor``), in fp32 with ``fp32``. Each of
    ``units`` (submodules of ``module``: a block's linears, a model's decoder blocks) is an FSDP
    unit of its own, the rest one more: a forward gathers one unit's whole parameters at a time, and
    a backward reduce-scatters their gradients, summed over the ranks (not averaged: each rank's
    loss is already its share of the minibatch), so an optimiser built on the copy's parameters
    keeps 1/N of the state on each rank. On leaving, the copy's parameters are gathered one at a
    time into ``module``'s own (in their dtype); an error inside leaves ``module`` as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    owned = dict(module.named_parameters())
    # the copy's modules hold new parameters over the module's tensors, so casting them leaves the module's alone
    memo = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in module.parameters()}
    memo.update({id(b): b for b in module.buffers()})
    copied = copy.deepcopy(module, memo).train()
    mesh = init_device_mesh(next(module.parameters()).device.type, (distributed.world_size(),))
    for unit in [*(memo[id(unit)] for unit in units), copied]:  # the units first: FSDP's units nest
        if fp32:
            for param in unit.parameters():
                if not distributed.sharded(param):
                    param.data = param.data.float()  # one unit at a time in fp32 before its shards are cut
        fully_shard(unit, mesh=mesh)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    yield copied
    with torch.no_grad():
        for name, param in copied.named_parameters():
            owned[name].copy_(param.full_tensor())


@contextlib.contextmanager
def sharded_block(ctx: "engine.BlockContext") -> Iterator["engine.BlockContext"]:
    """``ctx`` with its block's copy sharded over the ranks (:func:`sharded_copy`: fp32 masters,
    each linear layer a unit), whose trained weights come back into the block on leaving; outside
    a process group, ``ctx`` as it is."""
    if not distributed.active():
        yield ctx
        return
    with sharded_copy(ctx.block, list(engine.block_linears(ctx.block).values()), fp32=True) as block:
        yield dataclasses.replace(ctx, block=block)


def train_block(ctx: "engine.BlockContext", targets: Tensor, optimizer: torch.optim.Optimizer, *, steps: int,
                batch_size: int, seed: int, scheduler=None, desc: str = "block", progress: bool = True,
                relative: bool = False) -> List[float]:
    """``steps`` optimiser steps on the block's reconstruction error: the mean squared error between
    the block's outputs for a minibatch of ``ctx.inputs`` and the same rows of ``targets`` (e.g. the
    dense block's outputs), minibatches drawn by :func:`minibatches` (one graph per minibatch, never
    one over the calibration set); with ``relative``, divided by the mean square of all ``targets``
    (a minibatch estimate of ‖Y − Ŷ‖² / ‖Y‖², 1 for Ŷ = 0, unchanged when inputs and targets scale
    together through a linear block). The minibatches and the block's keyword arguments are cast to
    the block's dtype (fp32 inside :func:`fp32_master_weights`). ``optimizer.step`` gets a closure
    (SAM evaluates it twice); ``scheduler.step()`` follows each step. Returns the loss of every step.

    In a process group (``ctx.samples`` > the rows of ``ctx.inputs``) the minibatches are drawn over
    all ranks' samples alike on every rank; each rank adds the squared errors of its rows of a
    minibatch and the gradients are summed over the ranks before every step (:func:`backward_shared`).
    A block sharded by :func:`sharded_block` runs its forward and backward on every rank (its
    collectives need all of them): a rank without rows in a minibatch runs its first row, weighted 0."""
    dtype = next(ctx.block.parameters()).dtype
    samples = ctx.samples or ctx.inputs.shape[0]
    per_sample = targets[0].numel()
    if relative:
        square_sum = distributed.all_reduce_(targets.double().square().sum().reshape(1))
        scale = float(square_sum) / (samples * per_sample)
    else:
        scale = 1.0
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{desc}: relative reconstruction error needs targets with a finite, positive mean "
                         f"square; got {scale}")
    kwargs = _cast_floating(ctx.block_kwargs, dtype)
    batches = minibatches(samples, min(batch_size, samples), torch.Generator().manual_seed(seed))
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    sharded = any(distributed.sharded(p) for p in trained)
    losses = []
    for _ in tqdm(range(steps), desc=desc, unit="step", leave=False, disable=not progress):
        index = next(batches)
        mine = index[(index >= ctx.offset) & (index < ctx.offset + ctx.inputs.shape[0])] - ctx.offset
        weight = 1.0
        if sharded and not mine.numel():
            mine, weight = mine.new_zeros(1), 0.0
        inputs, wanted = ctx.inputs[mine].to(dtype), targets[mine].to(dtype)

        def share() -> Tensor:
            outputs = engine.first_tensor(ctx.block(inputs, **kwargs))
            return F.mse_loss(outputs, wanted, reduction="sum") * weight / (index.numel() * per_sample * scale)

        def closure() -> Tensor:
            return backward_shared(trained, share if mine.numel() else None, targets.device)

        loss = float(optimizer.step(closure).detach())
        if not math.isfinite(loss):
            raise FloatingPointError(f"{desc}: the reconstruction loss is {loss} (try a smaller lr)")
        losses.append(loss)
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def _cast_floating(value, dtype: torch.dtype):
    """``value`` with every floating tensor in it (also inside tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
