"""DReSS's central comparison (study ``dress``): for each channel choice, every row slicing the same
hidden channels, each row before and after LoRA recovery:

* ``slice``: slice only (the paper's "w/o R" ablation, Table 5): no training;
* ``dress``: DReSS, regularise (λ, ``steps`` AdamW steps) then slice;
* ``prox``: DReSS proximal (not in the paper): each AdamW step on the LM loss alone followed by
  group soft-thresholding of the pruned slices by lr·λ, which empties them exactly;
* ``lam0``: fine-tune with λ = 0 then slice: the same training budget without the penalty;
* ``npr``: slice then train (the paper's N&P&R control, Table 4): the sliced model trained with the
  same steps, windows, optimiser and seed.

Regularise-then-slice is supported only where it beats both trained controls. Rows that train
before slicing also report the perplexity just before the cut (what the training gains), beside
the sliced one (what the cut costs). Settings run over several training seeds (``train_seed``,
the minibatch order) are summarised over the seeds, each against slice-then-train by the verdict
rule of :mod:`pyprune.studies.verdict`.

Calibration: ``nsamples`` x ``seqlen`` random windows of Emma (``calib mixed``: a third each of
Emma, the second half of Pride and Prejudice and the second half of Moby Dick, interleaved; results
then go to dress-smollm2-135m-mixed.*), split 3:1 as in the paper: the first three quarters
regularise (one pass at the defaults: steps x train batch = windows), the last quarter trains
LoRA. Evaluation: the first ``eval_tokens`` tokens of Pride and Prejudice and of Moby Dick (not by
Austen). Hidden size 576 -> 432 at ratio 0.25. Each row: perplexity after slicing and after LoRA
on both texts, the weight mass of the removed slices after training relative to before (Fig. 5's
measure), overall, per layer and per kind of matrix (also plotted beside the results,
NAME-mass-<channels>-<steps>-steps-lr-<lr>-seed-<seed>.svg, for the penalty rows), the norm rescale measured against sqrt(d/d'), and
the wall time of each phase. ``tasks`` adds zero-shot accuracy after LoRA; ``skip_lora`` leaves
LoRA out of the rows a run adds (their LoRA cells stay empty). A row's training saves every
``checkpoint_every`` steps (NAME.checkpoints/, removed once the row is written); a stopped row
resumes at its last save and records ``resumed_at_step`` (its ``train_s`` then counts only the
steps its last process ran).
"""
from __future__ import annotations

import copy
import os
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..evaluation import zeroshot
from ..evaluation.perplexity import perplexity
from ..files import write_text
from ..inputs import data
from ..inputs.models import load_model
from ..methods.dress import DReSS
from ..methods.options import at_least_one, fraction, option
from ..methods.pruning import prune
from ..nn.dispatch import environment_record
from ..patterns import Structured
from ..runtime.checkpoint import model_fingerprint, tokens_digest
from ..runtime.recovery import lora_finetune
from ..runtime.training import TrainingCheckpoint, fp32_master_weights, train
from .results import mean_std
from .study import Arm, RESULTS_DIR, Study, arm_saves, model_label, remove_arm_saves
from .svg import line_plot
from .verdict import RULE, paired_verdict

DEFAULT_MODEL = "smollm2-135m"
EVAL_TEXTS = ("pride_and_prejudice", "moby_dick")
KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "input_layernorm", "post_attention_layernorm", "norm", "lm_head")
ARMS = ("slice", "dress", "prox", "lam0", "npr")
CHANNELS = ("quiet", "last", "first", "spread")
CALIBRATION = {"emma": "Emma", "mixed": "mixed (Emma, Pride and Prejudice 2nd half, Moby Dick 2nd half)"}
#: the label of the slice-then-train control every seed group is compared against
CONTROL = "slice, then train (N&P&R)"
#: the steps at each end of a training run whose mean loss the table prints (:func:`loss_ends`)
LOSS_SPAN = 50
#: the label of every arm but DReSS's (whose label names its norm)
LABELS = {"slice": "slice only (w/o R)", "lam0": "fine-tune λ=0, then slice", "npr": CONTROL}
#: what tells a row apart, besides its channels, label and norm rescale: the training its arm did
TRAINED = ("lam", "lr", "norm", "train_batch", "train_steps", "train_seed")
DEFINING = {"slice": (), "dress": TRAINED, "prox": TRAINED, "lam0": TRAINED,
            "npr": ("lr", "train_batch", "train_steps", "train_seed")}
