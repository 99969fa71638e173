"""What the benchmark scripts share: timing, rooflines, and (for the scripts not yet declared as
studies in :mod:`pyprune.studies`) resume-by-settings and a NAME=VALUE option. The machine record,
atomic writes, the lock, ``mean ± std`` and the SVG plot are the package's."""
import argparse
import json
import os
import statistics
import time

import torch

from pyprune.files import locked, write_json  # noqa: F401  (the benchmarks' writers)
from pyprune.files import write_text as write_atomic  # noqa: F401
from pyprune.nn.dispatch import cpu_record as cpu_info  # noqa: F401
from pyprune.nn.dispatch import environment_record as environment  # noqa: F401
from pyprune.studies.results import mean_std  # noqa: F401
from pyprune.studies.svg import line_plot as svg_line_plot  # noqa: F401

#: Dense bf16/fp16 tensor-core FLOP/s and HBM bytes/s (kernel-landscape.md §1), by a substring of
#: torch.cuda.get_device_name, most specific first; other devices get no roofline.
ROOFLINES = [("H100 PCIe", {"flops": 756e12, "bytes": 2.0e12}),
             ("H100 80GB HBM3", {"flops": 989.4e12, "bytes": 3.35e12}),
             ("H200", {"flops": 989.4e12, "bytes": 4.8e12})]


def method_option(text: str):
    """argparse type of a NAME=VALUE method option: (name, value as int, else float, else str)."""
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE; got {text!r}")
    for convert in (int, float):
        try:
            return name, convert(value)
        except ValueError:
            pass
    return name, value


def timed(fn, device, repeat):
    """Seconds of ``fn()`` after one warm-up: the median over ``repeat`` CUDA-event timings on a GPU,
    the minimum over ``repeat`` runs on a CPU (robust to a shared, throttled machine)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return min(times)


def roofline(device):
    """{"flops", "bytes"} peaks of ``device`` when known (NVIDIA H100/H200), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks for key, peaks in ROOFLINES if key in name), None)


def previous_result(path, settings):
    """The result a resumable benchmark wrote to ``path`` before with the same ``settings``; None
    when there is nothing there. A file of other settings is refused, never overwritten: its rows
    were measured under another protocol."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        result = json.load(handle)
    stored = result.get("settings")
    if stored != settings:
        stored = stored if isinstance(stored, dict) else {}
        differ = sorted(key for key in set(stored) | set(settings) if stored.get(key) != settings.get(key))
        raise SystemExit(f"--output {path} holds results of other settings (differing: {', '.join(differ)}); "
                         "give another --output, or move that file away to start afresh")
    return result


def merge_rows(rows, stored, key):
    """Extend ``rows`` (in place) by the ``stored`` rows whose ``key`` none of them has: the rows a
    concurrent run with the same settings wrote to the results file meanwhile. Returns ``rows``."""
    have = {key(row) for row in rows}
    rows.extend(row for row in stored if key(row) not in have)
    return rows
