"""SLEB (block removal) on SmolLM2-135M (or another alias, ``--model``) beside DReSS's rows
(study dress, pyprune/studies/dress.py), where results/dress-<model>.json exists.

The same data as DReSS's table: ``--nsamples`` x ``--seqlen`` random Emma windows (seed 0); SLEB
searches on the first ``--sleb-windows`` windows of the regularisation three quarters (every step
runs the model once per candidate block, so a CPU affords few); evaluation the first
``--eval-tokens`` tokens of Pride and Prejudice and of Moby Dick in ``--eval-seqlen`` windows, and
with ``--tasks`` zero-shot accuracy on the first ``--limit`` items of each local task. Ratio 0.25
removes 7 of the 30 blocks (23 kept: 0.75 x 30 rounded halves up). The markdown puts the DReSS
rows of results/dress-<model>.json beside the SLEB row (DReSS's after LoRA recovery; SLEB's
without). Windows start with <bos> where the tokenizer starts texts with it (Gemma). Results:
results/sleb-<model>.{json,md}.

    python benchmarks/sleb_smollm2.py --tasks austen_continuation,moby_dick_continuation
    python benchmarks/sleb_smollm2.py --model gemma3-270m
"""
import argparse
import copy
import json
import os
import sys

import torch

import pyprune
from _common import environment, write_atomic, write_json
from baselines_smollm2 import MODELS
from pyprune.evaluation import zeroshot
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.patterns import Structured

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
EVAL_TEXTS = ("pride_and_prejudice", "moby_dick")


def zero_shot(model, tokenizer, tasks, limit):
    """{task: {acc, stderr, n, chance}} of ``model`` on the first ``limit`` items of each task."""
    return {name: {"acc": r["acc"], "stderr": r["stderr"]["acc"], "n": r["n"], "chance": r.get("chance")}
            for name, r in zeroshot.evaluate(model, tokenizer, tasks, limit=limit).items()}


def _score(scores, task):
    return f"{scores[task]['acc']:.3f} ± {scores[task]['stderr']:.3f} (n {scores[task]['n']})" if task in scores \
        else "–"


def markdown(result, dress) -> str:
    s, row = result["settings"], result["row"]
    tasks = sorted(row["zero_shot"])  # none until they are scored
    lines = [f"# SLEB on {result['model']}" + (" beside DReSS" if dress else ""), "",
             f"Ratio {s['ratio']}: {len(row['removed_blocks'])} of {row['blocks']} blocks removed (in order "
             f"{row['removed_blocks']}); SLEB searched on {s['sleb_windows']} x {s['seqlen']} Emma windows (the "
             f"first of DReSS's {s['nsamples']} x {s['seqlen']}, seed 0); evaluation first {s['eval_tokens']} tokens "
             f"of {' and '.join(EVAL_TEXTS)}, {s['eval_seqlen']}-token windows; {s['threads']} thread(s). "
             f"Parameters {row['parameters'][0]:,} -> {row['parameters'][1]:,} "
             f"({1 - row['parameters'][1] / row['parameters'][0]:.1%} removed). Prune time {row['time_s']:.0f} s.", ""]
    def line(cells):
        return "| " + " | ".join(cells) + " |"

    def removed(parameters):
        return f"{1 - parameters[1] / parameters[0]:.1%}"

    lines += [line(["method", "setting", *(f"{t} ppl" for t in EVAL_TEXTS), *tasks, "parameters removed"]),
              "|---|---|" + "---:|" * (len(EVAL_TEXTS) + len(tasks) + 1)]
    lines.append(line(["dense", "–", *(f"{result['dense'][t]:.2f}" for t in EVAL_TEXTS),
                       *(_score(result["dense_zero_shot"], t) for t in tasks), "0"]))
    lines.append(line(["SLEB", "no recovery", *(f"{row['ppl'][t]:.2f}" for t in EVAL_TEXTS),
                       *(_score(row["zero_shot"], t) for t in tasks), removed(row["parameters"])]))
    for d in (dress or {}).get("rows", []):
        lines.append(line([f"DReSS ({d['channels']} channels)", f"{d['label']}, + LoRA",
                           *(f"{d['ppl_lora'][t]:.2f}" for t in EVAL_TEXTS),
                           *(_score(d.get("zero_shot_lora") or {}, t) for t in tasks), removed(d["parameters"])]))
    lines += ["", "Calibration perplexity after each removal: "
              + ", ".join(f"block {step['removed']}: {step['perplexity']:.2f}" for step in row["steps"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=800, help="DReSS's calibration windows (drawn the same)")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--sleb-windows", type=int, default=4, help="windows SLEB's search runs on")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--tasks", default="", help="comma-separated zero-shot tasks (pyprune.evaluation.zeroshot)")
    parser.add_argument("--limit", type=int, default=200, help="items per zero-shot task")
    parser.add_argument("--output", help="results JSON (default: results/sleb-<model>.json)")
    args = parser.parse_args(argv)
    name = os.path.basename(os.path.normpath(args.model))
    output = args.output or os.path.join(RESULTS, f"sleb-{name}.json")
    tasks = zeroshot.load_tasks(args.tasks.split(",")) if args.tasks else None

    dense_model, tokenizer = load_model(args.model)
    bos = data.window_bos(tokenizer)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    calib = calib[:args.sleb_windows]
    tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=args.eval_tokens) for text in EVAL_TEXTS}
    dress_path = os.path.join(RESULTS, f"dress-{name}.json")
    dress = json.load(open(dress_path, encoding="utf-8")) if os.path.exists(dress_path) else None
    settings = {k: getattr(args, k) for k in ("ratio", "nsamples", "seqlen", "sleb_windows", "eval_tokens",
                                              "eval_seqlen", "limit")} | {"threads": torch.get_num_threads()}
    same_evaluation = dress is not None and dress["settings"]["evaluation"] == (
        f"first {args.eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, {args.eval_seqlen}-token windows")
    dense = dress["dense"] if same_evaluation else {
        text: perplexity(dense_model, ids, args.eval_seqlen, progress=False, bos_token_id=bos)
        for text, ids in tokens.items()}
    dense_zero_shot = dress.get("dense_zero_shot", {}) if same_evaluation and args.limit == 200 else {}
    if tasks is not None and not set(tasks.tasks) <= set(dense_zero_shot):
        dense_zero_shot = zero_shot(dense_model, tokenizer, tasks, args.limit)

    model = copy.deepcopy(dense_model)
    report = pyprune.prune(model, "sleb", Structured(args.ratio), calib, batch_size=4)
    row = {"blocks": len(report["removed_blocks"]) + len(report["kept_blocks"]),
           "removed_blocks": report["removed_blocks"], "steps": report["steps"], "time_s": report["time_s"],
           "parameters": [report["parameters_before"], report["parameters_after"]], "options": report["options"],
           "ppl": {text: perplexity(model, ids, args.eval_seqlen, progress=False, bos_token_id=bos)
                   for text, ids in tokens.items()}}
    print(f"sleb: removed {row['removed_blocks']}, ppl {row['ppl']}, {row['time_s']:.0f} s", flush=True)
    result = {"model": MODELS.get(args.model, args.model), "settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
              "dense_zero_shot": dense_zero_shot, "row": dict(row, zero_shot={})}
    write_json(output, result)
    write_atomic(os.path.splitext(output)[0] + ".md", markdown(result, dress if same_evaluation else None))
    if tasks is not None:
        result["row"]["zero_shot"] = zero_shot(model, tokenizer, tasks, args.limit)
        write_json(output, result)
        write_atomic(os.path.splitext(output)[0] + ".md", markdown(result, dress if same_evaluation else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
