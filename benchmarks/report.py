"""The results files from a pytest-benchmark run of the suites (``--benchmark-json RUN.json``).

For each suite the run holds, the files benchmarks/results/ keeps, in their format:

* ops (test_ops.py): ``ops-<device>[-TAG]-<dtype>.{json,md}``, a row per op, shape and baseline:
  pyprune's time, the baseline's, their ratio, pyprune's GB/s and share of the peak bandwidth (H100/H200)
  and, for a mask op, its time over the byte floor. Times: the minimum of the rounds on a CPU (robust
  to a shared, throttled machine), the median on a GPU.
* SparseLinear (test_sparse_linear.py): ``sparse-linear-<device>[-TAG].{json,md}`` and a plot per dtype
  (``-<dtype>.svg``, geometric-mean speedup over the shapes against M); with ``--write-dispatch`` also the
  block of the run's environment in SparseLinear's dispatch table: per dtype, pattern, shape bucket
  and token bucket the fastest correct sparse backend where it beat dense by dispatch.MIN_SPEEDUP, else
  ``dense`` (other environments' blocks stay). Times: medians.
* end to end (test_e2e.py): ``e2e-<device>[-TAG].{json,md}``. Times: medians.

Every file's ``environment`` is the run's machine record (``machine_info["pyprune"]``) with the run's
time and, on a CPU, the load average when the suite started.

    python benchmarks/report.py run.json                          # into benchmarks/results
    python benchmarks/report.py run.json --tag avx512 --write-dispatch
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict

import torch
from pyprune.files import write_json, write_text as write_atomic
from pyprune.studies.svg import line_plot as svg_line_plot

from pyprune.nn import dispatch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SUITES = ("ops", "sparse_linear", "e2e")


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def suite_benchmarks(run, suite):
    return [b for b in run["benchmarks"] if b["extra_info"].get("suite") == suite]


def environment(run, benchmarks):
    """The run's machine record, its time, and on a CPU the load average at the suite's first benchmark."""
    env = dict(run["machine_info"]["pyprune"], timestamp=run["datetime"][:19] + "+00:00")
    if "cpu" in env:
        env["cpu"] = dict(env["cpu"], load_average=benchmarks[0]["extra_info"].get("load_average"))
    return env


def on_cpu(env):
    return env["dispatch_device"].startswith("cpu")


def stem(kind, env, tag, dtype=None):
    return "-".join(part for part in (kind, "cpu" if on_cpu(env) else "cuda", tag, dtype) if part)


# ---- ops ---------------------------------------------------------------------------------------

def ops_reports(run):
    """{dtype: report} of the ops suite: rows in the order the run timed them."""
    benchmarks = suite_benchmarks(run, "ops")
    if not benchmarks:
        return {}
    env = environment(run, benchmarks)
    seconds = (lambda b: b["stats"]["min"]) if on_cpu(env) else (lambda b: b["stats"]["median"])
    peak = (env.get("roofline") or {}).get("bytes")
    by_case = defaultdict(dict)
    for b in benchmarks:
        info = b["extra_info"]
        by_case[(info["op"], str(info["shape"]), info["dtype"])][info["role"]] = b
    reports = {}
    for (_, _, dtype), roles in by_case.items():
        ours, floor = roles.get("pyprune"), roles.get("floor")
        if ours is None:  # a run that timed a baseline without pyprune's op has no row to give
            continue
        info, t_ours = ours["extra_info"], seconds(ours)
        for role, theirs in roles.items():
            if role in ("pyprune", "floor"):
                continue
            t_base = seconds(theirs)
            row = {"op": info["op"], "shape": info["shape"], "dtype": dtype,
                   "baseline": theirs["extra_info"]["baseline"], "pyprune_ms": round(t_ours * 1e3, 4),
                   "baseline_ms": round(t_base * 1e3, 4), "speedup": round(t_base / t_ours, 3),
                   "pyprune_GBps": round(info["bytes"] / t_ours / 1e9, 2)}
            if floor is not None:  # a mask op: its time over reading the input and writing a byte per element
                row["byte_floor_ms"] = round(seconds(floor) * 1e3, 4)
                row["times_byte_floor"] = round(t_ours / seconds(floor), 2)
            if peak:
                row["pct_of_peak_bandwidth"] = round(100 * info["bytes"] / t_ours / peak, 1)
            reports.setdefault(dtype, {"environment": env, "results": []})["results"].append(row)
    return reports


def ops_markdown(report):
    env = report["environment"]
    lines = [f"# pyprune ops on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['cpu_threads']} CPU threads, "
             f"native CPU kernels: {env['native_cpu_kernels']}, {env['timestamp']}", "",
             "Byte floor (mask ops): reading the op's input once and writing one byte per element "
             "(`torch.ne(input, 0, out=bool)`), timed in the same process.", "",
             "| op | shape | dtype | pyprune ms | baseline | baseline ms | speedup | GB/s | byte floor ms | × floor |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        shape = r["shape"] if isinstance(r["shape"], str) else "×".join(map(str, r["shape"]))
        floor = f"{r['times_byte_floor']}×" if "times_byte_floor" in r else ""
        lines.append(f"| {r['op']} | {shape} | {r['dtype']} | {r['pyprune_ms']} | {r['baseline']} | "
                     f"{r['baseline_ms']} | {r['speedup']}× | {r['pyprune_GBps']} | {r.get('byte_floor_ms', '')} | "
                     f"{floor} |")
    return "\n".join(lines) + "\n"


# ---- SparseLinear ------------------------------------------------------------------------------

def sparse_linear_report(run):
    """A row per timed SparseLinear backend and case, with the dense F.linear of the same case."""
    benchmarks = suite_benchmarks(run, "sparse_linear")
    env = environment(run, benchmarks)
    peaks = env.get("roofline")
    case = lambda info: (info["dtype"], tuple(info["shape"]), info["pattern"], info["M"])  # noqa: E731
    dense = {case(b["extra_info"]): b["stats"]["median"] for b in benchmarks
             if b["extra_info"]["implementation"] == "F.linear"}
    order = {}
    rows = []
    for b in benchmarks:
        info = b["extra_info"]
        order.setdefault(case(info)[:3], len(order))
        if info["implementation"] == "F.linear":
            continue
        t, t_dense = b["stats"]["median"], dense[case(info)]
        n, m = (int(v) for v in info["pattern"].split(":"))
        row = {"shape": info["shape"], "M": info["M"], "dtype": info["dtype"], "pattern": info["pattern"],
               "weight_copies": info["weight_copies"], "backend": info["implementation"],
               "max_rel_error": info["max_rel_error"], "dense_ms": round(t_dense * 1e3, 4), "status": "ok",
               "ms": round(t * 1e3, 4), "speedup": round(t_dense / t, 3), "tflops": round(info["flops"] / t / 1e12, 3),
               "gbps": round(info["bytes"] / t / 1e9, 1), "load_average": info["load_average"]}
        if peaks:
            bound = max(info["flops"] * n / m / peaks["flops"], info["bytes"] / peaks["bytes"])
            row["pct_roofline"] = round(100 * bound / t, 1)
        rows.append(row)
    rows.sort(key=lambda r: (order[case(r)[:3]], r["M"], dispatch.IMPLEMENTATIONS.index(r["backend"])))
    return {"environment": env, "results": rows}


def dispatch_entries(report, source):
    """Per dtype, pattern, shape bucket and token bucket: the fastest correct sparse
    implementation where its geomean speedup over dense (over the bucket's shapes and M) is at least
    dispatch.MIN_SPEEDUP, else ``dense``; only implementations that ran every case of the bucket
    compete. (A results row names its implementation ``backend``, the results files' column.)"""
    cases = defaultdict(set)
    speedups = defaultdict(list)
    for r in report["results"]:
        group = (r["dtype"], r["pattern"], dispatch.shape_bucket(*r["shape"]), dispatch.token_bucket(r["M"]))
        cases[group].add((tuple(r["shape"]), r["M"]))
        speedups[group + (r["backend"],)].append(r["speedup"])
    entries = {}
    for group, needed in cases.items():
        scores = {key[4]: geomean(v) for key, v in speedups.items()
                  if key[:4] == group and len(v) == len(needed) and key[4] != "dense"}
        best = max(scores, key=scores.get) if scores else None
        chosen = best if best is not None and scores[best] >= dispatch.MIN_SPEEDUP else "dense"
        entries[dispatch.entry_key(getattr(torch, group[0]), *group[1:])] = {
            "implementation": chosen,
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


def sparse_linear_summary(report):
    """Markdown rows: per dtype, pattern and backend, the geomean speedup over the shapes at each M
    (with the smallest and largest shape's speedup)."""
    cells = defaultdict(list)
    for r in report["results"]:
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


def sparse_linear_markdown(report):
    env = report["environment"]
    lines = [f"# SparseLinear vs dense F.linear on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda')}, driver "
             f"{env.get('driver')}, cuSPARSELt {env.get('cusparselt')}, {env['cpu_threads']} CPU threads, "
             f"{env['timestamp']}. Times: the median of pytest-benchmark's rounds (a GPU synchronised after "
             f"every call); speedup the dense median over the backend's.", ""]
    cpu = env.get("cpu")
    if cpu:
        lines += [f"CPU: {cpu['model']}, dispatch key `{env['dispatch_device']}`, flags "
                  f"{' '.join(cpu['flags'])}, caches "
                  f"{', '.join(f'{k} {v >> 10} KiB' for k, v in cpu['caches'].items())}; load average at the "
                  f"start {cpu.get('load_average')}, per row in the last column.", ""]
    lines += sparse_linear_summary(report) + ["", "Every case:", ""]
    lines += ["| shape (out×in) | M | dtype | pattern | backend | ms | dense ms | speedup | TFLOP/s | GB/s "
              "| % roofline | status | load (1/5/15 min) |",
              "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['shape'][0]}×{r['shape'][1]} | {r['M']} | {r['dtype']} | {r['pattern']} | "
                     f"{r['backend']} | {r['ms']} | {r['dense_ms']} | {r['speedup']}× | {r['tflops']} | "
                     f"{r['gbps']} | {r.get('pct_roofline', '')} | {r['status']} | "
                     f"{' '.join(str(v) for v in r.get('load_average') or [])} |")
    return "\n".join(lines) + "\n"


def sparse_linear_plots(report):
    """{dtype: svg} of the geomean speedup over shapes against M, a line per pattern and backend."""
    by_dtype = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in report["results"]:
        by_dtype[r["dtype"]][f"{r['pattern']} {r['backend']}"][r["M"]].append(r["speedup"])
    device = report["environment"]["device"]
    return {dtype: svg_line_plot({label: [(M, geomean(v)) for M, v in per_m.items()]
                                  for label, per_m in series.items()},
                                 f"SparseLinear speedup over dense F.linear, {dtype}, {device}",
                                 "tokens M", "speedup (geomean over shapes)")
            for dtype, series in by_dtype.items()}


# ---- end to end --------------------------------------------------------------------------------

RECORD = ("model", "dtype", "pattern", "sparse_where", "sparse_layers", "backends", "decision_sources", "decisions",
          "tuned_on_first_use", "prefill_tokens", "new_tokens")


def e2e_report(run):
    """A row per model, dtype, pattern and where: the medians of prefill and decode, dense and sparse."""
    benchmarks = suite_benchmarks(run, "e2e")
    cases = defaultdict(dict)
    for b in benchmarks:
        info = b["extra_info"]
        cases[(info["model"], info["dtype"], info["pattern"], info["sparse_where"])][(info["phase"], info["side"])] = b
    rows = []
    for timed in cases.values():
        info = timed[("prefill", "sparse")]["extra_info"]
        row = {key: info[key] for key in RECORD}
        row.update(repeats=timed[("prefill", "sparse")]["stats"]["rounds"],
                   top1_agreement_sparse_vs_dense=info["top1_agreement_sparse_vs_dense"],
                   logit_error={"sparse_vs_dense": info["max_rel_logit_error"],
                                "vs_fp32": info.get("fp32_rel_logit_error")})  # None: a run before the suite kept it
        for side in ("dense", "sparse"):
            decode_s = timed[("decode", side)]["stats"]["median"]
            row[f"{side}_prefill_ms"] = round(timed[("prefill", side)]["stats"]["median"] * 1e3, 3)
            row[f"{side}_decode_tok_s"] = round((info["new_tokens"] - 1) / decode_s, 2)
            row[f"{side}_weight_bytes"] = info["weight_bytes"][side]
            row[f"{side}_weight_mb"] = round(info["weight_bytes"][side] / 2**20, 1)
        row.update(same_generated_tokens=info["same_generated_tokens"],
                   same_new_tokens_before_divergence=info["same_new_tokens_before_divergence"],
                   prefill_speedup=round(row["dense_prefill_ms"] / row["sparse_prefill_ms"], 3),
                   decode_speedup=round(row["sparse_decode_tok_s"] / row["dense_decode_tok_s"], 3),
                   load_average=timed[("decode", "sparse")]["extra_info"]["load_average"])
        rows.append(row)
    first = benchmarks[0]["extra_info"]
    settings = {"layers_of_llama_7b_shape": first["layers_of_stand_in"], "backend": first["backend"],
                "sparse_where": sorted({row["sparse_where"] for row in rows}, key=("faster", "all").index)}
    return {"environment": environment(run, benchmarks), "settings": settings, "results": rows}


def logit_errors(vs_fp32):
    """'dense / sparse' of a row's largest relative logit errors against the model in fp32, '–' when not kept."""
    return "–" if vs_fp32 is None else f"{vs_fp32['dense']:.3g} / {vs_fp32['sparse']:.3g}"


def e2e_markdown(report):
    env = report["environment"]
    cpu = env.get("cpu")
    lines = [f"# End to end, N:M sparse vs dense, on {env['device']}", "",
             f"torch {env['torch']}, {env['cpu_threads']} CPU threads, {env['timestamp']}"
             + (f"; CPU {cpu['model']}, dispatch key `{env['dispatch_device']}` ({' '.join(cpu['flags'])}; "
                f"{', '.join(f'{k} {v >> 10} KiB' for k, v in cpu['caches'].items())}; load average at the start "
                f"{cpu.get('load_average')})" if cpu else "") + ". Medians of pytest-benchmark's rounds; decode "
             "tokens/s over the new tokens after the first; weight memory includes any dense copy a "
             "SparseLinear caches for its dense fallback.", "",
             "| model | dtype | pattern | sparse where | sparse layers | decode / prefill backends | prefill tokens "
             "| dense prefill ms | sparse prefill ms | prefill speedup | new tokens | dense decode tok/s "
             "| sparse decode tok/s | decode speedup | same tokens (new tokens before they part) | dense MB "
             "| sparse MB | logit error vs fp32, dense / sparse | backends from (decode; prefill) | tuned here "
             "| load (1/5/15 min) |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|---|"]
    for r in report["results"]:
        sources = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "–"
                            for counts in r["decision_sources"].values())
        tuned = r["tuned_on_first_use"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['pattern']} | {r['sparse_where']} | {r['sparse_layers']} | "
                     f"{'+'.join(r['backends']['decode'])} / {'+'.join(r['backends']['prefill'])} | "
                     f"{r['prefill_tokens']} | {r['dense_prefill_ms']} | {r['sparse_prefill_ms']} | "
                     f"{r['prefill_speedup']}× | {r['new_tokens']} | {r['dense_decode_tok_s']} | "
                     f"{r['sparse_decode_tok_s']} | {r['decode_speedup']}× | {r['same_generated_tokens']} "
                     f"({r['same_new_tokens_before_divergence']}) | {r['dense_weight_mb']} | {r['sparse_weight_mb']} | "
                     f"{logit_errors(r['logit_error']['vs_fp32'])} | "
                     f"{sources} | {tuned['cases']} cases, {tuned['seconds']} s | "
                     f"{' '.join(str(v) for v in r.get('load_average') or [])} |")
    return "\n".join(lines) + "\n"


# ---- writing -----------------------------------------------------------------------------------

def write_results(run, output_dir, tag=None, dispatch_table=None):
    """Write every results file ``run`` has rows for into ``output_dir``; returns their paths. With
    ``dispatch_table``, the SparseLinear rows also go into that table's block of the run's environment."""
    os.makedirs(output_dir, exist_ok=True)
    written = []

    def write(name, report, markdown):
        path = os.path.join(output_dir, name + ".json")
        write_json(path, report)
        write_atomic(os.path.join(output_dir, name + ".md"), markdown(report))
        written.extend([path, os.path.join(output_dir, name + ".md")])
        return path

    for dtype, report in ops_reports(run).items():
        write(stem("ops", report["environment"], tag, dtype), report, ops_markdown)
    if suite_benchmarks(run, "sparse_linear"):
        report = sparse_linear_report(run)
        name = stem("sparse-linear", report["environment"], tag)
        path = write(name, report, sparse_linear_markdown)
        for dtype, svg in sparse_linear_plots(report).items():
            write_atomic(os.path.join(output_dir, f"{name}-{dtype}.svg"), svg)
            written.append(os.path.join(output_dir, f"{name}-{dtype}.svg"))
        if dispatch_table:
            write_dispatch(report, dispatch_table, os.path.relpath(path, os.path.dirname(RESULTS)))
            written.append(dispatch_table)
    if suite_benchmarks(run, "e2e"):
        report = e2e_report(run)
        write(stem("e2e", report["environment"], tag), report, e2e_markdown)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a pytest-benchmark JSON (pytest benchmarks --benchmark-only --benchmark-json RUN)")
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--tag", default=None, help="added to every file's name after the device, e.g. avx512")
    parser.add_argument("--write-dispatch", nargs="?", const=dispatch.TABLE_PATH, default=None, metavar="TABLE",
                        help="store the run's fastest SparseLinear backends in the dispatch table (the block "
                             "of the run's environment; other environments' stay)")
    args = parser.parse_args(argv)
    if args.write_dispatch:
        dispatch.table(args.write_dispatch)  # a table it cannot extend is refused before anything is written
    with open(args.run, encoding="utf-8") as handle:
        run = json.load(handle)
    if not any(suite_benchmarks(run, suite) for suite in SUITES):
        parser.error(f"{args.run} holds no timed benchmark of the suites (was it run with --benchmark-only?)")
    if args.write_dispatch and not suite_benchmarks(run, "sparse_linear"):
        parser.error(f"--write-dispatch: {args.run} holds no SparseLinear benchmark")
    for path in write_results(run, args.output_dir, args.tag, args.write_dispatch):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
