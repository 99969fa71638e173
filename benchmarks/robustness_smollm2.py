"""MoreauPruner's robustness table (Table 1) and 20% structured comparison on SmolLM2-135M.

For every method and calibration seed: prune SmolLM2-135M at ``--ratio`` (default 0.2) with its
weights in bf16 and in fp16 (:func:`pyprune.robustness.study`), and record both perplexities,
``ppl_diff`` and ``agreement``. Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma
(default 10 x 128, the paper's batch size), one draw per seed; evaluation: the first
``--eval-tokens`` tokens of Pride and Prejudice in 128-token windows (the paper's window).
The paper's hyperparameters are every method's defaults.

Results go to benchmarks/results/robustness-smollm2-135m.{json,md}, rewritten atomically after
every run; a rerun skips the (method, seed) runs already there, so a stopped run resumes.

    python benchmarks/robustness_smollm2.py                       # the README table
    python benchmarks/robustness_smollm2.py --methods taylor moreau --seeds 0
"""
import argparse
import os
import statistics
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
from pyprune import data, robustness
from pyprune.models import load_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("taylor", "smoothgrad", "moreau", "moreau-gs")


def _summary(values):
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def markdown(result) -> str:
    runs = result["runs"]
    lines = [f"SmolLM2-135M, structured ratio {result['settings']['ratio']} (layers "
             f"{result['settings']['layers']}), calibration {result['settings']['calibration']}, "
             f"evaluation {result['settings']['evaluation']}, arithmetic {result['settings']['arithmetic']}; "
             f"{result['environment']['device']}, {result['environment']['cpu_threads']} threads, torch "
             f"{result['environment']['torch']}. Mean ± std over calibration seeds "
             f"{sorted({r['seed'] for r in runs})}.", "",
             "| method | seeds | ppl bf16 | ppl fp16 | ppl_diff | agreement | prune time per format (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for method in [m for m in METHODS if any(r["method"] == m for r in runs)]:
        rows = [r for r in runs if r["method"] == method]
        cells = []
        for key in ("ppl_bf16", "ppl_fp16", "ppl_diff", "agreement"):
            mean, std = _summary([r[key] for r in rows])
            cells.append(f"{mean:.4f} ± {std:.4f}" if key == "agreement" else f"{mean:.2f} ± {std:.2f}")
        seconds = statistics.fmean(r["runs"][f]["time_s"] for r in rows for f in ("bfloat16", "float16"))
        lines.append(f"| {method} | {len(rows)} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    lines += ["", "Per seed:", "", "| method | seed | ppl bf16 | ppl fp16 | ppl_diff | agreement |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['seed']} | {r['ppl_bf16']:.2f} | {r['ppl_fp16']:.2f} | "
              f"{r['ppl_diff']:.2f} | {r['agreement']:.4f} |" for r in runs]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="calibration seeds")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--first-layer", type=int, default=0, help="first pruned layer (paper on LLaMA-7B: 4)")
    parser.add_argument("--last-layer", type=int, default=-1, help="last pruned layer, inclusive")
    parser.add_argument("--nsamples", type=int, default=10)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--eval-seqlen", type=int, default=128)
    parser.add_argument("--arithmetic", choices=robustness.ARITHMETIC, default="fp32-accumulate")
    parser.add_argument("--smoothgrad-passes", type=int, default=100, help="SmoothGrad's K (paper: 100)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "robustness-smollm2-135m.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model("smollm2-135m")
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    settings = {"ratio": args.ratio, "layers": f"{args.first_layer}..{args.last_layer}",
                "calibration": f"{args.nsamples} x {args.seqlen} tokens of emma",
                "evaluation": f"first {tokens.numel() // args.eval_seqlen * args.eval_seqlen} tokens of "
                              f"pride_and_prejudice, {args.eval_seqlen}-token windows",
                "arithmetic": args.arithmetic, "smoothgrad_passes": args.smoothgrad_passes}
    previous = previous_result(args.output, settings)
    runs = previous["runs"] if previous else []
    for seed in args.seeds:
        calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=seed)
        for method in args.methods:
            if any(r["method"] == method and r["seed"] == seed for r in runs):
                continue
            options = {"first_layer": args.first_layer, "last_layer": args.last_layer}
            if method == "smoothgrad":
                options["passes"] = args.smoothgrad_passes
            start = time.perf_counter()
            report = robustness.study(model, method, args.ratio, calib, tokens, eval_seqlen=args.eval_seqlen,
                                      arithmetic=args.arithmetic, progress=False, **options)
            report["seed"] = seed
            report["wall_s"] = round(time.perf_counter() - start, 1)
            runs.append(report)
            print(f"{method} seed {seed}: bf16 {report['ppl_bf16']:.2f}, fp16 {report['ppl_fp16']:.2f}, "
                  f"diff {report['ppl_diff']:.2f}, agreement {report['agreement']:.4f} ({report['wall_s']} s)",
                  flush=True)
            result = {"settings": settings, "environment": environment(torch.device("cpu")), "runs": runs}
            write_json(args.output, result)
            write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
