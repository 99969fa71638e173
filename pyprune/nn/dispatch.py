"""Which backend runs a :class:`~pyprune.nn.SparseLinear` forward, from measurements.

The table (``dispatch_table.json`` next to this file, or the file named by
``PYPRUNE_DISPATCH_TABLE``) is written by ``benchmarks/bench_sparse_linear.py --write-dispatch``.
A row is keyed by the machine (on a CPU: the instruction set the native kernels use and the CPU
model; on a GPU: its name), dtype, N:M pattern, weight-size bucket (out·in rounded up to a power
of two) and token bucket (1, 2, 4, 8 — the CPU kernel's code paths — or ``many``), and names the
sparse backend that measured at least :data:`MIN_SPEEDUP` times as fast as dense ``F.linear`` there,
or ``dense``.

That table is a prior shipped with pyprune; measurements taken where pyprune runs override it. The
per-user cache (``$PYPRUNE_CACHE/dispatch/<key>.json``, default cache root ``~/.cache/pyprune``)
holds them, one file per environment (:func:`environment`: the machine key, torch and pyprune
versions, thread count), so another CPU, torch, pyprune or thread count measures afresh. It is
written by :func:`record` (under a file lock, atomically: concurrent tuners never leave a partial
file and keep each other's answers) and filled by :mod:`pyprune.nn.tuning`. Where neither the cache
nor the table has the case (and tuning is off or cannot run), the layer runs dense
(:data:`FALLBACK_BACKEND`): sparse is never chosen without a measurement saying it pays here.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from functools import lru_cache
from typing import Dict, Optional, Tuple

import torch

from .. import __version__
from ..files import cache_root, ensure_cache_dir, write_json

#: Every SparseLinear backend. ``kernel``: pyprune.ops.nm_linear (Triton on GPU, C++ on CPU);
#: ``dense``: F.linear on the weight decompressed once and cached (cuBLAS/MKL/oneDNN);
#: ``cusparselt`` / ``cutlass``: torch's 2:4 semi-structured tensors; ``mma_sp``: pyprune's CUDA
#: 2:4 sparse tensor-core GEMM.
BACKENDS = ("kernel", "dense", "cusparselt", "cutlass", "mma_sp")
#: The backend of graphs under torch.compile (the table lookup reads a file) and of gradients.
DEFAULT_BACKEND = "kernel"
#: The backend where the table has no row for the case: never slower than dense.
FALLBACK_BACKEND = "dense"
#: A sparse backend enters the table only where it measured at least this speedup over dense.
MIN_SPEEDUP = 1.05
#: Token counts up to the last are rounded up to the next one; more are ``many``.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_table.json")


def device_key(device: torch.device) -> str:
    """``cpu/<isa>/<model>`` (e.g. ``cpu/avx2/AMD EPYC``), or the CUDA device's name."""
    device = torch.device(device)
    return _device_name(device.type, device.index)


def cpu_isa() -> str:
    """The instruction set pyprune's native CPU kernels run with here: ``avx2`` (AVX2+FMA+F16C,
    detected at run time) or ``generic`` (``none`` without the native extension)."""
    from ..ops import backend
    native = backend.native_module("cpu")
    if native is None:
        return "none"
    return "avx2" if native.cpu_has_avx2_fma_f16c() else "generic"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def _device_name(kind: str, index: Optional[int]) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name(index)
    return f"cpu/{cpu_isa()}/{cpu_model()}" if kind == "cpu" else kind


def token_bucket(tokens: int) -> str:
    return next((str(b) for b in TOKEN_BUCKETS if tokens <= b), "many")


def shape_bucket(out_features: int, in_features: int) -> str:
    return f"2^{max(out_features * in_features - 1, 0).bit_length()}"


def entry_key(device: str, dtype: torch.dtype, pattern: str, shape: str, tokens: str) -> str:
    return f"{device}|{str(dtype).replace('torch.', '')}|{pattern}|{shape}|{tokens}"


def table_path() -> str:
    return os.environ.get("PYPRUNE_DISPATCH_TABLE") or TABLE_PATH


