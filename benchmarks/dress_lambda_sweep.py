"""DReSS's penalty weight λ on SmolLM2-135M: one regularise-then-slice run per λ (1e-3 ... 10 by
default; the paper's 1e-3, this project's CPU default 1) with everything else at the DReSS
benchmark's settings (quiet channels, ``--steps`` AdamW steps at ``--lr`` over the 600 Emma windows,
ratio 0.25), no LoRA. Each row: the slice mass after/before (Fig. 5's measure), the LM loss and the
penalty at the first and last step, perplexity of the sliced model on Pride and Prejudice and Moby
Dick. With AdamW, once λ·penalty dominates the LM loss's gradient every penalised weight moves
~lr per step toward 0 (scheduled zeroing); below that λ trades the penalty against the loss.
Results: benchmarks/results/dress-lambda-sweep-smollm2-135m.{json,md}, rewritten after every row;
a rerun skips the λ already there.

    python benchmarks/dress_lambda_sweep.py
    python benchmarks/dress_lambda_sweep.py --lams 0.001 1 --steps 50
"""
import argparse
import copy
import os
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
import pyprune
from pyprune.inputs import data
from pyprune.evaluation.perplexity import perplexity
from pyprune.methods.dress import DReSS
from pyprune.inputs.models import load_model
from pyprune.patterns import Structured

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULTS = {option.name: option.default for option in DReSS.options}
EVAL_TEXTS = ("pride_and_prejudice", "moby_dick")


def markdown(result) -> str:
    s = result["settings"]
    lines = ["# DReSS λ sweep on SmolLM2-135M", "",
             f"{s['method']}; calibration {s['calibration']}; evaluation {s['evaluation']}. Dense perplexity "
             + ", ".join(f"{t} {v:.2f}" for t, v in result["dense"].items()) + ".", "",
             "| λ | slice mass after/before | LM loss first → last | λ·penalty first → last | "
             + " | ".join(f"{t} sliced" for t in EVAL_TEXTS) + " | time (s) |",
             "|---:|---:|---:|---:|" + "---:|" * len(EVAL_TEXTS) + "---:|"]
    for r in sorted(result["rows"], key=lambda r: r["lam"]):
        lines.append(f"| {r['lam']:g} | {r['slice_mass_ratio']:.3f} | {r['loss'][0]:.3f} → {r['loss'][-1]:.3f} | "
                     f"{r['penalty'][0]:.3g} → {r['penalty'][-1]:.3g} | "
                     + " | ".join(f"{r['ppl_sliced'][t]:.2f}" for t in EVAL_TEXTS) + f" | {r['time_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lams", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0, 10.0])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=DReSS.calibration[0])
    parser.add_argument("--seqlen", type=int, default=DReSS.calibration[1])
    parser.add_argument("--channels", default="quiet", choices=("quiet", "last", "first", "spread"))
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--output", default=os.path.join(RESULTS, "dress-lambda-sweep-smollm2-135m.json"))
    args = parser.parse_args(argv)

    dense_model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    regularise = calib[:(3 * args.nsamples) // 4]  # the DReSS benchmark's regularisation windows
    tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=args.eval_tokens) for text in EVAL_TEXTS}
    settings = {"method": f"DReSS-{DEFAULTS['norm']}, {args.channels} channels, ratio {args.ratio}, {args.steps} AdamW "
                          f"steps at lr {args.lr:g}, batch {DEFAULTS['train_batch']}",
                "calibration": f"{regularise.shape[0]} x {args.seqlen} Emma windows",
                "evaluation": f"first {args.eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, "
                              f"{args.eval_seqlen}-token windows", "threads": torch.get_num_threads()}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else {t: perplexity(dense_model, ids, args.eval_seqlen, progress=False)
                                        for t, ids in tokens.items()}
    for lam in args.lams:
        if any(r["lam"] == lam for r in rows):
            continue
        model = copy.deepcopy(dense_model)
        start = time.perf_counter()
        report = pyprune.prune(model, "dress", Structured(args.ratio), regularise, progress=True, lam=lam,
                               steps=args.steps, lr=args.lr, channels=args.channels)
        log = report["regularisation"]
        row = {"lam": lam, "slice_mass_ratio": report["slice_mass_ratio"],
               "slice_mass_ratio_per_kind": report["slice_mass_ratio_per_kind"],
               "loss": log["loss"], "penalty": log["penalty"], "time_s": time.perf_counter() - start,
               "ppl_sliced": {t: perplexity(model, ids, args.eval_seqlen, progress=False) for t, ids in tokens.items()}}
        rows.append(row)
        print(f"λ {lam:g}: mass {row['slice_mass_ratio']:.3f}, ppl sliced {row['ppl_sliced']}", flush=True)
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense, "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
