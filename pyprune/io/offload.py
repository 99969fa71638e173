"""Pruning models larger than RAM: the decoder blocks stay in safetensors files on disk.

:func:`load_offloaded` builds the model with every parameter on the ``meta`` device
(accelerate's ``init_empty_weights``; buffers such as the RoPE frequencies are real), then reads
the weights outside the decoder blocks (embeddings, final norm, LM head) into memory. The blocks
are read on demand, one at a time, from the model's own safetensors files (memory-mapped by
``safe_open``): the block-wise engine (:func:`pyprune.runtime.engine.run_blockwise`,
:func:`pyprune.runtime.engine.resident_blocks`) calls :meth:`OffloadedBlocks.fetch` before it works on a
block and :meth:`OffloadedBlocks.store` after, which writes the block to a safetensors file of
the offload directory and puts its parameters back on ``meta``. Peak memory is then about one
block, the weights outside the blocks and the calibration activations.

:func:`pyprune.save` of such a model writes a normal sharded safetensors checkpoint (one shard per
block, hard-linked from the offload directory when it is on the same file system, plus one for the
rest), which :func:`pyprune.load` and ``from_pretrained`` read like any other.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict

import torch
from torch import nn

from ..files import atomic_path, write_json
from ..nn import anatomy
from .names import model_names
from .manifest import read_config, read_manifest, shape_as_saved_

__all__ = ["OffloadedBlocks", "load_offloaded", "skeleton", "weight_map", "write_weights"]

_INDEX = "model.safetensors.index.json"


def weight_map(directory: str) -> Dict[str, str]:
    """{tensor name: safetensors file} of a model directory (sharded with an index, or one
    ``model.safetensors``); FileNotFoundError naming a missing file."""
    index = os.path.join(directory, _INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            files = json.load(handle)["weight_map"]
        mapping = {name: os.path.join(directory, file) for name, file in files.items()}
    else:
        from safetensors import safe_open
        path = os.path.join(directory, "model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"cannot load {directory}: it holds no model.safetensors nor {_INDEX}")
        with safe_open(path, framework="pt") as handle:
            mapping = {name: path for name in handle.keys()}
    missing = sorted({path for path in mapping.values() if not os.path.isfile(path)})
    if missing:
        raise FileNotFoundError(f"cannot load {directory}: weights file {os.path.basename(missing[0])} is missing")
    return mapping


def skeleton(directory: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``directory`` with every parameter on ``meta`` (no weight is read), shaped
    as its ``pyprune.json`` records (:func:`pyprune.io.manifest.shape_as_saved_`; SparseLinear layers
    stay dense, so sizes are an upper bound)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = read_config(directory)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        shape_as_saved_(model, read_manifest(directory), directory, sparse_layers=False)
    return model.eval()


class OffloadedBlocks:
    """Where the decoder blocks of an offloaded model live: each block's latest weights are in
    the offload directory once stored, in the source files before."""

    def __init__(self, model: nn.Module, sources: Dict[str, str], directory: str, dtype: torch.dtype):
        self.model = model  # its conversions turn a block's checkpoint names into its own (pyprune.io.names)
        self.prefix = anatomy.block_prefix(model)
        self.count = len(anatomy.decoder_blocks(model))
        self.sources = sources
        self.directory = directory
        self.dtype = dtype
        #: {block index: the file holding its stored weights}
        self.stored: Dict[int, str] = {}
        #: {block index: {qualified tensor name: bytes}} of the stored blocks
        self.sizes: Dict[int, Dict[str, int]] = {}

    def _names(self, index: int) -> str:
        return f"{self.prefix}.{index}."

    def fetch(self, index: int, block: nn.Module) -> None:
        """Read block ``index`` into memory (``dtype``) from its latest file, under the model's
        parameter names (an MoE's experts saved one tensor per expert are fused as the model holds them)."""
        from safetensors import safe_open

        prefix = self._names(index)
        if index in self.stored:
            files = [self.stored[index]]
        else:
            files = sorted({path for name, path in self.sources.items() if name.startswith(prefix)})
        state = {}
        for path in files:
            with safe_open(path, framework="pt") as handle:
                state.update({name: handle.get_tensor(name).to(self.dtype)
                              for name in handle.keys() if name.startswith(prefix)})
        state = {name[len(prefix):]: tensor for name, tensor in model_names(self.model, state).items()}
        block.load_state_dict(state, strict=True, assign=True)

    def store(self, index: int, block: nn.Module) -> None:
        """Write block ``index`` to the offload directory (atomically), then free it."""
        from safetensors.torch import save_file

        path = os.path.join(self.directory, f"block-{index:05d}.safetensors")
        state = {self._names(index) + k: v.detach().contiguous() for k, v in block.state_dict().items()}
        with atomic_path(path) as tmp:
            save_file(state, tmp, metadata={"format": "pt"})
        self.stored[index] = path
        self.sizes[index] = {k: v.numel() * v.element_size() for k, v in state.items()}
        self.release(index, block)

    def release(self, index: int, block: nn.Module) -> None:
        """Free block ``index`` without writing it (its parameters back on ``meta``)."""
        block.to("meta")


def load_offloaded(directory: str, dtype: torch.dtype, offload_dir: str) -> nn.Module:
    """The causal LM of ``directory`` with only the weights outside its decoder blocks in memory;
    its blocks are read one at a time by the block-wise engine and written to ``offload_dir``."""

    if not isinstance(offload_dir, (str, os.PathLike)):
        raise TypeError(f"offload_dir must be a directory path (str); got {type(offload_dir).__name__}: "
                        f"{offload_dir!r}")
    offload_dir = os.fspath(offload_dir)
    if read_manifest(directory).get("sparse_layers"):
        raise ValueError(f"cannot offload {directory}: it holds SparseLinear layers; offload reads dense weights")
    if os.path.exists(offload_dir) and not os.path.isdir(offload_dir):
        raise ValueError(f"offload_dir {offload_dir!r} exists and is not a directory")
    sources = weight_map(directory)
    model = skeleton(directory, dtype)
    prefix = anatomy.block_prefix(model) + "."
    from safetensors import safe_open
    rest = {}
    for path in sorted({path for name, path in sources.items() if not name.startswith(prefix)}):
        with safe_open(path, framework="pt") as handle:
            rest.update({name: handle.get_tensor(name).to(dtype) for name in handle.keys()
                         if not name.startswith(prefix)})
    unexpected = model.load_state_dict(model_names(model, rest), strict=False, assign=True).unexpected_keys
    model.tie_weights()
    if unexpected:
        raise ValueError(f"cannot load {directory}: unexpected weights {sorted(unexpected)[:5]}")
    missing = [name for name, p in model.named_parameters() if not name.startswith(prefix) and p.is_meta]
    if missing:
        raise ValueError(f"cannot load {directory}: weights missing from the checkpoint: {missing[:5]}")
    os.makedirs(offload_dir, exist_ok=True)
    setattr(model, anatomy.BLOCK_STORE, OffloadedBlocks(model, sources, offload_dir, dtype))
    return model


def write_weights(model: nn.Module, directory: str) -> None:
    """Write the weights of an offloaded model into ``directory`` as a sharded safetensors
    checkpoint: every block's stored file (blocks never stored are read and stored first), linked
    (or copied across file systems), and the weights outside the blocks in the last shard."""
    from safetensors.torch import save_file

    store: OffloadedBlocks = getattr(model, anatomy.BLOCK_STORE)
    blocks = anatomy.decoder_blocks(model)
    for index, block in enumerate(blocks):
        if index not in store.stored:
            store.fetch(index, block)
            store.store(index, block)
    shards = store.count + 1
    weight_files, total = {}, 0
    for index in range(store.count):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        _link_or_copy(store.stored[index], os.path.join(directory, name))
        for key, size in store.sizes[index].items():
            weight_files[key] = name
            total += size
    rest = _without_tied(model, {key: tensor.detach().contiguous() for key, tensor in model.state_dict().items()
                                 if not key.startswith(store.prefix + ".")})
    name = f"model-{shards:05d}-of-{shards:05d}.safetensors"
    save_file(rest, os.path.join(directory, name), metadata={"format": "pt"})
    weight_files.update({key: name for key in rest})
    total += sum(t.numel() * t.element_size() for t in rest.values())
    write_json(os.path.join(directory, _INDEX), {"metadata": {"total_size": total},
                                                 "weight_map": dict(sorted(weight_files.items()))})
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)


def _without_tied(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` without an output embedding tied to the input embedding (as save_pretrained)."""
    output = model.get_output_embeddings()
    if output is not None and output.weight is model.get_input_embeddings().weight:
        names = [name for name, module in model.named_modules() if module is output]
        for name in names:
            state.pop(f"{name}.weight", None)
    return state


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
