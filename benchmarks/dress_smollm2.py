"""DReSS's central comparison on SmolLM2-135M: regularise-then-slice against slicing the same
hidden channels without regularisation (the paper's "w/o R" ablation, Table 5), each before and
after LoRA recovery, for each channel choice in ``--channels``.

Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma, split 3:1 as in the paper:
the first three quarters regularise (one pass at the defaults: steps x train batch = windows),
the last quarter trains LoRA. Evaluation: the first ``--eval-tokens`` tokens of Pride and
Prejudice. Hidden size 576 -> 432 at ``--ratio 0.25``. Each row: perplexity after slicing, after
LoRA, the weight mass of the removed slices after regularisation relative to before (Fig. 5's
measure), and the wall time of each phase. Results: benchmarks/results/dress-smollm2-135m.{json,md},
rewritten after every row; a rerun skips the rows already there.

    python benchmarks/dress_smollm2.py
    python benchmarks/dress_smollm2.py --channels last --steps 120 --lam 1 --lr 1e-3
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
from pyprune.methods.dress import DReSS
from pyprune.models import load_model
from pyprune.patterns import Structured
from pyprune.recovery import lora_finetune

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULTS = {option.name: option.default for option in DReSS.options}


def markdown(result) -> str:
    s = result["settings"]
    lines = ["# DReSS on SmolLM2-135M", "",
             f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
             f"LoRA {s['lora']}; {s['threads']} threads. Dense perplexity {result['dense']:.2f}.", "",
             "| channels | setting | steps | λ | lr | slice mass after/before | ppl sliced | ppl + LoRA | "
             "regularise (s) | LoRA (s) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        trained = r["steps"] > 0
        lam, lr = (f"{r[k]:g}" if trained else "–" for k in ("lam", "lr"))
        lines.append(f"| {r['channels']} | {r['label']} | {r['steps']} | {lam} | {lr} | "
                     f"{r['slice_mass_ratio']:.3f} | {r['ppl_sliced']:.2f} | {r['ppl_lora']:.2f} | "
                     f"{r['regularise_s']:.0f} | {r['lora_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=DReSS.calibration[0])
    parser.add_argument("--seqlen", type=int, default=DReSS.calibration[1])
    parser.add_argument("--channels", default="quiet,last",
                        help="comma-separated channel choices, each a pair of rows (quiet, last, first, spread)")
    for name in ("steps", "lam", "lr", "norm", "train_batch", "rescale_norms", "lora_steps", "lora_lr"):
        kind = type(DEFAULTS[name])
        parser.add_argument(f"--{name.replace('_', '-')}", default=DEFAULTS[name],
                            type=(lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind)
    parser.set_defaults(lora_steps=50)
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
                "lora": f"{args.lora_steps} steps, rank 32, alpha 10, lr {args.lora_lr:g}, batch {args.train_batch}",
                "threads": torch.get_num_threads()}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else perplexity(dense_model, tokens, args.eval_seqlen, progress=False)

    trained = {k: getattr(args, k) for k in ("lam", "lr", "norm", "train_batch")}
    for channels in args.channels.split(","):
        for label, options in (("slice only (w/o R)", {"steps": 0}),
                               (f"DReSS-{args.norm}", {"steps": args.steps, **trained})):
            options.update(channels=channels, rescale_norms=args.rescale_norms)
            if any(r["label"] == label and all(r.get(k) == v for k, v in options.items()) for r in rows):
                continue
            model = copy.deepcopy(dense_model)
            start = time.perf_counter()
            report = pyprune.prune(model, "dress", Structured(args.ratio), regularise, progress=True, **options)
            regularise_s = time.perf_counter() - start
            ppl_sliced = perplexity(model, tokens, args.eval_seqlen, progress=False)
            start = time.perf_counter()
            lora_finetune(model, recover, steps=args.lora_steps, rank=32, alpha=10.0, lr=args.lora_lr,
                          batch_size=args.train_batch, progress=True)
            lora_s = time.perf_counter() - start
            ppl_lora = perplexity(model, tokens, args.eval_seqlen, progress=False)
            log = report["regularisation"]
            row = {"label": label, **dict.fromkeys(trained), **options,
                   "slice_mass_ratio": report["slice_mass_ratio"], "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora,
                   "regularise_s": regularise_s, "lora_s": lora_s, "hidden_size": report["hidden_size"],
                   "pruned_channels": report["pruned_channels"],
                   "parameters": [report["cost_before"]["parameters"], report["cost_after"]["parameters"]],
                   "loss": log.get("loss"), "penalty": log.get("penalty")}
            rows.append(row)
            print(f"{channels} {label}: mass {row['slice_mass_ratio']:.3f}, ppl sliced {ppl_sliced:.2f}, "
                  f"+ LoRA {ppl_lora:.2f}", flush=True)
            result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                      "rows": rows}
            write_json(args.output, result)
            write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
