"""Saving and loading pruned models: ``pyprune.save`` / ``pyprune.load``.

Structured pruning changes the shapes of a model's layers, possibly differently in every layer,
and then ``from_pretrained`` fails on the checkpoint (the most common complaint about LLM-Pruner,
Torch-Pruning and FLAP). So a directory written by :func:`save` holds

* the weights as safetensors (``save_pretrained``), the config and the tokenizer, and
* ``pyprune.json``: the ``[out, in]`` shape of every linear layer of every decoder block with its
  query heads, key/value heads, head size and MLP channels, whether one config describes them
  all (``config_compatible``), the :class:`~pyprune.nn.SparseLinear` layers with their N:M
  pattern (``sparse_layers``; their weights are stored compressed, as ``values`` and ``meta``)
  and the MoE experts modules held as such layers (``sparse_experts``: :class:`~pyprune.nn.sparse.SparseExperts`),
  and the pruning report if given, and the model it derives from (``base_model``: hub id, revision,
  license; :func:`pyprune.io.provenance.base_of`),
* ``README.md``, the model card (:mod:`pyprune.io.model_card`), written from ``pyprune.json``,
* ``recipe.yaml``, when given the recipe that produced the model (:mod:`pyprune.io.recipe_file`), and
* for a model whose blocks hold residual rotations (SliceGPT, :mod:`pyprune.nn.rotation`), their
  size (``residual_rotations``); its ``config.json`` states the dense hidden size, so plain
  ``from_pretrained`` refuses the checkpoint (the shapes disagree) rather than drop the rotations.

:func:`load` rebuilds the architecture from the config, resizes each block to the recorded
shapes (:mod:`pyprune.nn.compact`) and loads the weights strictly: the model it returns is the
saved one, to the bit, with the same SparseLinear layers. When every block has the same sizes (e.g. after
``Structured(ratio, uniform=True)``) the saved config states those sizes, so plain
``AutoModelForCausalLM.from_pretrained(directory)`` loads the model too (unless it holds
SparseLinear layers); otherwise the config keeps the dense sizes and only :func:`load` can, and
the saved ``config.json`` is marked (:func:`pyprune.io.manifest.mark_config`) so that plain
transformers refuses it with an error that says to use ``pyprune.load`` rather than load wrong
shapes or random weights.

Writing is atomic: everything goes into a temporary directory next to the target, ``pyprune.json``
last, and the directory is renamed into place. A failure leaves no output directory behind.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..files import check_destination, make_temp_dir, standard_modes, write_json
from ..nn import anatomy, rotation, sparse
from . import model_card, offload, provenance
from .names import model_names
from .recipe_file import write_recipe
from .manifest import (_FORMAT_VERSION, MANIFEST, _json_safe, mark_config, read_config, read_manifest, read_tokenizer,
                       shape_as_saved_)
from ..nn.layout import block_layout, check_block, config_accepts, config_fields

__all__ = ["save", "load", "check_weights", "model_layout", "config_compatible"]



def model_layout(model: nn.Module) -> Dict[str, Any]:
    """The per-block sizes of ``model`` and whether one config can describe them.

    ``layers`` is None when the blocks are not LLaMA-style (their shapes are then not recorded and
    must match the config, as for any dense model)."""
    try:
        blocks = anatomy.decoder_blocks(model)
        for index, block in enumerate(blocks):
            check_block(block, f"block {index}")
    except ValueError:
        return {"layers": None, "config_compatible": True, "config_fields": None}
    layouts = [block_layout(block) for block in blocks]
    fields = config_fields(blocks)
    if not config_accepts(getattr(model, "config", None), fields):
        fields = None
    return {"layers": layouts, "config_compatible": fields is not None, "config_fields": fields}


def config_compatible(model: nn.Module) -> bool:
    """Whether :func:`save` would write ``model`` as an ordinary checkpoint that plain
    ``from_pretrained`` reads as intended: one config describes every block, no layer is a
    SparseLinear (stored compressed) and no residual carries a rotation (SliceGPT)."""
    return _compatible(model_layout(model), sparse.sparse_layers(model), rotation.residual_rotations(model))


def _compatible(layout: Dict[str, Any], sparse_layers, rotations) -> bool:
    return layout["config_compatible"] and not sparse_layers and rotations is None


def _nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.scandir(path))


def _check_target(directory: str, overwrite: bool) -> None:
    """``directory`` may receive a saved model: a place pyprune may write
    (:func:`pyprune.files.check_destination`), absent or empty, or with ``overwrite`` a directory
    pyprune saved (it holds a ``pyprune.json``): a directory of other files is never replaced."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"cannot save to {directory}: it exists and is not a directory")
    check_destination(directory, "save directory", directory=True)
    if not _nonempty_dir(directory):
        return
    if not overwrite:
        raise FileExistsError(f"cannot save to {directory}: the directory exists and is not empty "
                              f"(pass overwrite=True to replace it)")
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        raise FileExistsError(f"cannot save to {directory}: it holds files pyprune did not write (no {MANIFEST}); "
                              "overwrite=True replaces only a directory pyprune.save wrote")


