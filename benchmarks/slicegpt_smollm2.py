"""SliceGPT beside DReSS on SmolLM2-135M, with the calibration and evaluation of study ``dress``
(pyprune/studies/dress.py; its functions and settings reused): ``--nsamples`` x ``--seqlen``
random Emma windows (seed 0), the first three quarters calibrate (DReSS regularises on them,
SliceGPT computes its PCAs on them, or on the first
``--pca-windows`` of them), the last quarter trains LoRA (same steps, rank, alpha, lr,
batch); perplexity on the first ``--eval-tokens`` tokens of Pride and Prejudice and Moby Dick,
sliced and after LoRA; zero-shot accuracy with ``--tasks``, sliced (as SLEB's rows, without
recovery) and after LoRA. Prune (PCA + rotation)
time and parameter counts recorded (SliceGPT's model carries an untied LM head and two k x k
shortcut matrices per block). The DReSS rows of the table are read from
benchmarks/results/dress-smollm2-135m.json when its settings match, never re-run here, and so are
the dense perplexity and zero-shot scores it measured with them.

Results: benchmarks/results/dress-slicegpt-smollm2-135m.{json,md}, rewritten after every row; a
rerun skips the rows already there.

    python benchmarks/slicegpt_smollm2.py --tasks austen_continuation,moby_dick_continuation
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

from _common import environment, previous_result, write_atomic, write_json
import pyprune
from pyprune.evaluation import zeroshot
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.methods.dress import DReSS
from pyprune.patterns import Structured
from pyprune.runtime.recovery import lora_finetune
from pyprune.studies import dress

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def dress_result(path, settings):
    """DReSS's results file, when it was run with these settings (else None): its rows are quoted
    and its dense scores (the same model, windows and evaluation) reused."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        stored = json.load(handle)
    return stored if stored.get("settings") == settings else None


