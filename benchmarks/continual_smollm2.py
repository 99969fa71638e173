"""COPAL's continual table (Tables 2-3) on SmolLM2-135M: three domains, every order.

For every pattern and method row, :func:`pyprune.studies.continual.run` prunes SmolLM2-135M on the
datasets one after another (every permutation by default), evaluates perplexity on all three
after every step, and reports A-/M-PPL and A-/M-BWT. Domains: Austen prose (``austen``, the six
novels), ``moby_dick`` and ``python`` source, all embedded in pyprune; the first half of each
calibrates (``--nsamples`` x ``--seqlen`` random windows, the same for every order), the first
``--eval-tokens`` tokens of its second half evaluate.

Rows, each ``method[:init][+perturbation][/scope]``: COPAL (continual state; ``+gaussian`` draws
the perturbations instead of the default proportional ones; ``/row`` selects per output row
instead of the paper's per matrix; gaussian rows run once per ``--perturbation-seeds`` x
``--perturbation-ratios``, labelled with both), and Wanda / SparseGPT with global initialisation (the paper's
baselines: re-prune the dense model on each dataset), sequential initialisation (prune the pruned
model: weight stasis) or cumulative initialisation (their own statistics summed over the datasets
so far, the mask from the dense weights: accumulation without COPAL's sensitivity). Every row
reports A-PPL of the final models and A-PPL over every step (Eq. 13's two readings). Results go to
benchmarks/results/continual-smollm2-135m.{json,md}, rewritten after every finished order; a
rerun resumes.

    python benchmarks/continual_smollm2.py                          # the README table
    python benchmarks/continual_smollm2.py --patterns 0.5 --rows copal wanda:global --permutations given
    python benchmarks/continual_smollm2.py --rows copal+gaussian/row --orders austen,moby_dick,python  # one order
"""
import argparse
import os
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
from pyprune.studies import continual
from pyprune.inputs import data
from pyprune import methods
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs.models import load_model
from pyprune.patterns import Unstructured, parse

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROWS = ("copal", "copal/row", "copal+gaussian", "copal+gaussian/row", "wanda:global", "wanda:cumulative",
        "wanda:cumulative/tensor", "sparsegpt:global", "sparsegpt:cumulative", "wanda:sequential",
        "sparsegpt:sequential")
DEFAULT_ROWS = ROWS[:9]
DATASETS = ("austen", "moby_dick", "python")


def _fmt(value, digits=3):
    return "–" if value is None else f"{value:.{digits}f}"


def _spread(mean, std):
    """mean ± standard deviation across orders (– for no value, mean alone for one order)."""
    return "–" if mean is None else f"{mean:.3f}" + (f" ± {std:.2f}" if std else "")


def markdown(result) -> str:
    s = result["settings"]
    lines = [
        "# Continual pruning on SmolLM2-135M (COPAL Tables 2-3)", "",
        f"Datasets {', '.join(s['datasets'])} in {s['permutations']} order(s); calibration {s['calibration']}; "
        f"evaluation {s['evaluation']}. BWT = P[after the last dataset][j] − P[right after j][j], over every "
        "dataset j not last in its order (positive = forgetting); A- = mean over datasets of the per-dataset "
        "mean, M- = largest single value; PPL of the final models; A-PPL (steps) = mean of P over every step, "
        "dataset and order (Eq. 13 read over every step i). Spread: standard deviation across orders.", "",
        "Dense: " + ", ".join(f"{k} {v:.3f}" for k, v in result["dense"].items()), "",
        "| pattern | method | init | A-BWT | M-BWT | A-PPL | M-PPL | A-PPL (steps) | " +
        " | ".join(f"{d} BWT | {d} PPL" for d in s["datasets"]) + " | time (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(s["datasets"]) + "---:|"]
    for row in result["rows"]:
        if row.get("partial"):
            continue
        cells = [_spread(row['per_dataset'][d]['bwt'], row['per_dataset'][d]['bwt_std']) + " | " +
                 _spread(row['per_dataset'][d]['ppl'], row['per_dataset'][d]['ppl_std']) for d in s["datasets"]]
        lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | "
                     f"{_spread(row['a_bwt'], row['a_bwt_std'])} | {_fmt(row['m_bwt'])} | "
                     f"{_spread(row['a_ppl'], row['a_ppl_std'])} | {row['m_ppl']:.3f} | {row['a_ppl_steps']:.3f} | "
                     + " | ".join(cells)
                     + f" | {row['time_s']:.0f} |")
    if all(row.get("partial") for row in result["rows"]):  # no row for the summary table
        lines[-2:] = ["No row has run every order of the protocol: the table below gives each row over the orders "
                      "it finished."]
    return "\n".join(lines + _per_order(result)) + "\n"