def _move_into_place(tmp: str, directory: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``directory`` (replacing an empty one, or with ``overwrite``
    a non-empty one via a renamed backup that is deleted afterwards)."""
    _check_target(directory, overwrite)
    standard_modes(tmp)
    if not _nonempty_dir(directory):
        os.replace(tmp, directory)  # a missing or empty target directory is replaced atomically
        return
    parent, base = os.path.split(os.path.abspath(directory))
    backup = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:8]}")
    os.rename(directory, backup)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(backup, directory)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def save(model: nn.Module, tokenizer, directory: str, report: Optional[Dict] = None, *,
         overwrite: bool = False, max_shard_size: str = "5GB", recipe: Optional[Dict] = None) -> Dict[str, Any]:
    """Write ``model`` (pruned or not), ``tokenizer`` (or None), ``pyprune.json``, the model card
    ``README.md`` and, when given, the ``recipe`` that produced it (``recipe.yaml``, :mod:`pyprune.recipes`)
    to ``directory``, atomically; returns what ``pyprune.json`` records (without the report).
    ``directory`` must be a place pyprune may write (not a link or device; see
    :func:`pyprune.files.check_destination`).

    An offloaded model (:mod:`pyprune.io.offload`) is written one block per shard, from the blocks its
    offload directory holds. Refuses (FileExistsError) an existing non-empty directory unless
    ``overwrite=True``, and even then one that holds no ``pyprune.json``. When the
    blocks' sizes are uniform the saved config states them, so plain ``from_pretrained`` loads
    the result; ``config_compatible`` in the returned dict / ``pyprune.json`` says whether it does.
    The model itself is not modified.
    """
    if not hasattr(model, "save_pretrained") or getattr(model, "config", None) is None:
        raise TypeError(f"save needs a transformers model with a config and save_pretrained; "
                        f"got {type(model).__name__}")
    directory = os.fspath(directory)
    anatomy.check_materialised(model, f"saving to {directory}")
    _check_target(directory, overwrite)
    layout = model_layout(model)
    sparse_layers = sparse.sparse_layers(model)
    sparse_experts = sparse.sparse_experts(model)
    rotations = rotation.residual_rotations(model)
    tmp = make_temp_dir(directory)
    try:
        if anatomy.block_store(model) is not None:
            offload.write_weights(model, tmp)  # one shard per block, as the offloaded blocks are stored
        else:
            model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
        if layout["config_fields"]:
            config.update(layout["config_fields"])
        if rotations is not None:  # the dense width: from_pretrained's shapes disagree, only load() rebuilds it
            config["hidden_size"] = rotations["dense_hidden_size"]
        compatible = _compatible(layout, sparse_layers, rotations)
        write_json(config_path, config if compatible else mark_config(config), sort_keys=True)
        manifest = {
            "format": "pyprune", "version": _FORMAT_VERSION,
            "architecture": type(model).__name__,
            "config_compatible": compatible,
            "layers": layout["layers"],
            "sparse_layers": sparse_layers,
            "sparse_experts": sparse_experts,
            "residual_rotations": rotations,
            "base_model": provenance.base_of(model),
        }
        if recipe is not None:
            write_recipe(tmp, recipe)
        recorded = dict(manifest, report=_json_safe(report))
        model_card.write(tmp, recorded, os.path.basename(os.path.abspath(directory)))
        write_json(os.path.join(tmp, MANIFEST), recorded, indent=1)
        _move_into_place(tmp, directory, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def check_weights(directory: str) -> None:
    """ValueError naming the first safetensors file of ``directory`` that is not whole: its header
    unreadable, or the file shorter than its header says (e.g. a copy cut short). Reads headers only."""
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                if not 0 < length <= size - 8:
                    raise ValueError(f"a header of {length} bytes in a file of {size}")
                header = json.loads(handle.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
        if 8 + length + end > size:
            raise ValueError(f"{path} is truncated: {size} bytes, its header describes {8 + length + end}")


def _state_dict(directory: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"cannot load {directory}: weights file {name} is missing")
        state.update(load_file(path))
    return state


def _init_context():
    try:
        from transformers.initialization import no_init_weights
        return no_init_weights()
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
        return no_init_weights()


def load(directory: str, dtype: Optional[torch.dtype] = None, device="cpu") -> Tuple[nn.Module, Any]:
    """Load a model written by :func:`save` (or any local causal-LM directory with safetensors
    weights) as ``(model, tokenizer)``; the tokenizer is None when none was saved.

    The blocks get the shapes recorded in ``pyprune.json`` and the weights load strictly, so the
    model is exactly the saved one (same logits). ``dtype`` (default: the saved weights' dtype) and
    ``device`` place it. Returned in eval mode. Non-persistent buffers (the RoPE frequencies) are
    not saved; they are rebuilt as transformers builds them (fp32, as ``from_pretrained`` does).
    """
    from transformers import AutoModelForCausalLM

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot load {directory}: no such directory")
    manifest = read_manifest(directory)
    state = _state_dict(directory)
    if dtype is None:
        dtypes = [t.dtype for t in state.values() if t.is_floating_point()]
        dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    config = read_config(directory)
    with _init_context():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # weight init (which also ties) was skipped
    shape_as_saved_(model, manifest, directory)
    _load_strict(model, model_names(model, state), directory)
    model.to(device)
    model.eval()
    tokenizer = None
    if any(os.path.isfile(os.path.join(directory, name))
           for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = read_tokenizer(directory)
    return model, tokenizer


@torch.no_grad()
def _load_strict(model: nn.Module, state: Dict[str, torch.Tensor], directory: str) -> None:
    """load_state_dict, strict except for parameters tied to a loaded one (e.g. a tied lm_head,
    which save_pretrained does not store)."""
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"cannot load {directory}: unexpected weights {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ValueError(f"cannot load {directory}: weight {name} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(own[name].shape)}")
    loaded = {id(own[name]) for name in state}
    untied = sorted(name for name, value in own.items() if name not in state and id(value) not in loaded)
    if untied:
        raise ValueError(f"cannot load {directory}: weights missing from the checkpoint: {untied[:5]}")
    model.load_state_dict(state, strict=False)
