"""How much memory a prune needs, estimated before it starts, and the check against the memory
available (``MemAvailable``: free memory plus reclaimable caches).

The estimate (:func:`prune_need`) adds

* the weights in memory: the whole model, or with offload (:mod:`pyprune.io.offload`) the weights
  outside the decoder blocks plus the largest block;
* the calibration activations: a block's inputs and outputs for every sample (a third copy with
  dense propagation), plus one batch's intermediate tensors inside a block (queries, keys, values,
  fp32 attention scores, the MLP's gate/up/product);
* the method's working memory for one block (:meth:`pyprune.methods.Method.working_bytes`: e.g.
  SparseGPT's Hessians);
* :data:`RUNTIME`, what the interpreter with torch and transformers takes before any model.

:func:`check` refuses (:class:`NotEnoughMemory`, one line) a run whose estimate exceeds what is
available, saying how much it needs and how much offloading would need; :func:`check_prune` is
that check for a prune, made by ``Method.prune`` on the model and by the CLI on its config alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..nn import anatomy

__all__ = ["Need", "NotEnoughMemory", "available_bytes", "prune_need", "check", "check_prune", "check_load",
           "resident_bytes", "weight_bytes", "RUNTIME"]

#: the resident memory of a Python process with torch and transformers loaded (measured ~0.5 GiB)
RUNTIME = 600 * 2**20


class NotEnoughMemory(ValueError):
    """A run whose estimated peak memory exceeds the memory available."""


def available_bytes() -> int:
    """Memory available to a new allocation without swapping (MemAvailable)."""
    import psutil
    return int(psutil.virtual_memory().available)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Need:
    """Estimated peak memory of a prune, by part (bytes)."""

    weights: int
    activations: int
    method: int
    runtime: int = RUNTIME

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.method + self.runtime

    def describe(self) -> str:
        return (f"weights {gib(self.weights)} + calibration activations {gib(self.activations)} + "
                f"method {gib(self.method)} + runtime {gib(self.runtime)}")


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def resident_bytes(model: nn.Module) -> int:
    """Bytes already in memory for ``model``: its weights not on ``meta``, and :data:`RUNTIME`."""
    return RUNTIME + sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def weight_bytes(model: nn.Module, offloaded: bool) -> int:
    """Bytes of the weights in memory at once: all of them, or with offload those outside the
    decoder blocks plus the largest block (works on a model whose weights are on ``meta``)."""
    blocks = [_bytes(block) for block in anatomy.decoder_blocks(model)]
    total = _bytes(model)  # a tied weight counts once
    return total - sum(blocks) + max(blocks) if offloaded else total


def activation_bytes(config, intermediate: int, nsamples: int, seqlen: int, batch_size: int, dtype: torch.dtype,
                     dense_propagation: bool = False) -> int:
    """A block's calibration inputs and outputs (and dense outputs) for every sample, plus one
    batch's intermediate tensors inside a block (``intermediate``: the block's widest linear output,
    the MLP's width in every family whatever its config calls it)."""
    item = torch.finfo(dtype).bits // 8
    hidden = config.hidden_size
    heads = config.num_attention_heads
    copies = 3 if dense_propagation else 2
    stored = copies * nsamples * seqlen * hidden * item
    batch = min(batch_size, nsamples)
    attention = batch * seqlen * (4 * hidden * item + heads * seqlen * 4)  # q, k, v, out; fp32 scores
    mlp = 4 * batch * seqlen * intermediate * item  # gate, up, act(gate) * up, a copy in the hook
    return stored + attention + mlp


def prune_need(model: nn.Module, method, nsamples: int, seqlen: int, batch_size: int, *,
               offloaded: Optional[bool] = None) -> Need:
    """Estimated peak memory of pruning ``model`` (its weights may be on ``meta``) with ``method``
    on ``nsamples`` x ``seqlen`` calibration tokens; ``offloaded`` defaults to whether the model is."""
    if offloaded is None:
        offloaded = anatomy.block_store(model) is not None
    dtype = next(model.parameters()).dtype
    largest = max(anatomy.decoder_blocks(model), key=_bytes)
    activations = 0
    if method.needs_calibration:
        intermediate = max(linear.out_features for linear in anatomy.block_linears(largest).values())
        activations = activation_bytes(model.config, intermediate, nsamples, seqlen, batch_size, dtype,
                                       getattr(method, "propagate", None) == "dense")
    return Need(weight_bytes(model, offloaded), activations, method.working_bytes(largest))


def check(need: Need, what: str, *, resident: int = 0, offload_need: Optional[Need] = None,
          offload_hint: str = "offload") -> None:
    """NotEnoughMemory when ``need`` (minus ``resident`` bytes already in memory) exceeds the
    available memory; the message names ``what``, the need and, with ``offload_need``, what the
    run needs with ``offload_hint``."""
    available = available_bytes()
    if need.total - resident <= available:
        return
    hint = ""
    if offload_need is not None:
        hint = f"; with {offload_hint} (weights on disk, one block in memory) it needs about {gib(offload_need.total)}"
    raise NotEnoughMemory(f"{what} needs about {gib(need.total)} of memory ({need.describe()}), "
                          f"{gib(available + resident)} available{hint}")


def check_prune(model: nn.Module, method, nsamples: int, seqlen: int, batch_size: int, what: str, *,
                offloaded: Optional[bool] = None, resident: int = 0, offload_hint: str = "offload") -> None:
    """NotEnoughMemory when pruning ``model`` with ``method`` (:func:`prune_need`; ``offloaded``
    defaults to whether the model is) exceeds the memory available (:func:`check`, with
    ``resident`` bytes already in memory); when the run is not offloaded and ``method`` can prune
    an offloaded model, the message says what it would need with ``offload_hint``."""
    if offloaded is None:
        offloaded = anatomy.block_store(model) is not None
    need = prune_need(model, method, nsamples, seqlen, batch_size, offloaded=offloaded)
    offload_need = None
    if not offloaded and method.offload_refusal is None:
        offload_need = prune_need(model, method, nsamples, seqlen, batch_size, offloaded=True)
    check(need, what, resident=resident, offload_need=offload_need, offload_hint=offload_hint)


def check_load(directory: str, dtype: torch.dtype) -> None:
    """NotEnoughMemory when the weights of the model in ``directory`` at ``dtype`` exceed the
    available memory (its config alone is read)."""
    from ..io.offload import skeleton
    model = skeleton(directory, dtype)
    check(Need(weight_bytes(model, offloaded=False), 0, 0), f"loading {directory}",
          offload_need=Need(weight_bytes(model, offloaded=True), 0, 0), offload_hint="load_model(..., offload_dir=DIR)")
