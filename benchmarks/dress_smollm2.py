"""DReSS's central comparison on SmolLM2-135M, for each channel choice in ``--channels``, each row
before and after LoRA recovery, every row slicing the same hidden channels:

* slice only (the paper's "w/o R" ablation, Table 5): no training;
* DReSS: regularise (λ, ``--steps`` AdamW steps) then slice;
* DReSS proximal (arm ``prox``, not in the paper): each AdamW step on the LM loss alone followed by
  group soft-thresholding of the pruned slices by lr·λ, which empties them exactly;
* fine-tune with λ = 0 then slice: the same training budget without the penalty;
* slice then train (the paper's N&P&R control, Table 4): the sliced model trained with the same
  steps, windows, optimiser and seed.

Regularise-then-slice is supported only where it beats both trained controls. Rows that train
before slicing also report the perplexity just before the cut (what the training gains), beside
the sliced one (what the cut costs).

Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma (``--calib mixed``: a third each
of Emma, the second half of Pride and Prejudice and the second half of Moby Dick, interleaved;
results then go to dress-smollm2-135m-mixed.*), split 3:1 as in the paper:
the first three quarters regularise (one pass at the defaults: steps x train batch = windows),
the last quarter trains LoRA. Evaluation: the first ``--eval-tokens`` tokens of Pride and
Prejudice and of Moby Dick (not by Austen). Hidden size 576 -> 432 at ``--ratio 0.25``. Each row:
perplexity after slicing and after LoRA on both texts, the weight mass of the removed slices after
training relative to before (Fig. 5's measure), overall, per layer and per kind of matrix (also
plotted, dress-smollm2-135m-mass-<channels>.svg), the norm rescale measured against sqrt(d/d'), and the wall
time of each phase. Results: benchmarks/results/dress-smollm2-135m.{json,md}, rewritten after every
row (merged with the rows a concurrent run of other ``--channels`` / ``--arms`` wrote meanwhile); a
rerun skips the rows already there. ``--tasks`` adds zero-shot accuracy after LoRA; ``--skip-lora``
leaves LoRA out of the rows this run adds (their LoRA cells stay empty); ``--train-seed`` replicates
a row with another minibatch order.

    python benchmarks/dress_smollm2.py
    python benchmarks/dress_smollm2.py --channels last --steps 120 --lam 1 --lr 1e-3
    python benchmarks/dress_smollm2.py --channels first --arms slice,dress --tasks austen_continuation,moby_dick_continuation
    python benchmarks/dress_smollm2.py --channels quiet --arms prox --lam 250 --skip-lora
"""
import argparse
import copy
import os
import sys
import time

import torch

from _common import environment, locked, mean_std, previous_result, svg_line_plot, write_atomic, write_json
import pyprune
from pyprune.inputs import data
from pyprune.evaluation import zeroshot
from pyprune.evaluation.perplexity import perplexity
from pyprune.methods.dress import DReSS
from pyprune.inputs.models import load_model
from pyprune.patterns import Structured
from pyprune.runtime.recovery import lora_finetune
from pyprune.runtime.training import fp32_master_weights, train

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULTS = {option.name: option.default for option in DReSS.options}
EVAL_TEXTS = ("pride_and_prejudice", "moby_dick")
KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "input_layernorm", "post_attention_layernorm", "norm", "lm_head")


ARMS = ("slice", "dress", "prox", "lam0", "npr")
CHANNELS = ("quiet", "last", "first", "spread")
CALIBRATION = {"emma": "Emma", "mixed": "mixed (Emma, Pride and Prejudice 2nd half, Moby Dick 2nd half)"}


