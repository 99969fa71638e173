"""OWL's layer-wise sparsity beside uniform sparsity: Wanda and SparseGPT at 50%, 60%, 70% on
SmolLM2-135M (or another alias), each uniform and with ``owl`` (M = 5, λ = 0.08, the paper's).

The protocol of benchmarks/baselines_smollm2.py (the README table): calibration ``--nsamples`` x
``--seqlen`` random windows of Emma, evaluation the first ``--eval-tokens`` tokens of Pride and
Prejudice in ``--seqlen`` windows (with BOS where the tokenizer starts texts with it). Each row
prunes a fresh copy of the dense model; the OWL rows record the block sparsities' range and the
outlier ratios. Results: results/owl-<model>.{json,md}, rewritten after every row; a rerun with the
same settings skips the rows already there.

    python benchmarks/owl_smollm2.py                                  # 16 x 256, 8192 tokens
    python benchmarks/owl_smollm2.py --model gemma3-270m --eval-tokens 4096
"""
import argparse
import copy
import os
import sys

import torch

import pyprune
from _common import environment, previous_result, write_atomic, write_json
from baselines_smollm2 import MODELS
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.patterns import Unstructured

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def runs(methods, sparsities):
    """(method, sparsity, owl) of every row: uniform, then OWL, per method and sparsity."""
    return [(method, sparsity, use_owl) for method in methods for sparsity in sparsities for use_owl in (False, True)]


def markdown(result) -> str:
    s = result["settings"]
    lines = [f"# OWL layer-wise sparsity on {result['model']}", "",
             f"Calibration {s['nsamples']} x {s['seqlen']} tokens of Emma (seed {s['seed']}); evaluation "
             f"{result['evaluation']}; OWL M = {s['owl_m']}, λ = {s['owl_lambda']}; "
             f"{result['environment']['cpu_threads']} thread(s). Dense perplexity {result['dense']:.2f}. "
             "Prune time includes OWL's outlier-ratio pass.", "",
             "| method | sparsity | allocation | measured sparsity | block sparsity min–max | perplexity | "
             "prune time (s) |", "|---|---:|---|---:|---|---:|---:|"]
    for r in result["results"]:
        spread = f"{min(r['block_sparsity']):.3f}–{max(r['block_sparsity']):.3f}" if r["owl"] else "–"
        lines.append(f"| {r['method']} | {r['target']:g} | {'OWL' if r['owl'] else 'uniform'} | "
                     f"{r['sparsity']:.3f} | {spread} | {r['perplexity']:.2f} | {r['time_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="*", default=["wanda", "sparsegpt"])
    parser.add_argument("--sparsities", nargs="*", type=float, default=[0.5, 0.6, 0.7])
    parser.add_argument("--owl-m", type=float, default=5.0)
    parser.add_argument("--owl-lambda", type=float, default=0.08)
    parser.add_argument("--output", help="results JSON (default: results/owl-<model>.json)")
    args = parser.parse_args(argv)
    name = os.path.basename(os.path.normpath(args.model))
    output = args.output or os.path.join(RESULTS, f"owl-{name}.json")

    settings = {k: getattr(args, k) for k in ("model", "nsamples", "seqlen", "eval_tokens", "seed", "owl_m",
                                              "owl_lambda")}
    dense_model, tokenizer = load_model(args.model)
    bos = data.window_bos(tokenizer)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    previous = previous_result(output, settings)
    rows = previous["results"] if previous else []
    result = {"model": MODELS.get(args.model, args.model), "settings": settings,
              "evaluation": f"first {tokens.numel()} tokens of austen/pride_and_prejudice.txt, {args.seqlen}-token "
                            "windows" + (" each starting with <bos>" if bos is not None else ""),
              "dense": previous["dense"] if previous else perplexity(dense_model, tokens, args.seqlen,
                                                                     bos_token_id=bos),
              "environment": environment(torch.device("cpu")), "results": rows}
    for method, sparsity, use_owl in runs(args.methods, args.sparsities):
        if any((r["method"], r["target"], r["owl"]) == (method, sparsity, use_owl) for r in rows):
            continue
        model = copy.deepcopy(dense_model)
        options = {"owl": True, "owl_m": args.owl_m, "owl_lambda": args.owl_lambda} if use_owl else {}
        report = pyprune.prune(model, method, Unstructured(sparsity), calib, **options)
        ppl = perplexity(model, tokens, args.seqlen, bos_token_id=bos)
        rows.append({"method": method, "target": sparsity, "owl": use_owl, "sparsity": round(report["sparsity"], 4),
                     "perplexity": ppl, "time_s": report["time_s"],
                     "block_sparsity": report.get("owl", {}).get("block_sparsity"),
                     "outlier_ratio": report.get("owl", {}).get("outlier_ratio")})
        print(f"{method} {sparsity:g} {'owl' if use_owl else 'uniform'}: perplexity {ppl:.3f}, "
              f"{report['time_s']:.1f} s", flush=True)
        del model
        write_json(output, result)
        write_atomic(os.path.splitext(output)[0] + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