#: the arm that scores the dense model on the zero-shot tasks (its "row" goes to ``dense_zero_shot``)
DENSE_ZERO_SHOT = "dense zero-shot"


def dress_option(name: str, default=None):
    """A setting declared as DReSS declares its option ``name`` (help, check, choices), with the
    study's ``default`` where it has its own."""
    declared = getattr(DReSS, name)
    return option(declared.default if default is None else default, declared.help, declared.check,
                  choices=declared.choices)


def _split_windows(value) -> Optional[str]:
    return None if value >= 4 else "must be >= 4 (three quarters train, one quarter trains LoRA)"


def arm_name(label: str) -> str:
    """The arm (a name of :data:`ARMS`) that makes rows labelled ``label``."""
    if label.startswith("DReSS-"):
        return "prox" if label.endswith(" proximal") else "dress"
    names = {text: name for name, text in LABELS.items()}
    if label not in names:
        raise ValueError(f"no arm of study 'dress' makes rows labelled {label!r}")
    return names[label]


def train_seed(row: dict) -> int:
    """The training seed of a stored row (rows of the default seed do not record it)."""
    return row.get("train_seed", DReSS.train_seed.default)


def row_setting(row: dict) -> str:
    """A row's label with the training that tells it apart from rows of the same label (steps, λ,
    lr, seed), for tables that quote DReSS's rows in one column."""
    if row["train_steps"] == 0:
        return row["label"]
    lam = f", λ {row['lam']:g}" if row["steps"] > 0 else ""
    return f"{row['label']}, {row['train_steps']} steps{lam}, lr {row['lr']:g}, training seed {train_seed(row)}"


def row_key(row: dict) -> tuple:
    """What identifies a row: its channels, label and norm rescale, and the training options of its
    arm (:data:`DEFINING`; slicing alone does not depend on the learning rate or seed)."""
    fields = DEFINING[arm_name(row["label"])]
    return (row["channels"], row["label"], row["rescale_norms"]) + tuple(
        (name, train_seed(row) if name == "train_seed" else row.get(name)) for name in fields)


def zero_shot(model, tokenizer, tasks, limit: int, progress: bool = True) -> Dict[str, dict]:
    """{task: {acc, stderr, n, chance}} of ``model`` on the first ``limit`` items of each task."""
    return {name: {"acc": r["acc"], "stderr": r["stderr"]["acc"], "n": r["n"], "chance": r.get("chance")}
            for name, r in zeroshot.evaluate(model, tokenizer, tasks, limit=limit, progress=progress).items()}


def calibration(tokenizer, source: str, nsamples: int, seqlen: int) -> Tensor:
    """``nsamples`` windows of Emma, or (``mixed``) a third each of Emma and the second halves of
    Pride and Prejudice and Moby Dick (the halves the evaluation's first tokens are not in),
    interleaved so that the 3:1 split gives each part both corpora' share."""
    if source == "emma":
        return data.calibration_samples(tokenizer, "emma", nsamples=nsamples, seqlen=seqlen, seed=0)
    texts = ("emma", "pride_and_prejudice:second_half", "moby_dick:second_half")
    parts = [data.calibration_samples(tokenizer, text, nsamples=nsamples // 3 + (i < nsamples % 3), seqlen=seqlen,
                                      seed=0) for i, text in enumerate(texts)]
    return torch.stack([part[k] for k in range(parts[0].shape[0]) for part in parts if k < part.shape[0]])


def mass_plot_path(stem: str, row: dict) -> str:
    """Where a penalty row's :func:`mass_plot` goes: one file per channel choice and training, so a
    rerun with other steps, rate or seed adds a plot instead of replacing one."""
    return f"{stem}-mass-{row['channels']}-{row['train_steps']}-steps-lr-{row['lr']:g}-seed-{train_seed(row)}.svg"


def mass_plot(row: dict) -> str:
    """SVG: the slice-mass ratio of every decoder layer, one line per kind of matrix."""
    series: Dict[str, list] = {}
    for name, ratio in row["slice_mass_ratio_per_tensor"].items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            series.setdefault(parts[-1], []).append((int(parts[2]), ratio))
    return line_plot(series, f"DReSS slice mass after/before per layer ({row['channels']}, {row_setting(row)})",
                     "decoder layer", "slice mass after / before", log2_x=False, reference_y=1.0)


