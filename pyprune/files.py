"""The files pyprune owns, at the bottom of the package: where its cache lives and how a file is
written atomically. Every layer that writes (the dispatch cache of :mod:`pyprune.nn`, states and
checkpoints of :mod:`pyprune.io.storage`, saved models, reports, model and task caches) goes
through these.

* :func:`cache_root`: ``$PYPRUNE_CACHE`` if set, else ``~/.cache/pyprune``.
* Atomic writes: every file or directory is written under a temporary name next to its target and
  renamed into place (:func:`atomic_path`, :func:`write_json`, :func:`write_text`, :func:`make_temp_dir`);
  :func:`locked` serialises the runs that re-read, merge and rewrite one file. A temporary
  name is ``.<target>.pyprune-tmp-<host>-<pid>-<random>``: the next write into the same directory
  removes those whose process is gone (:func:`remove_stale`), never a live run's. What is renamed into
  place gets the modes a plain ``open`` would give under the umask (:func:`standard_modes`): some
  writers (safetensors) create their files 0600.
* What may be replaced (:func:`check_destination`): a destination is written only when it is
  absent, a regular file (a file target) or a directory (a directory target). A device, fifo or
  socket, and a symbolic link, are refused: the rename would replace the node or the link itself
  (``--report /dev/full`` run as root would turn the device into a JSON file), never write where
  the link points. The check also refuses an empty path, a path inside or above the input model
  (``protect``), and a place where nothing can be created (a parent that is a file, a read-only
  or pseudo file system), by creating and removing a temporary file there, so the answer is what
  the real write would meet, for root too. Callers run it before any work;
  :func:`atomic_path` repeats the node check just before it replaces the target.
* The cache (:func:`cache_dir`): a directory under :func:`cache_root` that cannot be created or
  written is a :class:`CacheError` naming ``PYPRUNE_CACHE``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import uuid
from functools import lru_cache
from typing import Iterator, Optional

__all__ = ["cache_root", "cache_dir", "ensure_cache_dir", "atomic_path", "write_json", "write_text", "locked",
           "make_temp_dir", "remove_stale", "temp_path", "standard_modes",
           "check_destination", "DestinationError", "CacheError", "TEMP_TAG"]

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


class DestinationError(ValueError):
    """A path pyprune was asked to write that it must not replace or cannot create."""


class CacheError(ValueError):
    """The cache directory (``$PYPRUNE_CACHE`` or ``~/.cache/pyprune``) cannot be used."""


def cache_dir(*parts: str) -> str:
    """The directory ``parts`` under :func:`cache_root`, created if needed; :class:`CacheError`
    naming ``PYPRUNE_CACHE`` when it cannot be created or written."""
    return ensure_cache_dir(os.path.join(cache_root(), *parts))


def ensure_cache_dir(directory: str) -> str:
    """Create ``directory`` (a place in the cache) and check that files can be created in it;
    :class:`CacheError` naming ``PYPRUNE_CACHE`` otherwise."""
    try:
        os.makedirs(directory, exist_ok=True)
        _probe(directory)
    except OSError as error:
        setting = (f"PYPRUNE_CACHE={os.environ['PYPRUNE_CACHE']}" if os.environ.get("PYPRUNE_CACHE")
                   else f"the cache {cache_root()} (PYPRUNE_CACHE unset)")
        raise CacheError(f"{setting} is not usable: cannot write {directory} ({_reason(error)}); set PYPRUNE_CACHE "
                         "to a writable directory") from None
    return directory


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def _probe(directory: str) -> None:
    """Create and remove a temporary file in ``directory`` (OSError when that is impossible)."""
    probe = temp_path(os.path.join(directory, "write-check"))
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.unlink(probe)


def _node_problem(path: str, directory: bool) -> Optional[str]:
    """Why the existing ``path`` must not be replaced by a written file (or directory), or None."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is a file: reported by the writability check
    if stat.S_ISLNK(info.st_mode):
        return (f"is a symbolic link (to {os.readlink(path)}); pyprune replaces files, it would replace the "
                "link; give the real path")
    if directory:
        return None if stat.S_ISDIR(info.st_mode) else "exists and is not a directory"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory; give the path of a file"
    if not stat.S_ISREG(info.st_mode):
        kind = ("a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "a fifo" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode)
                else "not a regular file")
        return f"is {kind}; pyprune writes regular files only, it would replace it"
    return None


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def check_destination(path, what: str, *, directory: bool = False, protect=()) -> str:
    """Check, before any work, that pyprune may write the file (or with ``directory`` the
    directory) ``path``; returns its absolute path. :class:`DestinationError`, a one-line message
    starting with ``what`` (e.g. ``--report``), when ``path`` is empty; exists and is a symbolic
    link, a device, fifo or socket, or (a file target) a directory or (a directory target) a file;
    lies inside one of the directories ``protect`` (e.g. the input model) or is one of them or a
    parent of one; or when nothing can be created where it goes (its nearest existing ancestor is
    not a writable directory: under a file, read-only, /proc). Missing parents are allowed: the
    writers create them."""
    if path is None or not os.fspath(path).strip():
        raise DestinationError(f"{what} is empty; give a path")
    path = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(path))
    problem = _node_problem(full, directory)
    if problem:
        raise DestinationError(f"{what} {path} {problem}")
    real = os.path.realpath(full)
    for protected in protect:
        if protected is None:
            continue
        protected = os.path.realpath(os.fspath(protected))
        if _within(real, protected) or _within(protected, real):
            where = "is inside" if real != protected and _within(real, protected) else \
                "is" if real == protected else "contains"
            raise DestinationError(f"{what} {path} {where} the input model {protected}; write somewhere else")
    ancestor = os.path.dirname(full)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise DestinationError(f"{what} {path}: {ancestor} is a file, not a directory")
    try:
        _probe(ancestor)
    except OSError as error:
        raise DestinationError(f"{what} {path}: cannot create files in {ancestor} ({_reason(error)})") from None
    return full


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
    """Remove a temporary file or directory; a failure here never hides the error being handled."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def atomic_path(target: str) -> Iterator[str]:
    """Yield a temporary path next to ``target`` (its missing parents created) to write; when the
    block ends it replaces ``target`` (a file), and when it raises it is removed. A ``target`` that exists and is not a
    regular file (a device, fifo, socket, directory or symbolic link) is refused
    (:class:`DestinationError`), before the block runs and again before the rename."""
    target = os.fspath(target)
    _refuse_node(target)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)  # missing parents, as mkdir -p
    remove_stale(os.path.dirname(os.path.abspath(target)))
    tmp = temp_path(target)
    try:
        yield tmp
        _refuse_node(target)
        standard_modes(tmp)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def standard_modes(path: str) -> None:
    """Give ``path`` (a file, or a directory and everything in it) the modes ``open`` and ``mkdir``
    give under the process's umask (0644 and 0755 under the usual 022), before it is renamed into
    place."""
    mask = _umask()
    if not os.path.isdir(path) or os.path.islink(path):
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, names in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _refuse_node(target: str) -> None:
    problem = _node_problem(os.path.abspath(target), directory=False)
    if problem:
        raise DestinationError(f"{target} {problem}")


def write_json(path: str, payload, **dump_options) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (``dump_options`` go to :func:`json.dump`)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, **({"indent": 2} | dump_options))
        handle.write("\n")


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (through ``path``.lock) for the block: concurrent runs that
    re-read a file, merge their part and rewrite it do so one at a time."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_temp_dir(target: str) -> str:
    """A new empty temporary directory next to ``target`` (stale ones of dead runs removed first)."""
    parent = os.path.dirname(os.path.abspath(os.fspath(target)))
    os.makedirs(parent, exist_ok=True)
    remove_stale(parent)
    path = temp_path(target)
    os.mkdir(path)
    return path
