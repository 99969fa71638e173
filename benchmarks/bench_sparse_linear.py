"""SparseLinear against dense F.linear, per backend, shape, token count M, dtype and N:M pattern.

Every row times one SparseLinear backend and the dense ``F.linear`` on the same masked weight in
the same process (cuBLAS on a GPU, MKL/oneDNN on a CPU; on a CPU in interleaved rounds, so a
neighbour's load hits both alike), after checking the backend's output
against an fp32 dense reference; a backend that fails the check is reported and never enters the
dispatch table. Reported: milliseconds, speedup over dense, TFLOP/s (dense-equivalent 2·M·N·K),
GB/s (weight bytes as that backend stores them plus x and y) and, on H100/H200, the share of the
roofline: the larger of the useful FLOPs (2·M·N·K·n/m, the multiplies by kept weights) at the
dense tensor-core peak and the bytes at the HBM peak, over the measured time.

On a CPU every call takes the next of enough copies of the layer that their dense weights fill
twice the last-level cache (``--fill-bytes``), so each call reads its weight from memory as a
layer does inside a model's forward; a lone small layer called again and again would run from
cache and favour whichever side does more arithmetic per byte.

Writes ``sparse-linear-<device>.json``, ``.md`` and one ``.svg`` plot per dtype (geometric-mean
speedup over the shapes against M) under benchmarks/results/. ``--write-dispatch`` also stores,
per dtype, pattern, weight-size bucket and token bucket, the fastest correct sparse backend where
it beat dense by at least 1.05x, else ``dense``, in pyprune/nn/dispatch_table.json: in the block of
this run's environment (pyprune.nn.dispatch.environment: the machine's identity, torch, pyprune,
threads), the only one whose rows SparseLinear(implementation="auto") applies, and there a ``dense`` row
as is and a sparse one after measuring it again; other environments' blocks stay. The environment
records the dispatch's identity of the machine (CPU: model, family / model / stepping, ISA flags,
last-level cache), every cache level's size and the load average, at the start and per row.

    python benchmarks/bench_sparse_linear.py                 # GPU: LLaMA-7B/LLaMA-3-8B linears
    python benchmarks/bench_sparse_linear.py --device cpu    # CPU: LLaMA-7B linears, M 1-256 and 512
"""
import argparse
import copy
import itertools
import math
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from _common import environment, roofline, svg_line_plot, timed, write_atomic, write_json

from pyprune import ops
from pyprune.nn import SparseLinear, dispatch
from pyprune.nn.tuning import interleaved, last_level_cache_bytes

GPU_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]
GPU_TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
#: LLaMA-7B's linears: 64-180 MB in fp32, larger than a CPU's last-level cache, as in real decoding.
CPU_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
#: The CPU dispatch table's token buckets (pyprune.nn.dispatch.TOKEN_BUCKETS) and a prefill past them.
CPU_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
PATTERNS = [(2, 4), (4, 8)]
#: Largest error allowed, relative to the largest |output| of the fp32 reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def weight_bytes(layer):
    return layer.values.numel() * layer.values.element_size() + layer.meta.numel()


def measure_shape(shape, dtype, pattern, tokens, backends, device, repeat, peaks, fill_bytes):
    out_features, in_features = shape
    n, m = pattern
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype).to(device)
    mask = ops.score_nm_mask(w, n, m)
    dense = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(w * mask)
    copies = cold_copies(dense.weight, device, fill_bytes)
    denses = [dense] + [copy.deepcopy(dense) for _ in range(copies - 1)]
    layer_copies = {b: [SparseLinear.from_dense(d, pattern, implementation=b) for d in denses] for b in backends}
    layers = {b: layer_copies[b][0] for b in backends}
    rows = []
    for M in tokens:
        x = torch.randn(M, in_features, generator=g).to(dtype).to(device)
        base = {"shape": list(shape), "M": M, "dtype": str(dtype).replace("torch.", ""),
                "pattern": f"{n}:{m}", "weight_copies": copies}
        with torch.no_grad():
            reference = F.linear(x.float(), dense.weight.float())
            scale = reference.abs().max().item() or 1.0
            checked, candidates = {}, {}
            for backend, layer in layers.items():
                row = dict(base, backend=backend)
                reason = layer.unsupported_reason(backend, x)
                if reason is not None:
                    checked[backend] = dict(row, status=f"unavailable: {reason}")
                    continue
                try:
                    error = ((layer(x).float() - reference).abs().max().item()) / scale
                except RuntimeError as exc:  # a library refusing this shape at run time
                    checked[backend] = dict(row, status=f"failed: {str(exc).splitlines()[0][:120]}")
                    continue
                row["max_rel_error"] = error
                if not error <= TOLERANCE[dtype]:
                    checked[backend] = dict(row, status="wrong result")
                    continue
                checked[backend] = row
                for copy_of_layer in layer_copies[backend]:  # each copy's caches (dense copy) before timing
                    copy_of_layer(x)
                turn = itertools.cycle(layer_copies[backend])
                candidates[backend] = lambda turn=turn: next(turn)(x)
            dense_turn = itertools.cycle([d.weight for d in denses])
            dense_fn = lambda: F.linear(x, next(dense_turn))  # noqa: E731
            if device.type == "cuda":
                t_dense = timed(dense_fn, device, repeat)
                times = {b: timed(fn, device, repeat) for b, fn in candidates.items()}
                speedups = {b: t_dense / t for b, t in times.items()}
            else:  # interleaved rounds, median time and median per-round ratio
                t_dense, times, speedups = interleaved(dense_fn, candidates, repeat)
            load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
        for backend, row in checked.items():
            row["dense_ms"] = round(t_dense * 1e3, 4)
            if backend in times:
                t, layer = times[backend], layers[backend]
                flops = 2.0 * M * out_features * in_features
                moved = weight_bytes(layer) + (x.numel() + M * out_features) * x.element_size()
                row.update(status="ok", ms=round(t * 1e3, 4), speedup=round(speedups[backend], 3),
                           tflops=round(flops / t / 1e12, 3), gbps=round(moved / t / 1e9, 1),
                           load_average=load)
                if peaks:
                    bound = max(flops * n / m / peaks["flops"], moved / peaks["bytes"])
                    row["pct_roofline"] = round(100 * bound / t, 1)
                print(f"{shape!s:14} M={M:<5} {row['dtype']:9} {n}:{m} {backend:10} "
                      f"{row['ms']:9.4f} ms  dense {row['dense_ms']:9.4f} ms  x{row['speedup']}  "
                      f"load {load}", flush=True)
            rows.append(row)
    return rows