def arms(args, names=ARMS):
    """(label, DReSS options, train the sliced model afterwards) of the rows of one channel choice
    named in ``names``, in :data:`ARMS` order."""
    trained = {k: getattr(args, k) for k in ("lam", "lr", "norm", "train_batch")}
    if args.train_seed != DEFAULTS["train_seed"]:
        trained["train_seed"] = args.train_seed
    every = {"slice": ("slice only (w/o R)", {"steps": 0}, False),
             "dress": (f"DReSS-{args.norm}", {"steps": args.steps, **trained}, False),
             "prox": (f"DReSS-{args.norm} proximal", {"steps": args.steps, **trained, "regulariser": "proximal"},
                      False),
             "lam0": ("fine-tune λ=0, then slice", {"steps": args.steps, **trained, "lam": 0.0}, False),
             "npr": ("slice, then train (N&P&R)", {"steps": 0, "lr": args.lr, "train_batch": args.train_batch,
                                                   **({"train_seed": args.train_seed}
                                                      if "train_seed" in trained else {})}, True)}
    return [every[name] for name in ARMS if name in names]


def parse_arms(value):
    names = [name for name in value.split(",") if name]
    unknown = sorted(set(names) - set(ARMS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--arms takes a comma-separated subset of {','.join(ARMS)}; "
                                         f"got {value!r}")
    return set(names)


def zero_shot(model, tokenizer, tasks, limit):
    """{task: {acc, stderr, n, chance}} of ``model`` on the first ``limit`` items of each task."""
    return {name: {"acc": r["acc"], "stderr": r["stderr"]["acc"], "n": r["n"], "chance": r.get("chance")}
            for name, r in zeroshot.evaluate(model, tokenizer, tasks, limit=limit).items()}


def is_row(row, label, options) -> bool:
    """Whether the stored ``row`` is the arm ``label`` run with ``options``."""
    return row["label"] == label and all(row.get(k) == v for k, v in options.items())


def row_order(labels):
    """Sort key of the rows: channel choice, then arm (rows of unknown labels last)."""
    position = lambda value, order: order.index(value) if value in order else len(order)  # noqa: E731
    return lambda row: (position(row["channels"], CHANNELS), position(row["label"], labels))


def mass_plot(row) -> str:
    """SVG: the slice-mass ratio of every decoder layer, one line per kind of matrix."""
    series = {}
    for name, ratio in row["slice_mass_ratio_per_tensor"].items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            series.setdefault(parts[-1], []).append((int(parts[2]), ratio))
    return svg_line_plot(series, f"DReSS slice mass after/before per layer ({row['channels']}, {row['label']})",
                         "decoder layer", "slice mass after / before", log2_x=False, reference_y=1.0)


def _ppl(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}"


def train_seed(row):
    """The ``--train-seed`` a stored row was trained with (rows of the default seed do not record it)."""
    return row.get("train_seed", DEFAULTS["train_seed"])


def seed_groups(rows):
    """[(first row, rows)] of the trained settings run with more than one ``--train-seed``: rows
    equal in everything that defines a run except the seed, in seed order."""
    defining = ("channels", "label", "lam", "lr", "norm", "train_batch", "steps", "train_steps", "regulariser",
                "rescale_norms")
    groups = {}
    for r in rows:
        if r["train_steps"] > 0:
            groups.setdefault(tuple(str(r.get(k)) for k in defining), []).append(r)
    return [(group[0], sorted(group, key=train_seed)) for group in groups.values()
            if len({train_seed(r) for r in group}) > 1]


def calibration(tokenizer, source, nsamples, seqlen):
    """``nsamples`` windows of Emma, or (``mixed``) a third each of Emma and the second halves of
    Pride and Prejudice and Moby Dick (the halves the evaluation's first tokens are not in),
    interleaved so that the 3:1 split gives each part both corpora' share."""
    if source == "emma":
        return data.calibration_samples(tokenizer, "emma", nsamples=nsamples, seqlen=seqlen, seed=0)
    texts = ("emma", "pride_and_prejudice:second_half", "moby_dick:second_half")
    parts = [data.calibration_samples(tokenizer, text, nsamples=nsamples // 3 + (i < nsamples % 3), seqlen=seqlen,
                                      seed=0) for i, text in enumerate(texts)]
    return torch.stack([part[k] for k in range(parts[0].shape[0]) for part in parts if k < part.shape[0]])


def markdown(result) -> str:
    s = result["settings"]
    texts = list(result["dense"])
    lines = ["# DReSS on SmolLM2-135M", "",
             f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
             f"LoRA {s['lora']}; {s['threads']} threads. Dense perplexity "
             + ", ".join(f"{t} {v:.2f}" for t, v in result["dense"].items()) + ". Every row of a channel choice "
             "slices the same channels; 'train steps' are AdamW steps on the same windows, before slicing "
             "(DReSS, λ=0) or after (N&P&R).", "",
             "| channels | setting | train steps | λ | lr | seed | slice mass after/before | "
             + " | ".join(f"{t} before the cut | {t} sliced | {t} + LoRA" for t in texts) + " | train (s) | LoRA (s) |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|---:|---:|" * len(texts) + "---:|---:|"]
    for r in result["rows"]:
        trained = r["train_steps"] > 0
        lam = f"{r['lam']:g}" if r["steps"] > 0 else "–"
        lr = f"{r['lr']:g}" if trained else "–"
        before, lora = r.get("ppl_before_slice") or {}, r.get("ppl_lora") or {}
        lines.append(f"| {r['channels']} | {r['label']} | {r['train_steps']} | {lam} | {lr} | "
                     f"{train_seed(r) if trained else '–'} | "
                     f"{r['slice_mass_ratio']:.3f} | "
                     + " | ".join(f"{_ppl(before.get(t))} | {r['ppl_sliced'][t]:.2f} | {_ppl(lora.get(t))}"
                                  for t in texts)
                     + f" | {r['train_s']:.0f} | {_ppl(r.get('lora_s'), 0)} |")
    groups = seed_groups(result["rows"])
    if groups:
        lines += ["", "Over training seeds (minibatch orders, ``--train-seed``): perplexity mean ± std, then each "
                  "seed's value in seed order:", "",
                  "| channels | setting | λ | lr | seeds | slice mass after/before | "
                  + " | ".join(f"{t} before the cut | {t} sliced | {t} sliced per seed" for t in texts) + " |",
                  "|---|---|---:|---:|---|---:|" + "---:|---:|---|" * len(texts)]
        for first, group in groups:
            cells = []
            for t in texts:
                before = [(r.get("ppl_before_slice") or {}).get(t) for r in group]
                sliced = [r["ppl_sliced"][t] for r in group]
                cells += [mean_std(before, ".2f") if None not in before else "–", mean_std(sliced, ".2f"),
                          " / ".join(f"{v:.2f}" for v in sliced)]
            lam = "–" if first["lam"] is None else f"{first['lam']:g}"
            seeds = ", ".join(str(train_seed(r)) for r in group)
            lines.append(f"| {first['channels']} | {first['label']} | {lam} | {first['lr']:g} | {seeds} | "
                         f"{mean_std([r['slice_mass_ratio'] for r in group], '.2g')} | " + " | ".join(cells) + " |")
    tasks = sorted({t for r in result["rows"] for t in r.get("zero_shot_lora", {})})
    if tasks:
        dense = result.get("dense_zero_shot", {})
        lines += ["", "Zero-shot accuracy after LoRA (pyprune.evaluation.zeroshot, acc ± stderr; rows run with --tasks); dense "
                  + ", ".join(f"{t} {v['acc']:.3f} ± {v['stderr']:.3f}" for t, v in sorted(dense.items()))
                  + (f", chance {next(iter(dense.values()))['chance']:g}" if dense else "") + ":", "",
                  "| channels | setting | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
        for r in result["rows"]:
            scores = r.get("zero_shot_lora", {})
            if scores:
                lines.append(f"| {r['channels']} | {r['label']} | " + " | ".join(
                    f"{scores[t]['acc']:.3f} ± {scores[t]['stderr']:.3f} (n {scores[t]['n']})" if t in scores
                    else "–" for t in tasks) + " |")
    lines += ["", "Slice mass after/before per kind of matrix (Fig. 5; rows that trained before slicing):", "",
              "| channels | setting | " + " | ".join(KINDS) + " |", "|---|---|" + "---:|" * len(KINDS)]
    for r in result["rows"]:
        if r["steps"] > 0:
            kinds = r["slice_mass_ratio_per_kind"]
            lines.append(f"| {r['channels']} | {r['label']} | "
                         + " | ".join(f"{kinds[k]:.3f}" if k in kinds else "–" for k in KINDS) + " |")
    lines += ["", "Norm rescale: the measured factor sqrt(s·d/d') (s = kept channels' share of each norm's input "
              "energy on the calibration windows) against sqrt(d/d'), which assumes empty removed channels:", "",
              "| channels | setting | sqrt(d/d') | measured min | measured median | measured max |",
              "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        scales = sorted(r["norm_scale"].values())
        if scales:
            lines.append(f"| {r['channels']} | {r['label']} | {r['width_scale']:.4f} | {scales[0]:.4f} | "
                         f"{scales[len(scales) // 2]:.4f} | {scales[-1]:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--nsamples", type=int, default=DReSS.calibration[0])
    parser.add_argument("--seqlen", type=int, default=DReSS.calibration[1])
    parser.add_argument("--channels", default=",".join(CHANNELS),
                        help="comma-separated channel choices, each four rows (quiet, last, first, spread)")
    for name in ("steps", "lam", "lr", "norm", "train_batch", "rescale_norms", "lora_steps", "lora_lr", "train_seed"):
        kind = type(DEFAULTS[name])
        parser.add_argument(f"--{name.replace('_', '-')}", default=DEFAULTS[name],
                            type=(lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind)
    parser.set_defaults(lora_steps=50)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--arms", type=parse_arms, default=set(ARMS),
                        help=f"comma-separated rows of each channel choice to run (default all: {','.join(ARMS)})")
    parser.add_argument("--tasks", default="",
                        help="comma-separated zero-shot tasks (pyprune.evaluation.zeroshot) scored on each row's model "
                             "after LoRA, e.g. austen_continuation,moby_dick_continuation")
    parser.add_argument("--limit", type=int, default=200, help="items per zero-shot task")
    parser.add_argument("--calib", choices=("emma", "mixed"), default="emma",
                        help="calibration windows: Emma, or a third each of Emma, Pride and Prejudice (second half) "
                             "and Moby Dick (second half)")
    parser.add_argument("--skip-lora", action="store_true",
                        help="no LoRA recovery for the rows this run adds (their LoRA cells stay empty)")
    parser.add_argument("--output", default=None,
                        help="results JSON (default dress-smollm2-135m.json, -mixed.json for --calib mixed)")
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = os.path.join(RESULTS, "dress-smollm2-135m" + ("-mixed" if args.calib == "mixed" else "") + ".json")
    tasks = None
    if args.tasks:  # before the model loads: a task whose data cannot be had fails here
        tasks = zeroshot.load_tasks(args.tasks.split(","))

    dense_model, tokenizer = load_model("smollm2-135m")
    calib = calibration(tokenizer, args.calib, args.nsamples, args.seqlen)
    split = (3 * args.nsamples) // 4
    regularise, recover = calib[:split], calib[split:]
    tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=args.eval_tokens) for text in EVAL_TEXTS}
    settings = {"hidden": f"576 -> ratio {args.ratio}",
                "calibration": f"{split} x {args.seqlen} {CALIBRATION[args.calib]} windows train, "
                               f"{args.nsamples - split} train LoRA",
                "evaluation": f"first {args.eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, "
                              f"{args.eval_seqlen}-token windows",
                "lora": f"{args.lora_steps} steps, rank 32, alpha 10, lr {args.lora_lr:g}, batch {args.train_batch}",
                "threads": torch.get_num_threads()}
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else {text: perplexity(dense_model, ids, args.eval_seqlen, progress=False)
                                        for text, ids in tokens.items()}

    dense_zero_shot = keep.get("dense_zero_shot", {}) if keep else {}

    def save(row=None, label=None, options=None):
        """Write the results: the rows and dense zero-shot scores a concurrent run (same settings,
        other --channels / --arms) wrote meanwhile, with this run's ``row`` (replacing its earlier
        copy) and dense scores, re-read and rewritten under a lock; returns the rows."""
        with locked(args.output):
            on_disk = previous_result(args.output, settings)
            stored = on_disk["rows"] if on_disk else rows
            if row is not None:
                stored = [r for r in stored if not is_row(r, label, options)] + [row]
            stored.sort(key=row_order(labels))
            scores = {**(on_disk.get("dense_zero_shot", {}) if on_disk else {}), **dense_zero_shot}
            result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                      "dense_zero_shot": scores, "rows": stored}
            write_json(args.output, result)
            write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))
        return stored

    labels = [label for label, _, _ in arms(args)]
    if tasks is not None and not set(tasks.tasks) <= set(dense_zero_shot):
        dense_zero_shot.update(zero_shot(dense_model, tokenizer, tasks, args.limit))
        rows = save()

    def evaluate(model):
        return {text: perplexity(model, ids, args.eval_seqlen, progress=False) for text, ids in tokens.items()}

    for channels in args.channels.split(","):
        for label, options, train_after in arms(args, args.arms):
            options = dict(options, channels=channels, rescale_norms=args.rescale_norms)
            if any(is_row(r, label, options) for r in rows):
                continue
            model = copy.deepcopy(dense_model)
            start = time.perf_counter()
            method = DReSS(**options)
            if options["steps"] > 0:
                method.before_slice = evaluate
            report = pyprune.prune(model, method, Structured(args.ratio), regularise, progress=True)
            log = report["regularisation"]
            if train_after:  # N&P&R: the sliced model, the same steps, windows, optimiser and seed
                with fp32_master_weights(model), torch.enable_grad():
                    log = train(model, list(model.parameters()), regularise, steps=args.steps, lr=args.lr,
                                batch_size=args.train_batch, seed=args.train_seed, desc="train sliced")
            train_s = time.perf_counter() - start
            ppl_sliced = evaluate(model)
            ppl_lora, lora_s, scores = None, None, {}
            if not args.skip_lora:
                start = time.perf_counter()
                lora_finetune(model, recover, steps=args.lora_steps, rank=32, alpha=10.0, lr=args.lora_lr,
                              batch_size=args.train_batch, progress=True)
                lora_s = time.perf_counter() - start
                ppl_lora = evaluate(model)
                scores = {} if tasks is None else zero_shot(model, tokenizer, tasks, args.limit)
            row = {"label": label, "lam": None, "lr": args.lr, "norm": None, "train_batch": args.train_batch,
                   **options, "train_steps": args.steps if train_after else options["steps"],
                   "slice_mass_ratio": report["slice_mass_ratio"],
                   **{f"slice_mass_ratio_per_{k}": report[f"slice_mass_ratio_per_{k}"]
                      for k in ("tensor", "layer", "kind")},
                   "norm_scale": report["norm_scale"], "width_scale": report["width_scale"],
                   "ppl_before_slice": report.get("before_slice"), "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora, "zero_shot_lora": scores,
                   "train_s": train_s, "lora_s": lora_s,
                   "hidden_size": report["hidden_size"], "pruned_channels": report["pruned_channels"],
                   "parameters": [report["cost_before"]["parameters"], report["cost_after"]["parameters"]],
                   "loss": log.get("loss"), "penalty": log.get("penalty")}
            print(f"{channels} {label}: mass {row['slice_mass_ratio']:.3f}, ppl sliced {ppl_sliced}, "
                  f"+ LoRA {ppl_lora}", flush=True)
            rows = save(row, label, options)
            if options["steps"] > 0 and options["lam"] > 0 and options.get("regulariser") != "proximal":
                write_atomic(f"{os.path.splitext(args.output)[0]}-mass-{channels}.svg", mass_plot(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
