"""Which backend runs a :class:`~pyprune.nn.SparseLinear` forward, from measurements.

The table (``dispatch_table.json`` next to this file, or the file named by
``PYPRUNE_DISPATCH_TABLE``) is written by ``benchmarks/bench_sparse_linear.py --write-dispatch``:
for each device, dtype, N:M pattern and shape class it names the backend that was fastest over
the benchmark's shapes of that class, among the backends whose output matched the dense masked
matmul in the same run. A shape class is ``decode`` (at most ``decode_max_tokens`` rows of x) or
``prefill``. Where the table has no entry the compressed-form kernel (``kernel``) runs: it always
works and never keeps a dense copy.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Dict, Optional

import torch

#: Every SparseLinear backend. ``kernel``: pyprune.ops.nm_linear (Triton on GPU, C++ on CPU);
#: ``dense``: decompress, then F.linear (cuBLAS/MKL); ``cusparselt`` / ``cutlass``: torch's 2:4
#: semi-structured tensors; ``mma_sp``: pyprune's CUDA 2:4 sparse tensor-core GEMM.
BACKENDS = ("kernel", "dense", "cusparselt", "cutlass", "mma_sp")
DEFAULT_BACKEND = "kernel"
DEFAULT_DECODE_MAX_TOKENS = 16
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_table.json")


def device_key(device: torch.device) -> str:
    """``cpu``, or the CUDA device's name (e.g. ``NVIDIA H100 80GB HBM3``)."""
    device = torch.device(device)
    return _device_name(device.type, device.index)


@lru_cache(maxsize=None)
def _device_name(kind: str, index: Optional[int]) -> str:
    return torch.cuda.get_device_name(index) if kind == "cuda" else kind


def entry_key(device: str, dtype: torch.dtype, pattern: str, shape_class: str) -> str:
    return f"{device}|{str(dtype).replace('torch.', '')}|{pattern}|{shape_class}"


def table_path() -> str:
    return os.environ.get("PYPRUNE_DISPATCH_TABLE") or TABLE_PATH


@lru_cache(maxsize=8)
def _load(path: str) -> Dict:
    if not os.path.isfile(path):
        return {"decode_max_tokens": DEFAULT_DECODE_MAX_TOKENS, "entries": {}}
    with open(path, encoding="utf-8") as handle:
        table = json.load(handle)
    for key, entry in table.get("entries", {}).items():
        if entry.get("backend") not in BACKENDS:
            raise ValueError(f"dispatch table {path}: entry {key!r} names backend "
                             f"{entry.get('backend')!r}; allowed: {', '.join(BACKENDS)}")
    return table


def table() -> Dict:
    return _load(table_path())


def shape_class(tokens: int) -> str:
    return "decode" if tokens <= table().get("decode_max_tokens", DEFAULT_DECODE_MAX_TOKENS) else "prefill"


def lookup(device: torch.device, dtype: torch.dtype, pattern: str, tokens: int) -> Optional[str]:
    """The measured-fastest backend for this case, or None when the table has no entry."""
    entry = table().get("entries", {}).get(entry_key(device_key(device), dtype, pattern,
                                                      shape_class(tokens)))
    return None if entry is None else entry["backend"]