def cold_copies(weight, device, fill_bytes):
    """How many copies of a layer to cycle through: on a CPU enough that their dense weights fill
    ``fill_bytes`` (1 for a weight that does alone), on a GPU 1."""
    if device.type != "cpu":
        return 1
    return max(1, math.ceil(fill_bytes / (weight.numel() * weight.element_size())))


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def dispatch_entries(report, source):
    """Per dtype, pattern, weight-size bucket and token bucket: the fastest correct sparse backend
    where its geomean speedup over dense (over the bucket's shapes and M) is at least
    dispatch.MIN_SPEEDUP, else ``dense``; only backends that ran every case of the bucket compete."""
    cases = defaultdict(set)
    speedups = defaultdict(list)
    for r in report["results"]:
        group = (r["dtype"], r["pattern"], dispatch.shape_bucket(*r["shape"]), dispatch.token_bucket(r["M"]))
        cases[group].add((tuple(r["shape"]), r["M"]))
        if r["status"] == "ok":
            speedups[group + (r["backend"],)].append(r["speedup"])
    entries = {}
    for group, needed in cases.items():
        scores = {key[4]: geomean(v) for key, v in speedups.items()
                  if key[:4] == group and len(v) == len(needed) and key[4] != "dense"}
        best = max(scores, key=scores.get) if scores else None
        backend = best if best is not None and scores[best] >= dispatch.MIN_SPEEDUP else "dense"
        entries[dispatch.entry_key(getattr(torch, group[0]), *group[1:])] = {
            "implementation": backend,
            "sparse_geomean_speedup_vs_dense": None if best is None else round(scores[best], 3),
            "source": source, "measured": report["environment"]["timestamp"]}
    return entries


def write_dispatch(report, path, source):
    """Add this run's entries to the block of its environment in the table at ``path`` (the
    block's other shapes stay; other environments' blocks are kept as they are)."""
    env = report["environment"]["dispatch_environment"]
    blocks = [dict(block) for block in dispatch.table(path)]  # checked as SparseLinear reads it
    block = next((b for b in blocks if b["environment"] == env), None)
    if block is None:
        block = {"environment": env, "entries": {}}
        blocks.append(block)
    block["entries"] = dict(sorted(dict(block["entries"], **dispatch_entries(report, source)).items()))
    write_json(path, {"environments": blocks})


def summary(report):
    """Markdown rows: per dtype, pattern and backend, the geomean speedup over the shapes at each M
    (with the smallest and largest shape's speedup)."""
    cells = defaultdict(list)
    for r in report["results"]:
        if r["status"] == "ok":
            cells[(r["dtype"], r["pattern"], r["backend"], r["M"])].append(r["speedup"])
    tokens = sorted({key[3] for key in cells})
    lines = ["Geometric mean over the shapes of the speedup over dense `F.linear` (min–max in brackets):", "",
             "| dtype | pattern | backend | " + " | ".join(f"M={M}" for M in tokens) + " |",
             "|---|---|---|" + "---:|" * len(tokens)]
    for dtype, pattern, backend in sorted({key[:3] for key in cells}):
        row = []
        for M in tokens:
            v = cells.get((dtype, pattern, backend, M))
            row.append(f"{geomean(v):.2f}× ({min(v):.2f}–{max(v):.2f})" if v else "")
        lines.append(f"| {dtype} | {pattern} | {backend} | " + " | ".join(row) + " |")
    return lines


