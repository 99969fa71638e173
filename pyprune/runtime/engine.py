"""The layer-wise calibration engine (the sequential procedure of SparseGPT and Wanda).

Calibration tokens run through the embeddings once; the hidden states entering the first decoder
block are captured with the keyword arguments the model passes to its blocks (position
embeddings, attention mask, ...). Then block by block: a method sees a :class:`BlockContext`
(the block, its current inputs, helpers to run it and to hook its linear layers), prunes the
block, and the engine recomputes the block's outputs with the pruned weights as the next block's
inputs. Memory stays at about one block of activations (inputs + outputs) plus the model, or plus
one block and the weights outside the blocks when the model is offloaded (:mod:`pyprune.io.offload`).

What the methods take from it:
* Wanda / SparseGPT / COPAL: per-linear input and output captures -> :meth:`BlockContext.capture`;
  COPAL's dense propagation sets :attr:`BlockContext.next_inputs`.
* SAFE: the dense block's outputs as targets -> :meth:`BlockContext.forward` (SAFE⁺: the same
  outputs and its input statistics -> :meth:`BlockContext.capture`), before
  :func:`pyprune.runtime.training.train_block` trains the block's weights on them.
* Taylor / MoreauPruner / SmoothGrad: full-model gradients -> :func:`loss_gradients` (with
  :class:`LossScaler` for 16-bit models).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..io import storage
from . import distributed
from .checkpoint import Checkpoint, model_fingerprint, tokens_digest
from ..nn.anatomy import (BLOCK_STORE, block_linears, block_prefix, block_store, decoder_blocks, first_tensor,
                           resident_blocks)
from ..nn.experts import expert_linears


class _BlockInputsCaptured(Exception):
    pass


#: keyword arguments of a block call that belong to generation, not to one forward
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


@torch.no_grad()
def capture_block_arguments(model: nn.Module, tokens: Tensor) -> List[dict]:
    """The keyword arguments the model passes to each of its blocks (attention mask, position
    embeddings, ...), recorded per block: models with several layer types (Gemma 2/3, Qwen2/3 with
    sliding windows) give each type its own mask and, in Gemma 3, its own RoPE.

    They are recorded for one sample, ``tokens[:1]``, with every block replaced by a recorder that
    passes the hidden states on unchanged (no block runs, so offloaded blocks stay on disk); with
    batch size 1 they broadcast over a batch of any size, a last partial batch included. Every
    calibration sample has the same length and no padding, so the arguments are the same for all."""
    blocks = decoder_blocks(model)
    device = next(model.parameters()).device
    recorded: List[dict] = []

    def recorder(index: int):
        def record(hidden_states=None, *args, **kwargs):
            recorded.append({key: value for key, value in kwargs.items() if key not in _CACHE_KWARGS})
            recorded[-1]["use_cache"] = False
            if index == len(blocks) - 1:
                raise _BlockInputsCaptured
            return hidden_states
        return record

    own_forwards = [block.__dict__.get("forward") for block in blocks]  # e.g. accelerate's hooks
    for index, block in enumerate(blocks):
        block.forward = recorder(index)  # an instance attribute shadows the class's forward
    try:
        _decoder(model)(input_ids=tokens[:1].to(device), use_cache=False)
    except _BlockInputsCaptured:
        pass
    finally:
        for block, own in zip(blocks, own_forwards):
            if own is None:
                del block.forward
            else:
                block.forward = own
    if len(recorded) != len(blocks):
        raise RuntimeError(f"{type(model).__name__} called {len(recorded)} of its {len(blocks)} decoder blocks "
                           "in a forward; pyprune cannot record their arguments")
    return recorded


def _decoder(model: nn.Module) -> nn.Module:
    """The model without its LM head where transformers says which module that is."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) else model


