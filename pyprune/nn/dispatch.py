"""Which backend runs a :class:`~pyprune.nn.SparseLinear` forward, from measurements.

The table (``dispatch_table.json`` next to this file, or the file named by
``PYPRUNE_DISPATCH_TABLE``) is written by ``benchmarks/bench_sparse_linear.py --write-dispatch``.
A row is keyed by the machine (on a CPU: the instruction set the native kernels use and the CPU
model; on a GPU: its name), dtype, N:M pattern, weight-size bucket (out·in rounded up to a power
of two) and token bucket (1, 2, 4, 8 — the CPU kernel's code paths — or ``many``), and names the
sparse backend that measured at least :data:`MIN_SPEEDUP` times as fast as dense ``F.linear`` there,
or ``dense``. Where no row matches, the layer runs dense (:data:`FALLBACK_BACKEND`): sparse is
never chosen without a measurement saying it pays on this machine.
"""
from __future__ import annotations

import json
import os
import platform
from functools import lru_cache
from typing import Dict, Optional

import torch

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


def lookup(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int,
           in_features: int, tokens: int) -> Optional[str]:
    """The measured backend for this case, or None when the table has no row for it."""
    entry = table().get("entries", {}).get(entry_key(
        device_key(device), dtype, pattern, shape_bucket(out_features, in_features), token_bucket(tokens)))
    return None if entry is None else entry["backend"]


def sparse_pays(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int, in_features: int,
                tokens: int) -> bool:
    """Whether the table names a sparse backend for this case: a layer that would only run ``dense``
    there is faster, and smaller in memory, left an nn.Linear."""
    return lookup(device, dtype, pattern, out_features, in_features, tokens) not in (None, "dense")
