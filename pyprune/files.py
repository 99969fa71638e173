"""The files pyprune owns, at the bottom of the package: where its cache lives and how a file is
written atomically. Every layer that writes (the dispatch cache of :mod:`pyprune.nn`, states and
checkpoints of :mod:`pyprune.io.storage`, saved models, reports, model and task caches) goes
through these.

* :func:`cache_root`: ``$PYPRUNE_CACHE`` if set, else ``~/.cache/pyprune``.
* Atomic writes: every file or directory is written under a temporary name next to its target and
  renamed into place (:func:`atomic_path`, :func:`write_json`, :func:`make_temp_dir`). A temporary
  name is ``.<target>.pyprune-tmp-<host>-<pid>-<random>``: the next write into the same directory
  removes those whose process is gone (:func:`remove_stale`), never a live run's.
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
from functools import lru_cache
from typing import Iterator, Optional

__all__ = ["cache_root", "atomic_path", "write_json", "make_temp_dir", "remove_stale", "temp_path", "TEMP_TAG"]

#: what every temporary name pyprune writes contains
TEMP_TAG = ".pyprune-tmp-"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMP_NAME = re.compile(rf"^\..+{re.escape(TEMP_TAG)}(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-[0-9a-f]{{8}}$")


def cache_root() -> str:
    """``$PYPRUNE_CACHE`` if set, else ``~/.cache/pyprune``: models, tasks and the dispatch cache."""
    return _cache_root(os.environ.get("PYPRUNE_CACHE"))


@lru_cache(maxsize=8)
def _cache_root(root: Optional[str]) -> str:  # memoised: SparseLinear asks on every auto forward
    return os.path.abspath(os.path.expanduser(root)) if root else \
        os.path.join(os.path.expanduser("~"), ".cache", "pyprune")


def temp_path(target: str) -> str:
    """A fresh temporary name next to ``target`` that carries this process's PID."""
    parent, base = os.path.split(os.path.abspath(os.fspath(target)))
    return os.path.join(parent, f".{base}{TEMP_TAG}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


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