def seed_groups(rows: List[dict]) -> List[Tuple[dict, List[dict]]]:
    """[(first row, rows)] of the trained settings run with more than one training seed: rows equal
    in everything that defines a run except the seed, in seed order."""
    defining = ("channels", "label", "lam", "lr", "norm", "train_batch", "steps", "train_steps", "regulariser",
                "rescale_norms")
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r["train_steps"] > 0:
            groups.setdefault(tuple(str(r.get(k)) for k in defining), []).append(r)
    return [(group[0], sorted(group, key=train_seed)) for group in groups.values()
            if len({train_seed(r) for r in group}) > 1]


def control_verdict(group: List[dict], rows: List[dict], text: str) -> str:
    """The verdict (:func:`pyprune.studies.verdict.paired_verdict`, perplexity after slicing on
    ``text``, lower is better) on the seed ``group`` against slice-then-train of the same channels,
    learning rate, batch, steps and norm rescale, over the seeds both ran; "–" for the control
    itself or without a common seed."""
    first = group[0]
    if first["label"] == CONTROL:
        return "–"
    same = ("channels", "lr", "train_batch", "train_steps", "rescale_norms")
    control = {train_seed(r): r["ppl_sliced"][text] for r in rows
               if r["label"] == CONTROL and all(r.get(k) == first.get(k) for k in same)}
    ours = {train_seed(r): r["ppl_sliced"][text] for r in group}
    if not ours.keys() & control.keys():
        return "–"
    return paired_verdict(ours, control).word


def loss_ends(row: dict) -> str:
    """The mean training loss of a row's first and last :data:`LOSS_SPAN` steps ("–" untrained):
    a falling loss that the evaluation does not follow is the model fitting its training windows."""
    loss = row.get("loss") or []
    if not loss:
        return "–"
    span = min(LOSS_SPAN, len(loss))
    return f"{sum(loss[:span]) / span:.2f} → {sum(loss[-span:]) / span:.2f}"


def train_time(row: dict) -> str:
    """A row's training seconds; a row resumed mid-training counts only the steps of its last run."""
    resumed = row.get("resumed_at_step")
    return f"{row['train_s']:.0f}" + (f" (steps {resumed}–{row['train_steps']})" if resumed else "")


