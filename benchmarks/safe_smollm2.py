"""SAFE / SAFE⁺ against Wanda and SparseGPT on SmolLM2-135M (the paper's Table 1 setting, small).

Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma (the embedded corpus ``emma``);
evaluation: perplexity on the first ``--eval-tokens`` tokens of Pride and Prejudice in
``--seqlen`` windows. Every row prunes a fresh copy of the dense model; SAFE runs with its CPU
defaults unless ``--safe-options`` sets others (e.g. the paper's ``epochs=30 train_batch=8
dual_interval=32``). Results go to benchmarks/results/safe-smollm2-135m.{json,md}, rewritten after
every row; a rerun with the same settings resumes. Each SAFE row also records its convergence
diagnostics (‖x − z‖/‖x‖ at every dual update, first and last block losses).

    python benchmarks/safe_smollm2.py                                 # the README table
    python benchmarks/safe_smollm2.py --patterns 2:4 --methods safe+ wanda --safe-options lr=1e-3
"""
import argparse
import copy
import os
import sys

import torch

from _common import environment, previous_result, write_atomic, write_json
import pyprune
from pyprune import data
from pyprune.eval import perplexity
from pyprune.models import load_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("wanda", "sparsegpt", "safe", "safe+")


def _option(text: str):
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE; got {text!r}")
    for convert in (int, float):
        try:
            return name, convert(value)
        except ValueError:
            pass
    return name, value


def markdown(result) -> str:
    s = result["settings"]
    env = result["environment"]
    lines = ["# SAFE / SAFE⁺ on SmolLM2-135M (paper Table 1, small)", "",
             f"Calibration {s['calibration']}; evaluation {s['evaluation']}; SAFE options "
             f"{s['safe_options'] or 'the CPU defaults'}; {env['device']}, {env['cpu_threads']} threads, "
             f"torch {env['torch']}.", "",
             f"Dense perplexity: {result['dense']:.3f}", "",
             "| pattern | method | perplexity | measured sparsity | pattern valid | ‖x−z‖/‖x‖ first → last dual "
             "update (mean over blocks) | prune time (s) |",
             "|---|---|---:|---:|---|---|---:|"]
    for row in result["rows"]:
        residual = (f"{row['residual_first']:.3f} → {row['residual_last']:.3f}"
                    if row.get("residual_first") is not None else "–")
        lines.append(f"| {row['pattern']} | {row['method']} | {row['perplexity']:.3f} | {row['sparsity']:.3f} | "
                     f"{row['valid']} | {residual} | {row['time_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["0.5", "2:4"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--safe-options", nargs="*", type=_option, default=[],
                        help="NAME=VALUE method options for the SAFE rows (e.g. lr=1e-3 epochs=30)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "safe-smollm2-135m.json"))
    args = parser.parse_args(argv)

    safe_options = dict(args.safe_options)
    for method in ("safe", "safe+"):
        pyprune.methods.get(method, **safe_options)  # a bad option fails before the model loads
    dense_model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    settings = {"calibration": f"{args.nsamples} x {args.seqlen} tokens of emma (seed {args.seed})",
                "evaluation": f"first {args.eval_tokens} tokens of pride_and_prejudice, {args.seqlen}-token windows",
                "safe_options": safe_options}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else perplexity(dense_model, tokens, args.seqlen, progress=False)

    def save():
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                  "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))

    save()
    for spec in args.patterns:
        for method in args.methods:
            pattern = pyprune.patterns.parse(spec)
            options = safe_options if method.startswith("safe") else {}
            resolved = pyprune.methods.get(method, **options).settings
            if any(r["pattern"] == str(pattern) and r["method"] == method and r["options"] == resolved
                   for r in rows):
                continue  # done before with the same options (a changed default reruns the row)
            rows[:] = [r for r in rows if not (r["pattern"] == str(pattern) and r["method"] == method)]
            model = copy.deepcopy(dense_model)
            report = pyprune.prune(model, method, pattern, calib, **options)
            row = {"pattern": str(pattern), "method": method, "options": report["options"],
                   "perplexity": perplexity(model, tokens, args.seqlen, progress=False),
                   "sparsity": report["sparsity"], "time_s": report["time_s"],
                   "valid": report["nm_valid"].get(str(pattern), "–") if ":" in str(pattern) else "–"}
            if "blocks" in report:
                blocks = report["blocks"]
                row["residual_first"] = sum(b["residuals"][0] for b in blocks) / len(blocks)
                row["residual_last"] = sum(b["residuals"][-1] for b in blocks) / len(blocks)
                row["blocks"] = blocks
            rows.append(row)
            save()
            print(f"{pattern} {method}: perplexity {row['perplexity']:.3f} ({row['time_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
