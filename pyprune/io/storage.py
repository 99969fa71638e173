"""States and checkpoints: safetensors files whose JSON metadata holds the rest
(:func:`save_state`, :func:`read_state_meta`, :func:`load_state`), written atomically
(:mod:`pyprune.files`); nothing pyprune reads from a user path is unpickled. Each records the
``key`` of the run that made it (settings, model, calibration); :func:`check_key` refuses another
run's, naming what differs. Resumable runs are built on them in :mod:`pyprune.runtime.checkpoint`.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..files import atomic_path

__all__ = ["save_state", "read_state_meta", "load_state", "check_key", "StateError"]

_META = "pyprune"


class StateError(ValueError):
    """A state or checkpoint file that is not one pyprune wrote, or one of another run."""


# -- states and checkpoints --------------------------------------------------------------------------

def save_state(path: str, tensors: Dict[str, Tensor], meta: dict) -> None:
    """Write ``tensors`` and the JSON-serialisable ``meta`` (with its ``kind``, ``format`` and
    ``key``) to the safetensors file ``path``, atomically. Tensors sharing one storage (tied
    weights) are stored once and restored as aliases."""
    from safetensors.torch import save_file
    stored, aliases, seen = {}, {}, {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype, tensor.device)
        if tensor.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        tensor = tensor.contiguous().cpu()
        whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        stored[name] = tensor if whole else tensor.clone()  # safetensors refuses views of a larger storage
    header = json.dumps(dict(meta, aliases=aliases))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(stored, tmp, metadata={_META: header})


def read_state_meta(path: str, kind: str, formats: Sequence[int]) -> dict:
    """The metadata of the state file ``path`` (its header only; no tensor is read). StateError
    when it is not a pyprune ``kind`` file of one of ``formats`` (e.g. truncated, or a pickle)."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as handle:
            header = (handle.metadata() or {}).get(_META)
    except Exception as error:  # safetensors raises its own error type for a broken file
        raise StateError(f"{path} is not a readable safetensors state ({_first_line(error)}); remove it") from None
    try:
        meta = json.loads(header) if header is not None else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("kind") != kind:
        raise StateError(f"{path} is not a pyprune {kind} file; remove it or choose another path")
    if meta.get("format") not in formats:
        raise StateError(f"{path} has {kind} format {meta.get('format')!r}; this pyprune reads format "
                         f"{', '.join(map(str, formats))}")
    return meta


def load_state(path: str, kind: str, formats: Sequence[int], device="cpu") -> Tuple[Dict[str, Tensor], dict]:
    """(tensors, metadata) of the state file ``path`` (checked as :func:`read_state_meta` does)."""
    from safetensors.torch import load_file
    meta = read_state_meta(path, kind, formats)
    try:
        tensors = load_file(path, device=str(device))
    except Exception as error:
        raise StateError(f"{path} is not a readable safetensors state ({_first_line(error)}); remove it") from None
    for alias, name in meta.pop("aliases", {}).items():
        tensors[alias] = tensors[name]
    return tensors, meta


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def check_key(where: str, stored: dict, expected: dict, parts: Optional[Sequence[str]] = None) -> None:
    """StateError when the ``stored`` key of a state or checkpoint (``where``) differs from this
    run's ``expected`` key, in ``parts`` of it if given (e.g. the settings alone, before the model
    is loaded). The message names the settings that differ, or the model / calibration."""
    names = list(expected) if parts is None else list(parts)
    reasons = []
    for name in names:
        old, new = stored.get(name), expected.get(name)
        if _canonical(old) == _canonical(new):
            continue
        if name == "model":
            reasons.append("another model (its config, dtype or embeddings differ)")
        elif name == "calibration":
            reasons.append("other calibration data")
        else:
            changed = _differences(old, new, name)
            reasons.append("other settings: " + ", ".join(f"{k} {a!r} (now {b!r})" for k, a, b in changed))
    if reasons:
        raise StateError(f"{where} was made with {'; '.join(reasons)}; remove it or choose another path")


def _canonical(value):
    return json.loads(json.dumps(value))


def _differences(old, new, name: str) -> list:
    """(leaf name, stored, now) of every differing leaf of two JSON values."""
    old, new = _canonical(old), _canonical(new)
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(key), new.get(key), key) if old.get(key) != new.get(key)]
    return [(name, old, new)]