def _ppl(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    texts = list(result["dense"])
    lines = [f"# DReSS on {model_label(s)}", "",
             f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
             f"LoRA {s['lora']}; {s['threads']} threads. Dense perplexity "
             + ", ".join(f"{t} {v:.2f}" for t, v in result["dense"].items()) + ". Every row of a channel choice "
             "slices the same channels; 'train steps' are AdamW steps on the same windows, before slicing "
             "(DReSS, λ=0) or after (N&P&R); 'train loss' is the mean next-token loss on the training minibatches "
             f"of the first and of the last {LOSS_SPAN} steps.", "",
             "| channels | setting | train steps | λ | lr | seed | slice mass after/before | train loss first → last | "
             + " | ".join(f"{t} before the cut | {t} sliced | {t} + LoRA" for t in texts) + " | train (s) | LoRA (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|---:|" * len(texts) + "---:|---:|"]
    for r in result["rows"]:
        trained = r["train_steps"] > 0
        lam = f"{r['lam']:g}" if r["steps"] > 0 else "–"
        lr = f"{r['lr']:g}" if trained else "–"
        before, lora = r.get("ppl_before_slice") or {}, r.get("ppl_lora") or {}
        lines.append(f"| {r['channels']} | {r['label']} | {r['train_steps']} | {lam} | {lr} | "
                     f"{train_seed(r) if trained else '–'} | "
                     f"{r['slice_mass_ratio']:.3f} | {loss_ends(r)} | "
                     + " | ".join(f"{_ppl(before.get(t))} | {r['ppl_sliced'][t]:.2f} | {_ppl(lora.get(t))}"
                                  for t in texts)
                     + f" | {train_time(r)} | {_ppl(r.get('lora_s'), 0)} |")
    groups = seed_groups(result["rows"])
    if groups:
        lines += ["", "Over training seeds (minibatch orders, ``--train-seed``): perplexity mean ± std, then each "
                  "seed's value in seed order; 'vs N&P&R' is the verdict on the sliced perplexity against slice, "
                  "then train (N&P&R) of the same channels, lr and steps over the seeds both ran "
                  f"(pyprune.studies.verdict: ahead or behind only with {RULE}, else unsettled):", "",
                  "| channels | setting | train steps | λ | lr | seeds | slice mass after/before | "
                  + " | ".join(f"{t} before the cut | {t} sliced | {t} sliced per seed | {t} vs N&P&R"
                               for t in texts) + " |",
                  "|---|---|---:|---:|---:|---|---:|" + "---:|---:|---|---|" * len(texts)]
        for first, group in groups:
            cells = []
            for t in texts:
                before = [(r.get("ppl_before_slice") or {}).get(t) for r in group]
                sliced = [r["ppl_sliced"][t] for r in group]
                cells += [mean_std(before, ".2f") if None not in before else "–", mean_std(sliced, ".2f"),
                          " / ".join(f"{v:.2f}" for v in sliced), control_verdict(group, result["rows"], t)]
            lam = "–" if first["lam"] is None else f"{first['lam']:g}"
            seeds = ", ".join(str(train_seed(r)) for r in group)
            lines.append(f"| {first['channels']} | {first['label']} | {first['train_steps']} | {lam} | "
                         f"{first['lr']:g} | {seeds} | "
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
              "| channels | setting | train steps | lr | seed | " + " | ".join(KINDS) + " |",
              "|---|---|---:|---:|---:|" + "---:|" * len(KINDS)]
    for r in result["rows"]:
        if r["steps"] > 0:
            kinds = r["slice_mass_ratio_per_kind"]
            lines.append(f"| {r['channels']} | {r['label']} | {r['train_steps']} | {r['lr']:g} | {train_seed(r)} | "
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


class Dress(Study):
    """DReSS's regularise-then-slice against slicing alone and the trained controls (λ = 0, slice
    then train), per channel choice, on SmolLM2-135M; see :mod:`pyprune.studies.dress`.

    A row is one arm (``rows``) of one channel choice (``channels``) with the training options
    given (``lam``, ``lr``, ``steps``, ``train_seed`` ...): a rerun with other training options adds
    rows beside the stored ones, a rerun with the same ones skips them. Rows are sorted by channel
    choice, then arm.
    """

    name = "dress"
    summary = "DReSS regularise-then-slice against slice only, λ = 0 and slice-then-train (N&P&R), per channel choice"
    results = "dress-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    channels: Tuple[str, ...] = option(CHANNELS, "the channel choices, each a row per arm", choices=CHANNELS)
    rows: Tuple[str, ...] = option(ARMS, "the rows of each channel choice: slice only, DReSS, DReSS proximal, "
                                   "fine-tune λ=0 then slice, slice then train (N&P&R)", choices=ARMS)
    calib: str = option("emma", "calibration windows: Emma, or a third each of Emma, Pride and Prejudice (second "
                        "half) and Moby Dick (second half); mixed writes NAME-mixed by default",
                        choices=tuple(CALIBRATION))
    ratio: float = option(0.25, "share of the hidden channels removed", fraction)
    nsamples: int = option(DReSS.calibration[0], "calibration windows (3/4 train, 1/4 train LoRA)", _split_windows)
    seqlen: int = option(DReSS.calibration[1], "calibration window length", at_least_one)
    steps: int = dress_option("steps")
    lam: float = dress_option("lam")
    lr: float = dress_option("lr", 1e-3)  # the rate the SmolLM2-135M results were measured at
    norm: str = dress_option("norm")
    train_batch: int = dress_option("train_batch")
    rescale_norms: bool = dress_option("rescale_norms")
    lora_steps: int = dress_option("lora_steps", 50)
    lora_lr: float = dress_option("lora_lr")
    train_seed: int = dress_option("train_seed")
    eval_tokens: int = option(4096, "evaluation tokens of each text", at_least_one)
    eval_seqlen: int = option(256, "evaluation window length", at_least_one)
    tasks: Optional[Tuple[str, ...]] = option(None, "zero-shot tasks (pyprune.evaluation.zeroshot) scored on each "
                                              "row's model after LoRA, e.g. austen_continuation "
                                              "moby_dick_continuation")
    limit: int = option(200, "items per zero-shot task", at_least_one)
    skip_lora: bool = option(False, "no LoRA recovery for the rows this run adds (their LoRA cells stay empty)")
    checkpoint_every: int = option(25, "steps between the saves of a row's training (model and optimiser, in "
                                   "NAME.checkpoints/ beside the results file, removed once the row is written): a "
                                   "stopped run resumes its row from the last save", at_least_one)

    def check_options(self) -> None:
        if self.tasks is not None and self.skip_lora:
            raise ValueError("option tasks of study 'dress' scores the rows after LoRA; it takes skip_lora false")

    def output_path(self, output):
        if output is None and self.calib == "mixed":
            return os.path.join(RESULTS_DIR, f"{self.results}-mixed.json")
        return super().output_path(output)

    def prepare(self, path):
        tasks = None if self.tasks is None else zeroshot.load_tasks(list(self.tasks))  # before the model loads
        model, tokenizer = load_model(self.model)
        calib = calibration(tokenizer, self.calib, self.nsamples, self.seqlen)
        split = (3 * self.nsamples) // 4
        tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=self.eval_tokens) for text in EVAL_TEXTS}
        return {"model": model, "tokenizer": tokenizer, "tasks": tasks, "regularise": calib[:split],
                "recover": calib[split:], "tokens": tokens, "stem": os.path.splitext(path)[0]}

    def protocol(self, context):
        split = (3 * self.nsamples) // 4
        settings = {"hidden": f"{context['model'].config.hidden_size} -> ratio {self.ratio}",
                    "calibration": f"{split} x {self.seqlen} {CALIBRATION[self.calib]} windows train, "
                                   f"{self.nsamples - split} train LoRA",
                    "evaluation": f"first {self.eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, "
                                  f"{self.eval_seqlen}-token windows",
                    "lora": f"{self.lora_steps} steps, rank 32, alpha 10, lr {self.lora_lr:g}, "
                            f"batch {self.train_batch}",
                    "threads": torch.get_num_threads()}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def _evaluate(self, context, model) -> Dict[str, float]:
        return {text: perplexity(model, ids, self.eval_seqlen, progress=False)
                for text, ids in context["tokens"].items()}

    def start(self, settings, context):
        return {"settings": settings, "environment": environment_record(torch.device("cpu")),
                "dense": self._evaluate(context, context["model"]), "dense_zero_shot": {}, "rows": []}

    def label(self, name: str) -> str:
        """The label of the rows of arm ``name`` (DReSS's names its norm)."""
        return {"dress": f"DReSS-{self.norm}", "prox": f"DReSS-{self.norm} proximal"}.get(name) or LABELS[name]

    def arm(self, name: str, channels: str) -> Arm:
        """The arm ``name`` of :data:`ARMS` for ``channels``; its spec: (the DReSS options, whether the
        sliced model trains afterwards, the head of its row: what identifies it)."""
        seed = {} if self.train_seed == DReSS.train_seed.default else {"train_seed": self.train_seed}
        trained = {"lam": self.lam, "lr": self.lr, "norm": self.norm, "train_batch": self.train_batch, **seed}
        options = {"slice": {"steps": 0},
                   "dress": {"steps": self.steps, **trained},
                   "prox": {"steps": self.steps, **trained, "regulariser": "proximal"},
                   "lam0": {"steps": self.steps, **trained, "lam": 0.0},
                   "npr": {"steps": 0, "lr": self.lr, "train_batch": self.train_batch, **seed}}[name]
        options.update(channels=channels, rescale_norms=self.rescale_norms)
        train_after = name == "npr"
        head = {"label": self.label(name), "lam": None, "lr": self.lr, "norm": None, "train_batch": self.train_batch,
                **options, "train_steps": self.steps if train_after else options["steps"]}
        return Arm(row_key(head), f"{channels} {head['label']}", (options, train_after, head))

    def arms(self, context):
        if context["tasks"] is not None:
            yield Arm(DENSE_ZERO_SHOT, f"{DENSE_ZERO_SHOT} {', '.join(self.tasks)}")
        for channels in self.channels:
            for name in ARMS:
                if name in self.rows:
                    yield self.arm(name, channels)

    def row_key(self, row):
        return row_key(row)

    def done(self, result, arm):
        if arm.key == DENSE_ZERO_SHOT:
            return set(self.tasks) <= set(result["dense_zero_shot"])
        return super().done(result, arm)

    def record(self, result, arm, row):
        if arm.key == DENSE_ZERO_SHOT:
            result["dense_zero_shot"].update(row)
        else:
            super().record(result, arm, row)

    def merge(self, result, on_disk):
        """The rows and the dense zero-shot scores a concurrent run (other channels, rows or tasks) wrote."""
        super().merge(result, on_disk)
        result["dense_zero_shot"] = {**on_disk.get("dense_zero_shot", {}), **result["dense_zero_shot"]}

    def run_arm(self, context, arm, row, checkpoint):
        model, tokenizer, tasks = context["model"], context["tokenizer"], context["tasks"]
        if arm.key == DENSE_ZERO_SHOT:
            return zero_shot(model, tokenizer, tasks, self.limit, self.progress)
        options, train_after, head = arm.spec
        model = copy.deepcopy(model)
        start = time.perf_counter()
        saves, pattern, resumed_at = arm_saves(context["stem"], arm), Structured(self.ratio), 0
        if options["steps"] > 0:  # the regularisation saves as it goes
            method = DReSS(**options, checkpoint=saves, checkpoint_every=self.checkpoint_every)
            method.before_slice = lambda regularised: self._evaluate(context, regularised)
            windows, _ = method.split_windows(context["regularise"])
            resumed_at = method.training_checkpoint(model, pattern, windows).saved_step()
        else:
            method = DReSS(**options)
        report = prune(model, method, pattern, context["regularise"], progress=self.progress)
        log = report["regularisation"]
        if train_after:  # N&P&R: the sliced model, the same steps, windows, optimiser and seed
            resume = TrainingCheckpoint(saves, self.checkpoint_every, {
                "row": head, "model": model_fingerprint(model), "tokens": tokens_digest(context["regularise"])},
                "train-sliced.safetensors")
            resumed_at = resume.saved_step()
            with fp32_master_weights(model), torch.enable_grad():
                log = train(model, list(model.parameters()), context["regularise"], steps=self.steps, lr=self.lr,
                            batch_size=self.train_batch, seed=self.train_seed, checkpoint=resume,
                            desc="train sliced", progress=self.progress)
        train_s = time.perf_counter() - start
        ppl_sliced = self._evaluate(context, model)
        ppl_lora, lora_s, scores = None, None, {}
        if not self.skip_lora:
            start = time.perf_counter()
            lora_finetune(model, context["recover"], steps=self.lora_steps, rank=32, alpha=10.0, lr=self.lora_lr,
                          batch_size=self.train_batch, progress=self.progress)
            lora_s = time.perf_counter() - start
            ppl_lora = self._evaluate(context, model)
            scores = {} if tasks is None else zero_shot(model, tokenizer, tasks, self.limit, self.progress)
        row = {**head, "slice_mass_ratio": report["slice_mass_ratio"],
               **{f"slice_mass_ratio_per_{k}": report[f"slice_mass_ratio_per_{k}"]
                  for k in ("tensor", "layer", "kind")},
               "norm_scale": report["norm_scale"], "width_scale": report["width_scale"],
               "ppl_before_slice": report.get("before_slice"), "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora,
               "zero_shot_lora": scores, "train_s": train_s, "lora_s": lora_s,
               "hidden_size": report["hidden_size"], "pruned_channels": report["pruned_channels"],
               "parameters": [report["cost_before"]["parameters"], report["cost_after"]["parameters"]],
               "loss": log.get("loss"), "penalty": log.get("penalty")}
        if resumed_at:
            row["resumed_at_step"] = resumed_at  # train_s then counts this process's steps alone
        if options["steps"] > 0 and options["lam"] > 0 and options.get("regulariser") != "proximal":
            write_text(mass_plot_path(context["stem"], row), mass_plot(row))
        remove_arm_saves(saves)
        return row

    def describe(self, row):
        if "label" not in row:  # the dense zero-shot scores
            return ", ".join(f"{t} {v['acc']:.3f}" for t, v in sorted(row.items()))
        return f"mass {row['slice_mass_ratio']:.3f}, ppl sliced {row['ppl_sliced']}, + LoRA {row['ppl_lora']}"

    def complete(self, result, context):
        labels = [self.label(name) for name in ARMS]

        def order(row):  # channel choice, then arm (rows of labels this run does not make last)
            label = row["label"]
            return (CHANNELS.index(row["channels"]), labels.index(label) if label in labels else len(labels))

        result["rows"].sort(key=order)
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)