def markdown(report):
    env = report["environment"]
    lines = [f"# SparseLinear vs dense F.linear on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda')}, driver "
             f"{env.get('driver')}, cuSPARSELt {env.get('cusparselt')}, {env['cpu_threads']} CPU threads, "
             f"{env['timestamp']}. Times: median of CUDA events on a GPU; on a CPU the median of "
             f"rounds that run dense and every backend in turn, speedup the median per-round ratio.", ""]
    cpu = env.get("cpu")
    if cpu:
        lines += [f"CPU: {cpu['model']}, dispatch key `{env['dispatch_device']}`, flags "
                  f"{' '.join(cpu['flags'])}, caches "
                  f"{', '.join(f'{k} {v >> 10} KiB' for k, v in cpu['caches'].items())}; load average at the "
                  f"start {cpu.get('load_average')}, per row in the last column.", ""]
    lines += summary(report) + ["", "Every case:", ""]
    lines += ["| shape (out×in) | M | dtype | pattern | backend | ms | dense ms | speedup | TFLOP/s | GB/s "
              "| % roofline | status | load (1/5/15 min) |",
              "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['shape'][0]}×{r['shape'][1]} | {r['M']} | {r['dtype']} | {r['pattern']} | "
                     f"{r['backend']} | {r.get('ms', '')} | {r['dense_ms']} | "
                     f"{str(r['speedup']) + '×' if 'speedup' in r else ''} | {r.get('tflops', '')} | "
                     f"{r.get('gbps', '')} | {r.get('pct_roofline', '')} | {r['status']} | "
                     f"{' '.join(str(v) for v in r.get('load_average') or [])} |")
    return "\n".join(lines) + "\n"


def plots(report):
    """{dtype: svg} of the geomean speedup over shapes against M, a line per pattern and backend."""
    by_dtype = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in report["results"]:
        if r["status"] == "ok":
            by_dtype[r["dtype"]][f"{r['pattern']} {r['backend']}"][r["M"]].append(r["speedup"])
    device = report["environment"]["device"]
    return {dtype: svg_line_plot({label: [(M, geomean(v)) for M, v in per_m.items()]
                                  for label, per_m in series.items()},
                                 f"SparseLinear speedup over dense F.linear, {dtype}, {device}",
                                 "tokens M", "speedup (geomean over shapes)")
            for dtype, series in by_dtype.items()}


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else \
        (GPU_SHAPES if on_gpu else CPU_SHAPES)
    tokens = args.tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
    dtypes = [getattr(torch, d) for d in (args.dtypes or (["bfloat16", "float16"] if on_gpu
                                                          else ["float32", "bfloat16"]))]
    patterns = [tuple(int(v) for v in p.split(":")) for p in args.patterns] if args.patterns else PATTERNS
    backends = args.backends or list(dispatch.IMPLEMENTATIONS)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(device)
    fill_bytes = 2 * last_level_cache_bytes() if args.fill_bytes is None else args.fill_bytes
    env["weight_fill_bytes"] = fill_bytes
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            for pattern in patterns:
                rows += measure_shape(shape, dtype, pattern, tokens, backends, device, args.repeat,
                                      roofline(device), fill_bytes)
    return {"environment": env, "results": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtypes", nargs="*", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--shapes", nargs="*", help="OUTxIN, e.g. 4096x11008")
    parser.add_argument("--tokens", nargs="*", type=int, help="token counts M")
    parser.add_argument("--patterns", nargs="*", help="N:M patterns (default 2:4 4:8)")
    parser.add_argument("--backends", nargs="*", choices=list(dispatch.IMPLEMENTATIONS))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--fill-bytes", type=int, default=None,
                        help="CPU: cycle through copies of each layer whose weights fill this many bytes "
                             "(default twice the last-level cache; 0: one copy, called from cache)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--name", default=None, help="file stem (default sparse-linear-<cpu|cuda>)")
    parser.add_argument("--write-dispatch", nargs="?", const=dispatch.TABLE_PATH, default=None,
                        metavar="TABLE", help="store this environment's fastest backends in the dispatch "
                                              "table (its block; other environments' stay)")
    args = parser.parse_args(argv)
    if args.write_dispatch:
        dispatch.table(args.write_dispatch)  # a table it cannot extend is refused before measuring
    report = run(args)
    stem = args.name or f"sparse-linear-{'cpu' if report['environment']['dispatch_device'].startswith('cpu') else 'cuda'}"
    path = os.path.join(args.output_dir, stem + ".json")
    write_json(path, report)
    write_atomic(os.path.join(args.output_dir, stem + ".md"), markdown(report))
    for dtype, svg in plots(report).items():
        write_atomic(os.path.join(args.output_dir, f"{stem}-{dtype}.svg"), svg)
    if args.write_dispatch:
        write_dispatch(report, args.write_dispatch, os.path.relpath(path, os.path.dirname(RESULTS)))
        print(f"updated {args.write_dispatch}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
