"""Where a causal LM keeps its decoder blocks, and how to reach each one with its weights in memory.

The engine, evaluation, saving and offload all walk a model's blocks through these functions; an
offloaded model (:mod:`pyprune.io.offload`) keeps a block store on the model whose blocks are read
one at a time by :func:`resident_blocks`.
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

from torch import nn


#: where decoder families keep their block list, below the decoder module
_BLOCK_PATHS = ("layers", "decoder.layers", "language_model.layers", "model.layers")


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM, looked up under the decoder transformers names
    (``get_decoder()``), then under ``model.model`` and the model itself: ``model.layers`` (Llama,
    Mistral, Qwen, Gemma, Phi-3, Mixtral, ...), ``gpt_neox.layers``, OPT's ``decoder.layers`` and a
    wrapped language model's ``language_model.layers``."""
    get_decoder = getattr(model, "get_decoder", None)
    bases = [get_decoder() if callable(get_decoder) else None, getattr(model, "model", None), model]
    for base in bases:
        if not isinstance(base, nn.Module):
            continue
        for path in _BLOCK_PATHS:
            node = base
            for part in path.split("."):
                node = getattr(node, part, None)
            if isinstance(node, nn.ModuleList) and len(node) > 0:
                return node
    raise ValueError(f"model {type(model).__name__} has no decoder blocks where pyprune looks for them "
                     f"({', '.join(_BLOCK_PATHS)} under its decoder); supported: decoder-only causal LMs "
                     "whose blocks sit in one of those lists")


def block_prefix(model: nn.Module) -> str:
    """Qualified name of the block list, e.g. 'model.layers'."""
    blocks = decoder_blocks(model)
    return next(name for name, module in model.named_modules() if module is blocks)


#: the attribute of a model whose decoder blocks live on disk (:class:`pyprune.io.offload.OffloadedBlocks`)
BLOCK_STORE = "pyprune_block_store"


def block_store(model: nn.Module):
    """The :class:`~pyprune.io.offload.OffloadedBlocks` of an offloaded model; None when its blocks
    are in memory."""
    return getattr(model, BLOCK_STORE, None)


def resident_blocks(model: nn.Module, write: bool = False) -> Iterator[Tuple[int, nn.Module]]:
    """(index, block) of every decoder block with its weights in memory: an offloaded model's
    block is read before it is yielded and freed after (written back first with ``write``)."""
    store = block_store(model)
    for index, block in enumerate(decoder_blocks(model)):
        if store is not None:
            store.fetch(index, block)
        yield index, block
        if store is not None:
            (store.store if write else store.release)(index, block)


def check_materialised(model: nn.Module, what: str) -> None:
    """Refuse (ValueError, one line) a model whose weights are not in memory: parameters or buffers on
    the ``meta`` device (``init_empty_weights``, ``device_map="meta"``) outside the blocks an
    offloaded model keeps on disk."""
    offloaded = set()
    if block_store(model) is not None:
        offloaded = {id(t) for block in decoder_blocks(model) for t in (*block.parameters(), *block.buffers())}
    empty = [name for name, t in (*model.named_parameters(), *model.named_buffers())
             if t.is_meta and id(t) not in offloaded]
    if empty:
        raise ValueError(f"{what}: {len(empty)} tensors of the model are on the meta device (e.g. {empty[0]}), "
                         "so its weights were never loaded; load them first (pyprune.load_model, or "
                         "from_pretrained without a meta device map)")


#: the names an MoE block gives the linear that routes tokens to its experts
ROUTER_NAMES = ("gate", "router")


def _is_router(block: nn.Module, name: str) -> bool:
    """A linear named ``gate``/``router``/``*_gate`` beside an ``experts`` module (Qwen2-MoE's
    ``shared_expert_gate``, routers kept as nn.Linear): it scores tokens, it is never pruned."""
    parent_name, _, own = name.rpartition(".")
    parent = block.get_submodule(parent_name) if parent_name else block
    return hasattr(parent, "experts") and (own in ROUTER_NAMES or own.endswith("_gate"))


def block_linears(block: nn.Module) -> Dict[str, nn.Linear]:
    """The prunable linear layers of a block, by their name inside the block (e.g. 'self_attn.q_proj');
    an MoE block's routers are left out."""
    return {name: module for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and not _is_router(block, name)}


def _scales(module: nn.Module) -> bool:
    """A module without children whose parameters are all 1-D: a norm's scale (and shift)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and next(module.children(), None) is None and all(p.dim() == 1 for p in own)


def unpruned_parameters(block: nn.Module) -> Dict[str, int]:
    """The parameters of a block that no linear-layer method prunes, by name, with their sizes,
    but for the pruned linears' biases and the norms' scales: an MoE block's routers; a hybrid
    block's convolutions and its mixer's state and gate parameters (Mamba2's ``A_log``, ``D``,
    ``dt_bias``); and outside :func:`pyprune.nn.experts.expert_linears` (or for a layout it does not
    reproduce) its experts stored as fused 3-D parameters (the report names them, so that a model's
    measured sparsity is never mistaken for the whole block's)."""
    pruned = {id(p) for linear in block_linears(block).values() for p in linear.parameters(recurse=False)}
    pruned |= {id(p) for module in block.modules() if _scales(module) for p in module.parameters(recurse=False)}
    return {name: parameter.numel() for name, parameter in block.named_parameters() if id(parameter) not in pruned}


def first_tensor(output):
    """A block's hidden states (blocks return a tuple in some transformers versions)."""
    return output[0] if isinstance(output, (tuple, list)) else output