def markdown(result, dress_result_rows) -> str:
    s = result["settings"]
    texts = list(result["dense"])
    tasks = sorted({t for r in result["rows"] + dress_result_rows
                    for t in {**r.get("zero_shot_sliced", {}), **(r.get("zero_shot_lora") or {})}})
    lines = ["# SliceGPT beside DReSS on SmolLM2-135M", "",
             f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
             f"LoRA {s['lora']}; {s['threads']} threads. Dense perplexity "
             + ", ".join(f"{t} {v:.2f}" for t, v in result["dense"].items()) + ". The same windows and evaluation "
             "as study dress; its rows are quoted from dress-smollm2-135m.json. "
             "'prune (s)' is SliceGPT's PCA + rotation, DReSS's regularisation + slicing.", "",
             "| method | setting | parameters | " + " | ".join(f"{t} sliced | {t} + LoRA" for t in texts)
             + "".join(f" | {t} sliced | {t} + LoRA" for t in tasks) + " | prune (s) | LoRA (s) |",
             "|---|---|---:|" + "---:|---:|" * (len(texts) + len(tasks)) + "---:|---:|"]

    def scores(row):
        """Each task's accuracy sliced, then after LoRA ('–' where not scored)."""
        found = [row.get("zero_shot_sliced") or {}, row.get("zero_shot_lora") or {}]
        return [f"{scored[t]['acc']:.3f} ± {scored[t]['stderr']:.3f}" if t in scored else "–"
                for t in tasks for scored in found]

    for r in result["rows"]:
        lora = r["ppl_lora"] or {}
        lines.append(f"| SliceGPT | {r['label']} | {r['parameters'][1]:,} | "
                     + " | ".join(f"{r['ppl_sliced'][t]:.2f} | " + (f"{lora[t]:.2f}" if t in lora else "–")
                                  for t in texts)
                     + "".join(f" | {v}" for v in scores(r)) + f" | {r['prune_s']:.0f} | "
                     + (f"{r['lora_s']:.0f} |" if r["lora_s"] is not None else "– |"))
    for r in dress_result_rows:
        lines.append(f"| DReSS ({r['channels']}) | {r['label']} | {r['parameters'][1]:,} | "
                     + " | ".join(f"{r['ppl_sliced'][t]:.2f} | {r['ppl_lora'][t]:.2f}" for t in texts)
                     + "".join(f" | {v}" for v in scores(r)) + f" | {r['train_s']:.0f} | {r['lora_s']:.0f} |")
    dense = result.get("dense_zero_shot", {})
    if dense:
        lines += ["", "Dense zero-shot: " + ", ".join(f"{t} {v['acc']:.3f} ± {v['stderr']:.3f}"
                                                    for t, v in sorted(dense.items())) + "."]
    for r in result["rows"]:
        kept = r["kept_variance"]
        lines += ["", f"SliceGPT {r['label']}: share of the residual signal's variance (Σ eigenvalues) in the kept "
                  f"{r['hidden_size'][1]} of {r['hidden_size'][0]} directions: embedding {kept['embedding']:.4f}, "
                  f"block outputs min {min(kept['block_output']):.4f} / max {max(kept['block_output']):.4f}, "
                  f"attention outputs min {min(kept['attention_output']):.4f} / "
                  f"max {max(kept['attention_output']):.4f}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=DReSS.calibration[0])
    parser.add_argument("--seqlen", type=int, default=DReSS.calibration[1])
    parser.add_argument("--lora-steps", type=int, default=50)
    parser.add_argument("--lora-lr", type=float, default=DReSS.lora_lr.default)
    parser.add_argument("--train-batch", type=int, default=DReSS.train_batch.default)
    parser.add_argument("--batch-size", type=int, default=8, help="SliceGPT's calibration batch")
    parser.add_argument("--pca-windows", type=int, default=None,
                        help="SliceGPT's PCAs on the first N of the calibration windows (default all; DReSS ranks "
                             "its quiet channels on the first 64)")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--no-recovery", action="store_true",
                        help="the sliced model only: no LoRA (the row says so)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated zero-shot tasks scored on the sliced model and after LoRA")
    parser.add_argument("--limit", type=int, default=200, help="items per zero-shot task")
    parser.add_argument("--dress-results", default=os.path.join(RESULTS, "dress-smollm2-135m.json"))
    parser.add_argument("--output", default=os.path.join(RESULTS, "dress-slicegpt-smollm2-135m.json"))
    args = parser.parse_args(argv)
    tasks = zeroshot.load_tasks(args.tasks.split(",")) if args.tasks else None

    dense_model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    split = (3 * args.nsamples) // 4
    calibrate, recover = calib[:split], calib[split:]
    tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=args.eval_tokens) for text in dress.EVAL_TEXTS}
    settings = {"hidden": f"576 -> ratio {args.ratio}",  # the strings of study dress: its rows match
                "calibration": f"{split} x {args.seqlen} Emma windows train, {args.nsamples - split} train LoRA",
                "evaluation": f"first {args.eval_tokens} tokens of {' and '.join(dress.EVAL_TEXTS)}, "
                              f"{args.eval_seqlen}-token windows",
                "lora": f"{args.lora_steps} steps, rank 32, alpha 10, lr {args.lora_lr:g}, batch {args.train_batch}",
                "threads": torch.get_num_threads()}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    measured = keep or dress_result(args.dress_results, settings)
    dense = measured["dense"] if measured else {text: perplexity(dense_model, ids, args.eval_seqlen, progress=False)
                                                for text, ids in tokens.items()}
    dense_zero_shot = measured.get("dense_zero_shot", {}) if measured else {}
    if tasks is not None and not set(tasks.tasks) <= set(dense_zero_shot):
        dense_zero_shot.update(dress.zero_shot(dense_model, tokenizer, tasks, args.limit))

    def save():
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                  "dense_zero_shot": dense_zero_shot, "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md",
                     markdown(result, (dress_result(args.dress_results, settings) or {"rows": []})["rows"]))

    windows = calibrate[:args.pca_windows]
    label = f"ratio {args.ratio:g}, PCA on {windows.shape[0]} of the {split} windows" \
        + (", no LoRA run" if args.no_recovery else "")
    scored = set(tasks.tasks) if tasks is not None else set()
    if not any(r["label"] == label and scored <= set(r.get("zero_shot_sliced", {})) for r in rows):
        rows[:] = [r for r in rows if r["label"] != label]  # rerun (the PCA is deterministic) to score the tasks
        model = copy.deepcopy(dense_model)
        report = pyprune.prune(model, "slicegpt", Structured(args.ratio), windows, batch_size=args.batch_size,
                               progress=True)
        ppl_sliced = {text: perplexity(model, ids, args.eval_seqlen, progress=False) for text, ids in tokens.items()}
        sliced_scores = {} if tasks is None else dress.zero_shot(model, tokenizer, tasks, args.limit)
        ppl_lora, scores, lora_s = None, {}, None
        if not args.no_recovery:
            start = time.perf_counter()
            lora_finetune(model, recover, steps=args.lora_steps, rank=32, alpha=10.0, lr=args.lora_lr,
                          batch_size=args.train_batch, progress=True)
            lora_s = time.perf_counter() - start
            ppl_lora = {text: perplexity(model, ids, args.eval_seqlen, progress=False) for text, ids in tokens.items()}
            scores = {} if tasks is None else dress.zero_shot(model, tokenizer, tasks, args.limit)
        rows.append({"label": label, "ratio": args.ratio, "hidden_size": report["hidden_size"],
                     "parameters": [report["parameters_before"], report["parameters_after"]],
                     "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora,
                     "zero_shot_sliced": sliced_scores, "zero_shot_lora": scores,
                     "prune_s": report["time_s"], "lora_s": lora_s, "kept_variance": report["kept_variance"],
                     "rotation_parameters": report["rotation_parameters"], "deviations": report["deviations"]})
        print(f"slicegpt {label}: ppl sliced {ppl_sliced}, + LoRA {ppl_lora}, zero-shot sliced {sliced_scores}, "
              f"+ LoRA {scores}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