@lru_cache(maxsize=8)
def _load(path: str) -> Dict:
    if not os.path.isfile(path):
        return {"entries": {}}
    with open(path, encoding="utf-8") as handle:
        table = json.load(handle)
    for key, entry in table.get("entries", {}).items():
        if entry.get("backend") not in BACKENDS:
            raise ValueError(f"dispatch table {path}: entry {key!r} names backend "
                             f"{entry.get('backend')!r}; allowed: {', '.join(BACKENDS)}")
    return table


def table() -> Dict:
    return _load(table_path())


def case_key(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int, in_features: int,
             tokens: int) -> str:
    """The table and cache key of a layer's forward of ``tokens`` tokens."""
    return entry_key(device_key(device), dtype, pattern, shape_bucket(out_features, in_features),
                     token_bucket(tokens))


#: Where a layer's backend came from: the per-user cache, the shipped table (the prior), a
#: measurement taken on first use, or no measurement at all (dense).
SOURCES = ("cache", "prior", "measured", "fallback")


def answer(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int,
           in_features: int, tokens: int) -> Optional[Tuple[str, str]]:
    """(backend, source) measured for this case: the per-user cache's answer (source ``cache``),
    else the shipped table's (``prior``), else None."""
    key = case_key(device, dtype, pattern, out_features, in_features, tokens)
    entry = cached_entries(device).get(key)
    if entry is not None:
        return entry["backend"], "cache"
    entry = table().get("entries", {}).get(key)
    return None if entry is None else (entry["backend"], "prior")


def lookup(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int,
           in_features: int, tokens: int) -> Optional[str]:
    """The measured backend for this case (see :func:`answer`), else None."""
    found = answer(device, dtype, pattern, out_features, in_features, tokens)
    return None if found is None else found[0]


# -- the per-user cache of measurements ------------------------------------------------------------

def environment(device: torch.device) -> Dict:
    """What a measurement depends on besides the case: the machine key, torch and pyprune versions
    and torch's thread count (more threads move the point where sparse pays)."""
    return {"device": device_key(device), "torch": torch.__version__, "pyprune": __version__,
            "threads": torch.get_num_threads()}


def cache_path(device: torch.device) -> str:
    """The cache file of this environment: a name derived from every part of :func:`environment`."""
    digest = hashlib.sha256(json.dumps(environment(device), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "dispatch", f"{digest}.json")


def _read_cache(path: str, env: Dict) -> Dict:
    """The cache file's entries; an absent, unreadable or other environment's file holds none."""
    try:
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(payload, dict) or payload.get("environment") != env:
        return {}
    entries = payload.get("entries")
    return {k: v for k, v in entries.items() if isinstance(v, dict) and v.get("backend") in BACKENDS} \
        if isinstance(entries, dict) else {}


@lru_cache(maxsize=16)
def _read_cache_version(path: str, env_json: str, stamp: tuple) -> Dict:
    return _read_cache(path, json.loads(env_json))


def cached_entries(device: torch.device) -> Dict:
    """{case key: entry} measured in this environment (re-read when the file changes)."""
    path = cache_path(device)
    try:
        info = os.stat(path)
    except OSError:
        return {}
    return _read_cache_version(path, json.dumps(environment(device), sort_keys=True),
                               (info.st_mtime_ns, info.st_size, info.st_ino))


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on ``path + '.lock'`` (POSIX; elsewhere the atomic rename alone)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path + ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record(device: torch.device, entries: Dict[str, Dict]) -> str:
    """Add ``entries`` ({case key: entry with ``backend``}) to this environment's cache file:
    under the lock the file is re-read, merged and replaced by a complete new file (written to a
    temporary name beside it, then renamed), so readers never see a partial file and concurrent
    writers keep each other's answers. Returns the file's path."""
    for key, entry in entries.items():
        if entry.get("backend") not in BACKENDS:
            raise ValueError(f"entry {key!r}: backend must be one of {', '.join(BACKENDS)}; "
                             f"got {entry.get('backend')!r}")
    path, env = cache_path(device), environment(device)
    ensure_cache_dir(os.path.dirname(path))
    with _locked(path):
        merged = dict(_read_cache(path, env), **entries)
        write_json(path, {"environment": env, "entries": dict(sorted(merged.items()))})
    return path
