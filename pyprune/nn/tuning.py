"""Tune on first use: time SparseLinear's ``kernel`` against ``dense`` where this environment has no answer.

A case (dtype, pattern, shape bucket, token bucket) that this environment's per-user cache
does not answer (:func:`pyprune.nn.dispatch.answer`) is measured the first time a layer meets it,
on that layer's own weights and a random input of its token count (at most
:data:`MAX_TIMED_TOKENS`): a few interleaved rounds of kernel and dense, each call after the
last-level cache was overwritten (a layer inside a model's forward reads its weight from memory),
the median per-round ratio deciding. So is a case the shipped table names a sparse implementation for,
even in this very environment: a prior ``kernel`` is confirmed (or overruled) here before it runs;
a prior ``dense`` is used as is. The answer goes to the cache, so it is measured once per
environment. Never under ``torch.compile`` (the caller checks), never with ``PYPRUNE_TUNE=0`` (CI,
benchmarks: then such a case runs dense) and, for now, on CPUs only.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from . import dispatch

#: ``PYPRUNE_TUNE=0`` turns on-the-fly tuning off; ``1`` (the default) on.
SWITCH = "PYPRUNE_TUNE"
#: Rounds of a measurement: at least MIN_ROUNDS, more while within BUDGET_S, at most MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 5, 15, 0.25
#: A measurement of a "many"-token case times this many tokens (a bounded cost for long prompts).
MAX_TIMED_TOKENS = 512

#: What tuning has cost this process: cases measured and seconds spent.
COST = {"cases": 0, "seconds": 0.0}
_announced = []
_silenced = []  # notices_off() blocks in effect
_scratch: Dict[int, torch.Tensor] = {}


def enabled() -> bool:
    """Whether layers may time a case on first use (``PYPRUNE_TUNE`` unset or ``1``)."""
    value = os.environ.get(SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH} must be 0 (no on-the-fly tuning) or 1; got {value!r}")
    return value == "1"


def can_tune(device: torch.device) -> bool:
    """Whether a first-use measurement may run here now: tuning on, a CPU, no graph being traced."""
    return torch.device(device).type == "cpu" and not torch.compiler.is_compiling() and enabled()


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The last-level cache's size in bytes, as :func:`dispatch.this_cpu` read it (``default``
    where sysfs does not say)."""
    return dispatch.this_cpu()["llc_bytes"] or default


def evict_cpu_cache() -> None:
    """Overwrite a buffer as large as the last-level cache, so the next call reads from memory."""
    size = last_level_cache_bytes()
    if size not in _scratch:
        _scratch.clear()
        _scratch[size] = torch.empty(size // 4, dtype=torch.float32)
    _scratch[size].fill_(1.0)


def interleaved(baseline: Callable[[], object], candidates: Dict[str, Callable[[], object]], rounds: int,
                budget_s: Optional[float] = None, min_rounds: Optional[int] = None,
                before_each: Optional[Callable[[], None]] = None) -> Tuple[float, Dict, Dict]:
    """Median seconds of ``baseline()`` and of each of ``candidates`` ({name: fn}), run in turn for
    up to ``rounds`` rounds after one warm-up each, plus each candidate's median per-round speedup
    over the baseline: the rounds interleave, so a neighbour's load hits both sides alike. With
    ``budget_s``, rounds stop once that much time has passed and ``min_rounds`` are done;
    ``before_each`` runs untimed before every call (e.g. :func:`evict_cpu_cache`)."""
    calls = [baseline, *candidates.values()]
    for fn in calls:
        fn()
    start = time.perf_counter()
    base, times = [], {name: [] for name in candidates}
    ratios = {name: [] for name in candidates}
    for done in range(rounds):
        if budget_s is not None and done >= (min_rounds or 1) and time.perf_counter() - start > budget_s:
            break
        for name, fn in (("", baseline), *candidates.items()):
            if before_each is not None:
                before_each()
            begin = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - begin
            if name == "":
                base.append(elapsed)
            else:
                times[name].append(elapsed)
                ratios[name].append(base[-1] / elapsed)
    return (statistics.median(base), {name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(r) for name, r in ratios.items()})


def measure(dense: Callable[[torch.Tensor], torch.Tensor], kernel: Callable[[torch.Tensor], torch.Tensor],
            x: torch.Tensor) -> Dict:
    """Time ``kernel(x)`` against ``dense(x)`` (each a layer's forward on one implementation) and return
    the cache entry: ``kernel`` where it measured at least :data:`dispatch.MIN_SPEEDUP` times as fast."""
    begin = time.perf_counter()
    with torch.no_grad():
        dense_s, times, ratios = interleaved(lambda: dense(x), {"kernel": lambda: kernel(x)}, MAX_ROUNDS,
                                             BUDGET_S, MIN_ROUNDS, evict_cpu_cache)
    COST["cases"] += 1
    COST["seconds"] += time.perf_counter() - begin
    return {"implementation": "kernel" if ratios["kernel"] >= dispatch.MIN_SPEEDUP else "dense",
            "sparse_speedup_vs_dense": round(ratios["kernel"], 3), "kernel_ms": round(times["kernel"] * 1e3, 4),
            "dense_ms": round(dense_s * 1e3, 4), "tokens": x.shape[0],
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": "pyprune.nn.tuning"}


def timed_input(in_features: int, tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The random input a measurement times: ``tokens`` rows (at most :data:`MAX_TIMED_TOKENS`)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(min(tokens, MAX_TIMED_TOKENS), in_features, generator=generator).to(device, dtype)


@contextlib.contextmanager
def notices_off() -> Iterator[None]:
    """No first-use notice inside (the CLI's ``--quiet``); measurements still run."""
    _silenced.append(True)
    try:
        yield
    finally:
        _silenced.pop()


def announce(path: str) -> None:
    """Say once per process that first-use measurements run, where they go and how to turn them off."""
    if not _announced and not _silenced:
        _announced.append(path)
        print(f"pyprune: timing SparseLinear kernel vs dense for shapes this CPU has no measurement of "
              f"(a few ms each, once; cached in {path}; {SWITCH}=0 turns this off)", file=sys.stderr)
