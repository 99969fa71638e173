"""DReSS's central comparison on SmolLM2-135M: regularise-then-slice against slicing the same
hidden channels without regularisation (the paper's "w/o R" ablation, Table 5), each before and
after LoRA recovery.

Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma, split 3:1 as in the paper:
the first three quarters regularise, the last quarter trains LoRA. Evaluation: the first
``--eval-tokens`` tokens of Pride and Prejudice. Hidden size 576 -> 432 at ``--ratio 0.25``.
Rows: for each setting (``steps=0`` and the DReSS settings), perplexity after slicing, after
LoRA, the weight mass of the removed slices after regularisation relative to before, time.
Results: benchmarks/results/dress-smollm2-135m.{json,md}, rewritten after every row; a rerun
skips the rows already there.

    python benchmarks/dress_smollm2.py
    python benchmarks/dress_smollm2.py --steps 60 --lr 1e-4 --lam 1e-3
"""
import argparse
import copy
import os
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
import pyprune
from pyprune import data
from pyprune.eval import perplexity
from pyprune.models import load_model
from pyprune.patterns import Structured
from pyprune.recovery import lora_finetune

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def markdown(result) -> str:
    s = result["settings"]
    lines = ["# DReSS on SmolLM2-135M", "",
             f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
             f"LoRA {s['lora']}. Dense perplexity {result['dense']:.3f}.", "",
             "| setting | channels | steps | λ | lr | norm | slice mass after/before | ppl sliced | ppl + LoRA | "
             "regularise (s) | LoRA (s) |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lam, lr = (f"{r[k]:g}" if r["steps"] and r[k] is not None else "–" for k in ("lam", "lr"))
        lines.append(f"| {r['label']} | {r.get('channels', 'last')} | {r['steps']} | {lam} | {lr} | {r['norm']} | "
                     f"{r['slice_mass_ratio']:.3f} | {r['ppl_sliced']:.3f} | {r['ppl_lora']:.3f} | "
                     f"{r['regularise_s']:.0f} | {r['lora_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60, help="DReSS regularisation steps")
    parser.add_argument("--lam", type=float, default=1e-3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--norm", choices=["l2", "l1"], default="l2")
    parser.add_argument("--channels", choices=["last", "first", "spread"], default="last",
                        help="which hidden channels go (paper default: the last)")
    parser.add_argument("--lora-steps", type=int, default=30)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--output", default=os.path.join(RESULTS, "dress-smollm2-135m.json"))
    args = parser.parse_args(argv)

    dense_model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    split = (3 * args.nsamples) // 4
    regularise, recover = calib[:split], calib[split:]
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    settings = {"hidden": f"576 -> ratio {args.ratio}",
                "calibration": f"{split} x {args.seqlen} Emma windows regularise, {args.nsamples - split} train LoRA",
                "evaluation": f"first {args.eval_tokens} tokens of pride_and_prejudice, {args.eval_seqlen}-token windows",
                "lora": f"{args.lora_steps} steps, rank 32, alpha 10"}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else perplexity(dense_model, tokens, args.eval_seqlen, progress=False)

    common = {"norm": args.norm, "channels": args.channels}
    for label, options in (("slice only (w/o R)", {"steps": 0, **common}),
                           (f"DReSS-{args.norm}", {"steps": args.steps, "lam": args.lam, "lr": args.lr, **common})):
        if any(r["label"] == label and all(r.get(k, "last" if k == "channels" else None) == v
                                           for k, v in options.items()) for r in rows):
            continue
        model = copy.deepcopy(dense_model)
        start = time.perf_counter()
        report = pyprune.prune(model, "dress", Structured(args.ratio), regularise, progress=True, **options)
        regularise_s = time.perf_counter() - start
        ppl_sliced = perplexity(model, tokens, args.eval_seqlen, progress=False)
        start = time.perf_counter()
        lora_finetune(model, recover, steps=args.lora_steps, rank=32, alpha=10.0, progress=True)
        lora_s = time.perf_counter() - start
        ppl_lora = perplexity(model, tokens, args.eval_seqlen, progress=False)
        row = {"label": label, "lam": None, "lr": None, **options, "slice_mass_ratio": report["slice_mass_ratio"],
               "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora, "regularise_s": regularise_s, "lora_s": lora_s,
               "hidden_size": report["hidden_size"], "parameters": [report["parameters_before"],
                                                                    report["parameters_after"]],
               "loss": report["regularisation"].get("loss"), "penalty": report["regularisation"].get("penalty")}
        rows.append(row)
        print(f"{label}: mass {row['slice_mass_ratio']:.3f}, ppl sliced {ppl_sliced:.3f}, + LoRA {ppl_lora:.3f}",
              flush=True)
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                  "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