@torch.no_grad()
def capture_block_inputs(model: nn.Module, tokens: Tensor, batch_size: int) -> Tuple[Tensor, List[dict]]:
    """Hidden states entering the first block for every calibration sample, and each block's
    keyword arguments (:func:`capture_block_arguments`)."""
    first = decoder_blocks(model)[0]
    device = next(model.parameters()).device
    captured = []

    def catch(module, args, kwargs):
        captured.append((args[0] if args else kwargs["hidden_states"]).detach())
        raise _BlockInputsCaptured

    handle = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for start in range(0, tokens.shape[0], batch_size):
            try:
                model(input_ids=tokens[start:start + batch_size].to(device), use_cache=False)
            except _BlockInputsCaptured:
                pass
    finally:
        handle.remove()
    return torch.cat(captured), capture_block_arguments(model, tokens)


@dataclass
class BlockContext:
    """One decoder block during layer-wise pruning, with its current calibration inputs."""

    index: int
    name: str
    block: nn.Module
    inputs: Tensor
    block_kwargs: dict
    batch_size: int
    #: the next block's inputs when a method sets them (default: this block's outputs after it
    #: is processed)
    next_inputs: Optional[Tensor] = None
    #: in a process group: the calibration samples of all ranks, and the index of this rank's first
    #: (``inputs`` holds this rank's rows, :func:`pyprune.runtime.distributed.shard`); None: ``inputs`` is all
    samples: Optional[int] = None
    offset: int = 0

    def linears(self) -> Dict[str, nn.Linear]:
        return block_linears(self.block)

    def forward(self, inputs: Optional[Tensor] = None, grad: bool = False) -> Tensor:
        """The block's outputs for ``inputs`` (default: the calibration inputs), batch by batch."""
        inputs = self.inputs if inputs is None else inputs
        with torch.set_grad_enabled(grad):
            outputs = [first_tensor(self.block(inputs[s:s + self.batch_size], **self.block_kwargs))
                       for s in range(0, inputs.shape[0], self.batch_size)]
        return torch.cat(outputs)

    def capture(self, on_batch: Callable[[str, nn.Linear, Tensor, Tensor], None]) -> Tensor:
        """Run the block once over the calibration inputs, calling ``on_batch(name, linear, x, y)``
        with each linear layer's input and output of every batch; returns the block outputs."""
        linears = self.linears()

        def hook(name: str):
            def observe(module, args, output) -> None:  # returns None: the output stays as it is
                on_batch(name, module, args[0].detach(), output.detach())
            return observe

        handles = [module.register_forward_hook(hook(name)) for name, module in linears.items()]
        try:
            return self.forward()
        finally:
            for handle in handles:
                handle.remove()


class BlockCheckpoint:
    """Where block-wise pruning saves every finished block (a :class:`~pyprune.runtime.checkpoint.Checkpoint`
    state ``block-<i>.safetensors``) and an index ``blockwise.json`` (the run's ``key``, the number
    of finished blocks, their details). A rerun with the same key restores the finished blocks and
    goes on from the next one; another key is refused before anything changes. A restored block's
    outputs feed the next block: its pruned outputs, or with ``dense_propagation`` its dense outputs
    (computed before its weights are restored)."""

    INDEX = "blockwise.json"

    def __init__(self, directory: str, key: dict, dense_propagation: bool = False):
        self.states = Checkpoint(directory, key, "block checkpoint")
        self.dense_propagation = dense_propagation

    @classmethod
    def of_run(cls, directory: str, method: str, settings: dict, pattern, model: Optional[nn.Module] = None,
               calib: Optional[Tensor] = None, dense_propagation: bool = False) -> "BlockCheckpoint":
        """The checkpoint of a block-wise prune by ``method`` with ``settings`` to ``pattern``, keyed
        by all of them and the model and calibration tokens (None before they exist)."""
        key = {"method": method, "settings": settings, "pattern": str(pattern),
               "scope": getattr(pattern, "scope", None),
               "model": None if model is None else model_fingerprint(model),
               "calibration": None if calib is None else tokens_digest(calib)}
        return cls(directory, key, dense_propagation)

    def finished(self, parts: Optional[Sequence[str]] = None) -> Tuple[int, List]:
        """(number of finished blocks, their details), each finished block's state checked from its
        header; StateError for a checkpoint of another run (compared in ``parts`` of the key if
        given, e.g. before the model and calibration exist) or a finished block without its state."""
        index = self.states.read_index(self.INDEX, parts)
        if index is None:
            return 0, []
        for block in range(index["finished"]):
            if self.states.meta(self._name(block), parts) is None:
                raise self._missing(block)
        return index["finished"], index["details"]

    def restore(self, block: nn.Module, index: int) -> None:
        """Load the saved weights of finished block ``index`` into ``block``."""
        state = self.states.load(self._name(index))
        if state is None:
            raise self._missing(index)
        block.load_state_dict(state[0])

    def save(self, index: int, block: nn.Module, details: List) -> None:
        """Save finished block ``index``, then the index that lists it (``details``: every block's so far)."""
        self.states.save(self._name(index), block.state_dict(), {"block": index})
        self.states.write_index(self.INDEX, {"finished": index + 1, "details": details})

    @staticmethod
    def _name(index: int) -> str:
        return f"block-{index}.safetensors"

    def _missing(self, index: int) -> storage.StateError:
        return storage.StateError(f"checkpoint {self.states.directory} lists block {index} as finished but has no "
                                  f"{self._name(index)}; remove the checkpoint directory")


