"""What every benchmark script shares: timing, the machine record, atomic writes, an SVG plot."""
import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

import pyprune
from pyprune.nn import dispatch
from pyprune.ops.library import native

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


def cpu_info():
    """The CPU as SparseLinear's dispatch keys it (pyprune.nn.dispatch.this_cpu: model, vendor,
    family / model number / stepping, ISA flags, last-level cache), the size of every cache level
    in bytes and the load average."""
    info = dict(dispatch.this_cpu(), caches=dispatch.cpu_caches())
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    return info


def _nvidia_driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device):
    """The machine and library versions a result was measured with."""
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"CPU ({dispatch.this_cpu()['model']})",
        # what SparseLinear's dispatch keys measurements by here, in short and in full
        "dispatch_device": dispatch.device_key(device),
        "dispatch_environment": dispatch.environment(device),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pyprune": pyprune.__version__,
        "native_cpu_kernels": native("cpu") is not None,
        "native_cuda_kernels": native("cuda") is not None,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cpu":
        info["cpu"] = cpu_info()
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["driver"] = _nvidia_driver()
        info["capability"] = "sm%d%d" % torch.cuda.get_device_capability(device)
        try:
            info["cusparselt"] = torch.backends.cusparselt.version()
        except (AttributeError, RuntimeError):
            info["cusparselt"] = None
    return info


def roofline(device):
    """{"flops", "bytes"} peaks of ``device`` when known (NVIDIA H100/H200), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks for key, peaks in ROOFLINES if key in name), None)


def write_atomic(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


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


@contextlib.contextmanager
def locked(path):
    """Hold an exclusive lock on ``path`` (through ``path``.lock) for the block: concurrent runs that
    re-read a results file, merge their rows and rewrite it do so one at a time."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def merge_rows(rows, stored, key):
    """Extend ``rows`` (in place) by the ``stored`` rows whose ``key`` none of them has: the rows a
    concurrent run with the same settings wrote to the results file meanwhile. Returns ``rows``."""
    have = {key(row) for row in rows}
    rows.extend(row for row in stored if key(row) not in have)
    return rows


def mean_std(values, spec=".4f"):
    """"mean ± std" (sample standard deviation) of the values that are not None, formatted by
    ``spec``; one value alone, or "–" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(statistics.fmean(values), spec)} ± {format(statistics.stdev(values), spec)}"


def write_json(path, report):
    write_atomic(path, json.dumps(report, indent=2) + "\n")


def svg_line_plot(series, title, x_label, y_label, log2_x=True, reference_y=1.0,
                  width=720, height=420):
    """A self-contained SVG line chart. ``series`` maps a label to [(x, y), ...]; a dashed line
    marks ``reference_y`` (speedup 1 = parity with the baseline)."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("svg_line_plot needs at least one point")
    fx = (lambda v: math.log2(v)) if log2_x else (lambda v: v)
    xs = [fx(x) for x, _ in points]
    ys = [y for _, y in points] + ([reference_y] if reference_y is not None else [])
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(ys) * 1.1
    left, right, top, bottom = 60, 200, 40, 50
    px = lambda x: left + (fx(x) - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda y: height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
           f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{x_label}</text>',
           f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
           f'text-anchor="middle">{y_label}</text>']
    for x in sorted({x for x, _ in points}):
        out.append(f'<text x="{px(x):.1f}" y="{height - bottom + 16}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    if reference_y is not None:
        out.append(f'<line x1="{left}" y1="{py(reference_y):.1f}" x2="{width - right}" '
                   f'y2="{py(reference_y):.1f}" stroke="gray" stroke-dasharray="4 3"/>')
    for i, (label, values) in enumerate(series.items()):
        color = colors[i % len(colors)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(values))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 10}" y="{top + 16 * i + 10}" fill="{color}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
