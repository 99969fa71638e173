"""How pyprune writes and reads the files it owns.

* Atomic writes: every file or directory is written under a temporary name next to its target and
  renamed into place (:func:`atomic_path`, :func:`write_json`, :func:`make_temp_dir`). A temporary
  name is ``.<target>.pyprune-tmp-<host>-<pid>-<random>``: the next write into the same directory
  removes those whose process is gone (:func:`remove_stale`), never a live run's.
* States and checkpoints are safetensors files whose JSON metadata holds the rest
  (:func:`save_state`, :func:`read_state_meta`, :func:`load_state`): nothing pyprune reads from a
  user path is unpickled. Each records the ``key`` of the run that made it (settings, model,
  calibration); :func:`check_key` refuses another run's, naming what differs. Resumable runs are
  built on them in :mod:`pyprune.runtime.checkpoint`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["atomic_path", "write_json", "make_temp_dir", "remove_stale", "temp_path", "save_state",
           "read_state_meta", "load_state", "check_key", "StateError"]

_TAG = ".pyprune-tmp-"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMP_NAME = re.compile(rf"^\..+{re.escape(_TAG)}(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-[0-9a-f]{{8}}$")
_META = "pyprune"


class StateError(ValueError):
    """A state or checkpoint file that is not one pyprune wrote, or one of another run."""


# -- atomic writes ---------------------------------------------------------------------------------

def temp_path(target: str) -> str:
    """A fresh temporary name next to ``target`` that carries this process's PID."""
    parent, base = os.path.split(os.path.abspath(os.fspath(target)))
    return os.path.join(parent, f".{base}{_TAG}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(directory: str) -> list:
    """Remove the temporaries in ``directory`` left by pyprune processes of this host that are no
    longer running; returns their paths."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or match["host"] != _HOST or _alive(int(match["pid"])):
            continue
        _remove(entry.path)
        removed.append(entry.path)
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def atomic_path(target: str) -> Iterator[str]:
    """Yield a temporary path next to ``target`` to write; when the block ends it replaces
    ``target`` (a file), and when it raises it is removed."""
    target = os.fspath(target)
    remove_stale(os.path.dirname(os.path.abspath(target)))
    tmp = temp_path(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def write_json(path: str, payload, **dump_options) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (``dump_options`` go to :func:`json.dump`)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, **({"indent": 2} | dump_options))
        handle.write("\n")


def make_temp_dir(target: str) -> str:
    """A new empty temporary directory next to ``target`` (stale ones of dead runs removed first)."""
    parent = os.path.dirname(os.path.abspath(os.fspath(target)))
    os.makedirs(parent, exist_ok=True)
    remove_stale(parent)
    path = temp_path(target)
    os.mkdir(path)
    return path


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