def run_blockwise(model: nn.Module, tokens: Tensor, process_block: Callable[[BlockContext], Optional[dict]], *,
                  batch_size: int = 8, progress: bool = True, desc: str = "pruning",
                  checkpoint: Optional[BlockCheckpoint] = None) -> List:
    """Layer-wise pruning: ``process_block(ctx)`` prunes each block in turn (and may return
    details, JSON-serialisable); the next block sees the outputs of the pruned blocks before it.
    During ``process_block`` an MoE block's fused experts are one linear per expert matrix
    (:func:`pyprune.nn.experts.expert_linears`), whose hooks see the tokens routed to that expert.
    With ``checkpoint``, finished blocks are saved and a rerun resumes. An offloaded model's blocks
    (:mod:`pyprune.io.offload`) are read one at a time and written back when done. Returns every
    block's details.

    In a process group (:mod:`pyprune.runtime.distributed`) each rank runs its shard of ``tokens``
    (whole batches) through the blocks, ``process_block`` reduces what it needs across the ranks,
    rank 0 alone saves the checkpoint, and a rank that raises ends every rank with
    :class:`~pyprune.runtime.distributed.RankFailed`."""
    blocks = decoder_blocks(model)
    store = block_store(model)
    prefix = block_prefix(model)
    finished, details = checkpoint.finished() if checkpoint is not None else (0, [])
    if finished and progress and distributed.is_main():  # a resume says so, once, before the bar
        print(f"pyprune: resuming from checkpoint {checkpoint.states.directory}: {finished} of {len(blocks)} "
              "blocks already done, restored from it", file=sys.stderr)
    was_training = model.training
    model.eval()
    try:
        first, stop = distributed.shard_bounds(tokens.shape[0], batch_size)
        with distributed.failure_shared("the calibration inputs"):
            inputs, block_arguments = capture_block_inputs(model, tokens[first:stop], batch_size)
        for index in tqdm(range(len(blocks)), desc=desc, unit="block", disable=not progress):
            if store is not None:
                store.fetch(index, blocks[index])
            ctx = BlockContext(index, f"{prefix}.{index}", blocks[index], inputs, block_arguments[index], batch_size,
                               samples=tokens.shape[0], offset=first)
            with distributed.failure_shared(f"block {index} ({ctx.name})"):
                if index < finished:
                    if checkpoint.dense_propagation:
                        ctx.next_inputs = ctx.forward()
                    checkpoint.restore(blocks[index], index)
                else:
                    with expert_linears(blocks[index], where=ctx.name):  # fused MoE experts as one linear each
                        details.append(process_block(ctx))
                    if checkpoint is not None and distributed.is_main():
                        checkpoint.save(index, blocks[index], details)
                inputs = (ctx.forward() if ctx.next_inputs is None else ctx.next_inputs).detach()
            if store is not None:
                store.store(index, blocks[index])
    finally:
        model.train(was_training)
    return details