def _per_order(result) -> list:
    """Each order's own A-BWT and mean final perplexity per row (where a row ran more than one order,
    or is still partial: the orders it finished), for paired comparisons between rows."""
    rows = [row for row in result["rows"] if row["matrix"] and (row.get("partial") or len(row["matrix"]) > 1)]
    if not rows:
        return []
    s = result["settings"]
    orders = continual.orders(s["datasets"], s["permutations"])
    lines = ["", "Per order: A-BWT / mean final perplexity of that order alone (a row marked partial has "
             "finished only the orders shown; its run resumes with the same command, which runs the orders "
             "given by --orders, or every order without it). Last column: A-BWT / A-PPL over the orders "
             "the row finished, ± their standard deviation across those orders.", "",
             "| pattern | method | init | " + " | ".join(" → ".join(order) for order in orders)
             + " | orders finished |",
             "|---|---|---|" + "---:|" * (len(orders) + 1)]
    for row in rows:
        by_order = {tuple(run["order"]): continual.metrics(list(run["order"]), {tuple(run["order"]): run["steps"]})
                    for run in row["matrix"]}
        finished = continual.metrics(s["datasets"], {tuple(run["order"]): run["steps"] for run in row["matrix"]})
        partial = f" (partial, {len(row['matrix'])} of {len(orders)} orders)" if row.get("partial") else ""
        lines.append(f"| {row['pattern']} | {row['method']}{partial} | {row['init']} | " + " | ".join(
            f"{_fmt(by_order[o]['a_bwt'], 2)} / {by_order[o]['a_ppl']:.2f}" if o in by_order else "–"
            for o in orders) + f" | {_spread(finished['a_bwt'], finished['a_bwt_std'])} / "
            f"{_spread(finished['a_ppl'], finished['a_ppl_std'])} |")
    return lines


def _current(row):
    """A row as this script writes it now: rows written before the selection scope was part of the
    label, or before A-PPL over every step was reported, get both (from the method's default
    scope and the row's own matrix)."""
    if row.get("partial"):
        return row
    if " per " not in row["pattern"] and ":" not in row["pattern"]:
        method = row["method"].split(" ")[0]
        row["pattern"] += f" per {methods.get(method).default_scope}"
    if "a_ppl_steps" not in row or "a_bwt_std" not in row:
        names = list(row["per_dataset"])
        measured = continual.metrics(names, {tuple(r["order"]): r["steps"] for r in row["matrix"]})
        row.update({key: measured[key] for key in ("a_ppl_steps", "m_ppl_steps", "a_ppl_std", "a_bwt_std")})
    return row


def _runs(args):
    """(pattern, row name without its perturbation, COPAL options, label of the variant) of every row
    to run: a gaussian row once per perturbation seed and ratio."""
    for spec in args.patterns:
        for row_name in args.rows:
            scoped = row_name.partition("/")
            name, _, perturbation = scoped[0].partition("+")
            name += "".join(scoped[1:])
            if perturbation != "gaussian":
                yield spec, name, ({"perturbation": perturbation} if perturbation else {}), perturbation
                continue
            for ratio in args.perturbation_ratios:
                for seed in args.perturbation_seeds:
                    yield spec, name, {"perturbation": perturbation, "perturbation_ratio": ratio,
                                       "perturbation_seed": seed}, f"gaussian, ratio {ratio:g}, seed {seed}"


