"""COPAL's continual table over calibration draws: results of ``continual_smollm2.py`` merged by seed.

Each input is a results file of ``continual_smollm2.py`` run with the same protocol but its own
``--seed`` (the draw of the calibration windows). For the rows every input holds (same pattern,
method and init) and the orders every one of them finished, this writes each seed's A-BWT and
A-PPL (means over those orders, as in the input files), their mean ± standard deviation over the
seeds, and each (seed, order)'s own A-BWT / mean final perplexity for paired comparisons.

    python benchmarks/continual_seeds_smollm2.py \\
        benchmarks/results/continual-smollm2-135m-unstructured50-orders.json \\
        benchmarks/results/continual-smollm2-135m-unstructured50-orders-seed1.json \\
        --output benchmarks/results/continual-smollm2-135m-unstructured50-seeds.json
"""
import argparse
import json
import os
import re
import statistics
import sys

from _common import write_atomic, write_json
from pyprune.studies import continual

SEED = re.compile(r" \(seed (\d+)\)")


def _label(row):
    return row["pattern"], row["method"], row["init"]


def merge(results) -> dict:
    """The seeds summary of ``results`` (loaded results files, one per calibration seed)."""
    protocols = {json.dumps({**r["settings"], "calibration": SEED.sub("", r["settings"]["calibration"])},
                            sort_keys=True) for r in results}
    if len(protocols) != 1:
        raise SystemExit("inputs: the results files differ in more than the calibration seed; got settings "
                         + " / ".join(protocols))
    seeds = [int(SEED.search(r["settings"]["calibration"]).group(1)) for r in results]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"inputs: each file must have its own calibration seed; got seeds {seeds}")
    settings = json.loads(protocols.pop())
    by_file = [{_label(row): {tuple(run["order"]): run["steps"] for run in row["matrix"]} for row in r["rows"]}
               for r in results]
    labels = [label for label in by_file[0] if all(by_file_i.get(label) for by_file_i in by_file)]
    common = set.intersection(*(set(rows[label]) for rows in by_file for label in labels)) if labels else set()
    orders = [order for order in continual.orders(settings["datasets"], settings["permutations"]) if order in common]
    if not orders:
        raise SystemExit("inputs: no row has finished a common order in every file")
    names = settings["datasets"]
    rows = []
    for label in labels:
        per_seed = []
        for seed, file_rows in zip(seeds, by_file):
            matrix = {order: file_rows[label][order] for order in orders}
            measured = continual.metrics(names, matrix)
            per_seed.append({"seed": seed, "a_bwt": measured["a_bwt"], "a_ppl": measured["a_ppl"],
                             "orders": {" → ".join(order): continual.metrics(names, {order: matrix[order]})
                                        for order in orders}})
        rows.append({"pattern": label[0], "method": label[1], "init": label[2], "per_seed": per_seed} | {
            f"{key}_{stat}": fn([s[key] for s in per_seed]) for key in ("a_bwt", "a_ppl")
            for stat, fn in (("mean", statistics.fmean), ("std", statistics.pstdev))})
    return {"settings": settings | {"calibration_seeds": seeds}, "orders": [list(o) for o in orders],
            "dense": results[0]["dense"], "rows": rows}


def markdown(summary) -> str:
    s = summary["settings"]
    seeds = s["calibration_seeds"]
    orders = [" → ".join(order) for order in summary["orders"]]
    lines = ["# Continual pruning on SmolLM2-135M over calibration seeds", "",
             f"Datasets {', '.join(s['datasets'])}; calibration {s['calibration']}, drawn with seeds "
             f"{', '.join(map(str, seeds))}; evaluation {s['evaluation']}. Orders: {len(orders)} "
             f"({'; '.join(orders)}), the ones every row below finished for every seed. A-BWT, A-PPL: means over "
             "those orders (as in the per-seed results files); mean ± standard deviation over the seeds.", "",
             "| pattern | method | init | A-BWT | A-PPL | "
             + " | ".join(f"seed {seed}: A-BWT / A-PPL" for seed in seeds) + " |", "|---|---|---|---:|---:|" + "---:|" * len(seeds)]
    for row in summary["rows"]:
        lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | "
                     f"{row['a_bwt_mean']:.3f} ± {row['a_bwt_std']:.2f} | {row['a_ppl_mean']:.3f} ± "
                     f"{row['a_ppl_std']:.2f} | " + " | ".join(f"{p['a_bwt']:.3f} / {p['a_ppl']:.3f}"
                                                            for p in row["per_seed"]) + " |")
    lines += ["", "Per seed and order: A-BWT / mean final perplexity of that order alone.", "",
              "| pattern | method | init | seed | " + " | ".join(orders) + " |",
              "|---|---|---|---:|" + "---:|" * len(orders)]
    for row in summary["rows"]:
        for p in row["per_seed"]:
            lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | {p['seed']} | " + " | ".join(
                f"{p['orders'][o]['a_bwt']:.2f} / {p['orders'][o]['a_ppl']:.2f}" for o in orders) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="results files of continual_smollm2.py, one per --seed")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    results = []
    for path in args.inputs:
        with open(path, encoding="utf-8") as handle:
            results.append(json.load(handle))
    summary = merge(results)
    write_json(args.output, summary)
    write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