def accumulate_gradients(model: nn.Module, tokens: Tensor, *, batch_size: int = 4,
                         progress: bool = True, desc: str = "gradients", zero_first: bool = True) -> None:
    """Fill ``.grad`` of every trainable parameter with the gradient of the mean next-token loss
    over all calibration tokens (:func:`loss_gradients`, in the parameters' dtype); with
    ``zero_first=False`` it is added to the ``.grad`` already there."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [None if zero_first or p.grad is None else p.grad.detach().clone() for p in params]
    grads = loss_gradients(model, params, tokens, batch_size=batch_size, progress=progress, desc=desc)
    for p, grad, old in zip(params, grads, before):
        p.grad = grad.to(p.dtype) if old is None else old + grad.to(p.dtype)


class LossScaler:
    """Dynamic loss scaling of gradient passes in 16-bit formats, as ``torch.amp.GradScaler`` does:
    the loss is multiplied by ``scale`` before backward, so that small gradients stay normal
    numbers in fp16 instead of flushing to zero; after a pass with an inf or NaN gradient the scale
    is multiplied by ``backoff_factor`` (the pass is redone), after ``growth_interval`` finite passes
    in a row by ``growth_factor``. With the default factors the scale stays a power of two, so
    scaling and unscaling are exact."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0; got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1; got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an integer >= 1; got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.backoffs = 0
        self._finite_in_a_row = 0

    def update(self, finite: bool) -> None:
        """Back off after a pass with non-finite gradients, grow after ``growth_interval`` finite ones."""
        if finite:
            self._finite_in_a_row += 1
            if self._finite_in_a_row == self.growth_interval:
                self.scale *= self.growth_factor
                self._finite_in_a_row = 0
        else:
            self.scale *= self.backoff_factor
            self.backoffs += 1
            self._finite_in_a_row = 0


_MIN_LOSS_SCALE = 2.0 ** -24  # fp16's smallest subnormal: below it every scaled gradient is 0


def loss_gradients(model: nn.Module, params: Sequence[nn.Parameter], tokens: Tensor, *, batch_size: int = 4,
                   scaler: Optional[LossScaler] = None, progress: bool = False,
                   desc: str = "gradients") -> List[Tensor]:
    """∇ of the mean next-token loss over ``tokens`` for each of ``params`` (which require grad), fp32
    (zeros for a parameter the loss does not reach); every ``.grad`` is cleared after.

    Each batch's gradient is added to a float64 sum, so the sum does not depend on how the batches
    are split: in a process group each rank runs its shard of whole batches and the sums are added
    over the ranks (:mod:`pyprune.runtime.distributed`). With a :class:`LossScaler`: each batch's
    backward runs on the loss times ``scaler.scale``; a batch with an inf or NaN gradient is redone
    at the backed-off scale, and the finite gradients are unscaled into the sums, so a 16-bit
    gradient is rounded once, at scale (each rank's scaler follows its own batches). A loss that is
    itself not finite raises FloatingPointError (no scale can help)."""
    device = next(model.parameters()).device
    sums = [torch.zeros(p.shape, dtype=torch.float64, device=p.device) for p in params]
    total, shard = tokens.shape[0], distributed.shard(tokens, batch_size)
    where = f" of rank {distributed.rank()}'s shard" if distributed.active() else ""
    try:
        for start in tqdm(range(0, shard.shape[0], batch_size), desc=desc, unit="batch", disable=not progress):
            batch = shard[start:start + batch_size].to(device)
            while True:
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                scale = 1.0 if scaler is None else scaler.scale
                if scaler is not None and not torch.isfinite(loss):
                    raise FloatingPointError(f"the loss of calibration batch {start // batch_size}{where} is "
                                             f"{loss.item()}; loss scaling cannot help")
                (loss * (batch.shape[0] / total * scale)).backward()
                if scaler is None:
                    break
                finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
                scaler.update(finite)
                if finite:
                    break
                if scaler.scale < _MIN_LOSS_SCALE:
                    raise FloatingPointError(f"gradients of calibration batch {start // batch_size}{where} are "
                                             f"not finite even at loss scale {scale}")
            for acc, p in zip(sums, params):
                if p.grad is not None:
                    acc.add_(p.grad, alpha=1.0 / scale)
    finally:
        model.zero_grad(set_to_none=True)
    return [distributed.all_reduce_(acc).float() for acc in sums]