def selected_orders(datasets, permutations, requested):
    """The orders this invocation runs: every order of the protocol, or the ``requested`` ones
    (each "a,b,c"), refused when one is not an order of the protocol."""
    protocol = continual.orders(datasets, permutations)
    if not requested:
        return protocol
    chosen = [tuple(order.split(",")) for order in requested]
    unknown = [",".join(order) for order in chosen if order not in protocol]
    if unknown:
        raise SystemExit(f"--orders: {', '.join(unknown)} is not an order of --datasets {' '.join(datasets)} "
                         f"with --permutations {permutations}; allowed: "
                         + " ".join(",".join(order) for order in protocol))
    return list(dict.fromkeys(chosen))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["0.5", "2:4"])
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS)
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--permutations", choices=["given", "all"], default="all")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--eval-seqlen", type=int, default=512)
    parser.add_argument("--perturbation-seeds", type=int, nargs="+", default=[0],
                        help="COPAL gaussian rows: one row per perturbation seed")
    parser.add_argument("--perturbation-ratios", type=float, nargs="+", default=[1.0],
                        help="COPAL gaussian rows: one row per size ratio of dX to dW")
    parser.add_argument("--orders", nargs="+", metavar="A,B,C",
                        help="run only these orders of the protocol's (datasets comma-separated, e.g. "
                             "austen,moby_dick,python); a row stays partial until every order has run")
    parser.add_argument("--output", default=os.path.join(RESULTS, "continual-smollm2-135m.json"))
    args = parser.parse_args(argv)
    protocol = continual.orders(args.datasets, args.permutations)
    selected = selected_orders(args.datasets, args.permutations, args.orders)

    model, tokenizer = load_model("smollm2-135m")
    tasks = [continual.Task(name, data.calibration_samples(tokenizer, f"{name}:first_half", nsamples=args.nsamples,
                                                           seqlen=args.seqlen, seed=args.seed),
                            data.eval_tokens(tokenizer, f"{name}:second_half", max_tokens=args.eval_tokens))
             for name in args.datasets]
    settings = {"datasets": args.datasets, "permutations": args.permutations,
                "calibration": f"{args.nsamples} x {args.seqlen} tokens of each first half (seed {args.seed})",
                "evaluation": f"first {args.eval_tokens} tokens of each second half, {args.eval_seqlen}-token windows"}
    keep = previous_result(args.output, settings)
    rows = [_current(row) for row in keep["rows"]] if keep else []
    dense = keep["dense"] if keep else {t.name: perplexity(model, t.eval_tokens, args.eval_seqlen, progress=False)
                                        for t in tasks}

    def save():
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                  "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))

    save()  # kept rows in the current format, before any new one
    for spec, row_name, options, variant in _runs(args):
        row_name, _, scope = row_name.partition("/")
        method, _, init = row_name.partition(":")
        init = init or "global"
        pattern = parse(spec) if ":" in spec else Unstructured(float(spec), scope or None)
        scope = getattr(methods.get(method).resolve(pattern), "scope", None)
        label = {"pattern": str(pattern) + (f" per {scope}" if scope else ""),
                 "method": method + (f" ({variant})" if variant else ""),
                 "init": init if method != "copal" else "continual state"}
        row = next((r for r in rows if all(r[k] == v for k, v in label.items())), None)
        if row is not None and not row.get("partial"):
            continue
        done = {tuple(r["order"]): r["steps"] for r in (row or {}).get("matrix", [])}
        if row is None:
            row = dict(label, partial=True, matrix=[])
            rows.append(row)

        def checkpoint(order, steps, row=row):
            row["matrix"].append({"order": list(order), "steps": steps})
            save()

        start = time.perf_counter()
        if selected == protocol:
            report = continual.run(model, method, pattern, tasks, init=init, permutations=args.permutations,
                                   eval_seqlen=args.eval_seqlen, progress=True, done=done, on_order=checkpoint,
                                   method_options=options)
        else:  # the chosen orders one at a time; the row is complete once every order has run
            by_name = {task.name: task for task in tasks}
            for order in selected:
                if order not in done:
                    continual.run(model, method, pattern, [by_name[name] for name in order], init=init,
                                  eval_seqlen=args.eval_seqlen, progress=True, on_order=checkpoint,
                                  method_options=options)
            matrix = {tuple(r["order"]): r["steps"] for r in row["matrix"]}
            if set(matrix) != set(protocol):
                continue
            report = continual.metrics(args.datasets, matrix) | {
                "matrix": [{"order": list(order), "steps": matrix[order]} for order in protocol]}
        report["time_s"] = round(time.perf_counter() - start, 1)
        row.clear()
        row.update(label, resumed_orders=len(done), **{k: report[k] for k in (
            "a_ppl", "a_ppl_std", "m_ppl", "a_ppl_steps", "m_ppl_steps", "a_bwt", "a_bwt_std", "m_bwt",
            "per_dataset", "matrix", "time_s")})
        save()
        print(f"{pattern} {method} ({label['init']}): A-BWT {_fmt(report['a_bwt'])} M-BWT "
              f"{_fmt(report['m_bwt'])} A-PPL {report['a_ppl']:.3f} (over every step "
              f"{report['a_ppl_steps']:.3f}) M-PPL {report['m_ppl']:.3f} "
              f"({report['time_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
