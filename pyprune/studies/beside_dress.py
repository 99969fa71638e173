"""SLEB and SliceGPT beside DReSS: the structured methods that remove whole blocks or hidden
directions, on the calibration and evaluation of DReSS's table (``results/dress-<model>.json``).

Both draw DReSS's windows (``nsamples`` x ``seqlen`` random Emma windows, seed 0) and evaluate
perplexity on the first ``eval_tokens`` tokens of Pride and Prejudice and of Moby Dick in
``eval_seqlen``-token windows, with zero-shot accuracy on the first ``limit`` items of each of
``tasks``. The DReSS rows of their tables are read from DReSS's results file when it was measured
the same way, never re-run here, and so are its dense scores.

* ``sleb`` (:class:`Sleb`): SLEB (Song et al. 2024) removes ``ratio`` of the decoder blocks,
  searching on the first ``sleb_windows`` windows (every step runs the model once per candidate
  block, so a CPU affords few) drawn with each of ``seeds`` (seed 0: DReSS's); no recovery.
  ``results/sleb-<model>.{json,md}``, one row per seed, resumed, with the seeds' stability.
* ``slicegpt`` (:class:`SliceGpt`): SliceGPT (Ashkboos et al. 2024) slices ``ratio`` of the hidden
  size with PCAs on the first three quarters of the windows (or the first ``pca_windows`` of them),
  the LM head and the last block's output too when ``slice_head``, then LoRA on the last quarter
  with DReSS's recovery settings (unless ``recovery`` is false).
  ``results/dress-slicegpt-<model>.{json,md}``, one row per setting, resumed.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import re
import time
from typing import Optional, Tuple

import torch

from ..evaluation import zeroshot
from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods.options import at_least_one, fraction, nonnegative, option, positive
from ..methods.pruning import prune
from ..nn.dispatch import environment_record
from ..patterns import Structured
from ..runtime.recovery import lora_finetune
from .baselines import CALIB_SOURCE, DEFAULT_MODEL, MODELS, PROTOCOL_HEADER, model_name, model_results
from .dress import row_setting, zero_shot
from .results import mean_std
from .study import Arm, RESULTS_DIR, Study, model_label

EVAL_TEXTS = ("pride_and_prejudice", "moby_dick")


def read_dress(model: str) -> Optional[dict]:
    """DReSS's results file of ``model`` (``results/dress-<model>.json``), None when there is none."""
    path = os.path.join(RESULTS_DIR, f"dress-{model_name(model)}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _evaluation(eval_tokens: int, eval_seqlen: int) -> str:
    """The evaluation as DReSS's settings state it."""
    return f"first {eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, {eval_seqlen}-token windows"


class _BesideDress(Study):
    """What SLEB's and SliceGPT's studies share: the model, DReSS's windows, two evaluation texts
    and the zero-shot tasks."""

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (pyprune.inputs.models)")
    ratio: float = option(0.25, "the share removed (SLEB: of the blocks; SliceGPT: of the hidden size)", fraction)
    nsamples: int = option(800, "DReSS's calibration windows (drawn the same, seed 0)", at_least_one)
    seqlen: int = option(128, "calibration window length", at_least_one)
    eval_tokens: int = option(4096, "the first N tokens of each evaluation text", at_least_one)
    eval_seqlen: int = option(256, "evaluation window length", at_least_one)
    tasks: Optional[Tuple[str, ...]] = option(None, "zero-shot tasks (pyprune.evaluation.zeroshot), scored after "
                                              "the perplexities")
    limit: int = option(200, "items per zero-shot task", at_least_one)

    def output_path(self, output):
        return super().output_path(output if output is not None else model_results(self.results, self.model))

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        calib = data.calibration_samples(tokenizer, CALIB_SOURCE, nsamples=self.nsamples, seqlen=self.seqlen, seed=0)
        tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=self.eval_tokens) for text in EVAL_TEXTS}
        return {"model": model, "tokenizer": tokenizer, "bos": data.window_bos(tokenizer), "calib": calib,
                "tokens": tokens, "tasks": zeroshot.load_tasks(self.tasks) if self.tasks is not None else None}

    def perplexities(self, context, model) -> dict:
        """``model``'s perplexity on each evaluation text (windows start with BOS where the tokenizer's do)."""
        return {text: perplexity(model, ids, self.eval_seqlen, progress=False, bos_token_id=context["bos"])
                for text, ids in context["tokens"].items()}

    def scores(self, context, model) -> dict:
        return {} if context["tasks"] is None else zero_shot(model, context["tokenizer"], context["tasks"], self.limit,
                                                                 self.progress)


def _score(scores, task):
    return f"{scores[task]['acc']:.3f} ± {scores[task]['stderr']:.3f} (n {scores[task]['n']})" if task in scores \
        else "–"


def stability(rows) -> dict:
    """How alike the calibration seeds' searches are: the seeds, the blocks every seed removed
    (``common``), those any seed removed (``any``) and, per pair of seeds, how many blocks both removed
    (``both``) of the ``removed`` each removes."""
    removed = {row["seed"]: set(row["removed_blocks"]) for row in rows}
    seeds = sorted(removed)
    return {"seeds": seeds, "removed": max((len(blocks) for blocks in removed.values()), default=0),
            "common": sorted(set.intersection(*removed.values())) if removed else [],
            "any": sorted(set().union(*removed.values())),
            "pairs": [{"seeds": [a, b], "both": len(removed[a] & removed[b])}
                      for a, b in itertools.combinations(seeds, 2)]}


class Sleb(_BesideDress):
    """SLEB's block removal beside DReSS's rows (DReSS's after LoRA recovery; SLEB's without), one
    search per calibration seed (``seeds``; seed 0 searches on DReSS's own windows), with how stable
    the chosen blocks are over the seeds (:func:`stability`) and the perplexities' mean ± std.
    Ratio 0.25 removes 7 of SmolLM2's 30 blocks (23 kept: 0.75 x 30 rounded half up)."""

    name = "sleb"
    summary = "SLEB's block removal beside DReSS's rows, per calibration seed, perplexity and zero-shot"
    results = "sleb-<model>"

    sleb_windows: int = option(16, "the first N calibration windows SLEB's search runs on (16 x 128 tokens: about "
                               "the authors' few thousand tokens; each candidate's loss rests on all of them)",
                               at_least_one)
    seeds: Tuple[int, ...] = option((0,), "calibration seeds, one search and row each: the first sleb_windows of "
                                    "the nsamples windows drawn with the seed (0: DReSS's windows)", nonnegative)

    def check_options(self):
        if self.sleb_windows > self.nsamples:
            raise ValueError(f"option sleb_windows of study 'sleb' must be at most nsamples ({self.nsamples}); "
                             f"got {self.sleb_windows}")

    def protocol(self, context):
        return {"ratio": self.ratio, "nsamples": self.nsamples, "seqlen": self.seqlen,
                "sleb_windows": self.sleb_windows, "eval_tokens": self.eval_tokens,
                "eval_seqlen": self.eval_seqlen, "limit": self.limit, "threads": torch.get_num_threads()}

    def dress(self, settings: dict) -> Optional[dict]:
        """DReSS's results, when they were evaluated as ``settings`` say (else None)."""
        dress = read_dress(self.model)
        same = dress is not None and dress["settings"]["evaluation"] == _evaluation(settings["eval_tokens"],
                                                                                    settings["eval_seqlen"])
        return dress if same else None

    def start(self, settings, context):
        dress = self.dress(settings)
        dense = dress["dense"] if dress else self.perplexities(context, context["model"])
        dense_zero_shot = dress.get("dense_zero_shot", {}) if dress and self.limit == 200 else {}
        if not set(self.tasks or ()) <= set(dense_zero_shot):
            dense_zero_shot = self.scores(context, context["model"])
        return {"model": MODELS.get(self.model, self.model), "settings": settings,
                "environment": environment_record(torch.device("cpu")), "dense": dense,
                "dense_zero_shot": dense_zero_shot, "rows": []}

    def windows(self, context, seed: int) -> torch.Tensor:
        """The windows seed ``seed``'s search runs on: the first ``sleb_windows`` of the ``nsamples``
        drawn with it."""
        return data.calibration_samples(context["tokenizer"], CALIB_SOURCE, nsamples=self.nsamples,
                                        seqlen=self.seqlen, seed=seed)[:self.sleb_windows]

    def arms(self, context):
        return [Arm(seed, f"sleb {self.ratio:g} seed {seed}") for seed in self.seeds]

    def row_key(self, row):
        return row["seed"]

    def finished(self, row):
        return set(self.tasks or ()) <= set(row["zero_shot"])  # else rerun (the search is deterministic)

    def run_arm(self, context, arm, row, checkpoint):
        model = copy.deepcopy(context["model"])
        report = prune(model, "sleb", Structured(self.ratio), self.windows(context, arm.key), batch_size=4,
                       progress=self.progress)
        row = {"seed": arm.key, "blocks": len(report["removed_blocks"]) + len(report["kept_blocks"]),
               "removed_blocks": report["removed_blocks"], "steps": report["steps"], "time_s": report["time_s"],
               "parameters": [report["parameters_before"], report["parameters_after"]], "options": report["options"],
               "ppl": self.perplexities(context, model), "zero_shot": {}}
        if context["tasks"] is not None:
            checkpoint(row)  # the perplexities while the tasks are scored
            row = dict(row, zero_shot=self.scores(context, model))
        return row

    def describe(self, row):
        return f"removed {row['removed_blocks']}, ppl {row['ppl']}, {row['time_s']:.0f} s"

    def complete(self, result, context):
        result["rows"].sort(key=self.row_key)
        result["stability"] = stability(result["rows"])
        return result

    def markdown(self, result):
        dress = self.dress(result["settings"])
        s, rows = result["settings"], result["rows"]
        tasks = sorted({t for row in rows for t in row["zero_shot"]})  # none until they are scored
        first = rows[0]
        lines = [f"# SLEB on {result['model']}" + (" beside DReSS" if dress else ""), "",
                 f"Ratio {s['ratio']}: {len(first['removed_blocks'])} of {first['blocks']} blocks removed; SLEB "
                 f"searched on {s['sleb_windows']} x {s['seqlen']} Emma windows, the first of {s['nsamples']} x "
                 f"{s['seqlen']} drawn with each calibration seed (seed 0: DReSS's windows); evaluation first "
                 f"{s['eval_tokens']} tokens of {' and '.join(EVAL_TEXTS)}, {s['eval_seqlen']}-token windows; "
                 f"{s['threads']} thread(s). Parameters {first['parameters'][0]:,} -> {first['parameters'][1]:,} "
                 f"({_removed(first['parameters'])} removed). No recovery after SLEB.", ""]

        def line(cells):
            return "| " + " | ".join(cells) + " |"

        search = f"{s['sleb_windows']} x {s['seqlen']}"
        lines += [line(["method", "setting", *PROTOCOL_HEADER, *(f"{t} ppl" for t in EVAL_TEXTS), *tasks,
                        "parameters removed", "removed blocks (in order)", "prune time (s)"]),
                  "|---|---|---|---:|---|" + "---:|" * (len(EVAL_TEXTS) + len(tasks) + 1) + "---|---:|"]
        lines.append(line(["dense", "–", "–", str(s["eval_tokens"]), "–",
                           *(f"{result['dense'][t]:.2f}" for t in EVAL_TEXTS),
                           *(_score(result["dense_zero_shot"], t) for t in tasks), "0", "–", "–"]))
        for row in rows:
            lines.append(line(["SLEB", f"no recovery, seed {row['seed']}", search, str(s["eval_tokens"]),
                               f"1 (seed {row['seed']})", *(f"{row['ppl'][t]:.2f}" for t in EVAL_TEXTS),
                               *(_score(row["zero_shot"], t) for t in tasks), _removed(row["parameters"]),
                               str(row["removed_blocks"]), f"{row['time_s']:.0f}"]))
        if len(rows) > 1:
            seeds = ", ".join(str(row["seed"]) for row in rows)
            lines.append(line(["SLEB", "no recovery, mean ± std over the seeds", search, str(s["eval_tokens"]),
                               f"{len(rows)} ({seeds})",
                               *(mean_std((row["ppl"][t] for row in rows), ".2f") for t in EVAL_TEXTS),
                               *(mean_std((row["zero_shot"].get(t, {}).get("acc") for row in rows), ".3f")
                                 for t in tasks), "–", "–", "–"]))
        calibration = re.search(r"(\d+) x (\d+)", (dress or {}).get("settings", {}).get("calibration", ""))
        for d in (dress or {}).get("rows", []):
            if d.get("ppl_lora") is None:
                continue  # a DReSS row without recovery: nothing to quote beside the LoRA perplexities
            lines.append(line([f"DReSS ({d['channels']} channels)", f"{row_setting(d)}, + LoRA",
                               " x ".join(calibration.groups()) if calibration else "–", str(s["eval_tokens"]),
                               "1 (seed 0)", *(f"{d['ppl_lora'][t]:.2f}" for t in EVAL_TEXTS),
                               *(_score(d.get("zero_shot_lora") or {}, t) for t in tasks),
                               _removed(d["parameters"]), "–", "–"]))
        if len(rows) > 1:
            found = result["stability"]
            lines += ["", f"Stability over the {len(rows)} calibration seeds: blocks removed by every seed "
                      f"{found['common']} ({len(found['common'])} of {found['removed']}); by any seed {found['any']}; "
                      "shared by each pair of seeds: "
                      + ", ".join(f"seeds {pair['seeds'][0]} and {pair['seeds'][1]} {pair['both']} of "
                                  f"{found['removed']}" for pair in found["pairs"]) + "."]
        lines += ["", "Calibration perplexity after each removal (on the seed's own windows):"]
        lines += [f"- seed {row['seed']}: " + ", ".join(f"block {step['removed']}: {step['perplexity']:.2f}"
                                                        for step in row["steps"]) + "." for row in rows]
        return "\n".join(lines) + "\n"


def _removed(parameters) -> str:
    """The share of the parameters removed, from [before, after]."""
    return f"{1 - parameters[1] / parameters[0]:.1%}"


class SliceGpt(_BesideDress):
    """SliceGPT beside DReSS, perplexity and zero-shot sliced and after LoRA (the recovery DReSS's
    table uses: rank 32, alpha 10, ``lora_steps``, ``lora_lr``, ``train_batch`` on the last quarter
    of the windows). Prune time (PCA + rotation) and parameter counts recorded (SliceGPT's model
    carries an untied LM head and two shortcut matrices per block, k x k, but k x d for the last
    block's MLP unless ``slice_head``)."""

    name = "slicegpt"
    summary = "SliceGPT beside DReSS, sliced and after LoRA, perplexity and zero-shot"
    results = "dress-slicegpt-<model>"

    lora_steps: int = option(50, "LoRA steps after slicing (DReSS's table: 50)", at_least_one)
    lora_lr: float = option(1e-4, "LoRA learning rate (DReSS's)", positive)
    train_batch: int = option(4, "LoRA batch (DReSS's)", at_least_one)
    batch_size: int = option(8, "SliceGPT's calibration batch", at_least_one)
    pca_windows: Optional[int] = option(None, "SliceGPT's PCAs on the first N of the calibration windows (default "
                                        "all; DReSS ranks its quiet channels on the first 64)", at_least_one)
    recovery: bool = option(True, "LoRA after slicing (false: the sliced model only, the row says so)")
    slice_head: bool = option(False, "SliceGPT's slice_head: slice the LM head and the last block's output too "
                              "(false, the authors' default: they keep the full hidden size)")

    def _split(self) -> int:
        return (3 * self.nsamples) // 4

    def check_options(self):
        if self.pca_windows is not None and self.pca_windows > self._split():
            raise ValueError(f"option pca_windows of study 'slicegpt' must be at most the {self._split()} windows "
                             f"that calibrate (3/4 of nsamples {self.nsamples}); got {self.pca_windows}")

    def protocol(self, context):
        split = self._split()
        settings = {"hidden": f"{context['model'].config.hidden_size} -> ratio {self.ratio}",
                    "calibration": f"{split} x {self.seqlen} Emma windows train, {self.nsamples - split} train LoRA",
                    "evaluation": _evaluation(self.eval_tokens, self.eval_seqlen),
                    "lora": f"{self.lora_steps} steps, rank 32, alpha 10, lr {self.lora_lr:g}, "
                            f"batch {self.train_batch}",
                    "threads": torch.get_num_threads()}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def dress_rows(self, settings: dict) -> list:
        """DReSS's rows, when its results file was measured with ``settings`` (else none)."""
        dress = read_dress(self.model)
        return dress["rows"] if dress is not None and dress.get("settings") == settings else []

    def start(self, settings, context):
        dress = read_dress(self.model)
        if dress is not None and dress.get("settings") == settings:
            dense, dense_zero_shot = dress["dense"], dict(dress.get("dense_zero_shot", {}))
        else:
            dense, dense_zero_shot = self.perplexities(context, context["model"]), {}
        return {"settings": settings, "environment": None, "dense": dense, "dense_zero_shot": dense_zero_shot,
                "rows": []}

    def _windows(self, context):
        return context["calib"][:self._split()][:self.pca_windows]

    def arms(self, context):
        label = (f"ratio {self.ratio:g}, slice_head {str(self.slice_head).lower()}, PCA on "
                 f"{self._windows(context).shape[0]} of the {self._split()} windows"
                 + ("" if self.recovery else ", no LoRA run"))
        return [Arm(label, label)]

    def row_key(self, row):
        return row["label"]

    def finished(self, row):
        return set(self.tasks or ()) <= set(row.get("zero_shot_sliced", {}))  # else rerun (the PCA is deterministic)

    def run_arm(self, context, arm, row, checkpoint):
        model = copy.deepcopy(context["model"])
        report = prune(model, "slicegpt", Structured(self.ratio), self._windows(context), batch_size=self.batch_size,
                       progress=self.progress, slice_head=self.slice_head)
        ppl_sliced = self.perplexities(context, model)
        sliced_scores = self.scores(context, model)
        ppl_lora, scores, lora_s = None, {}, None
        if self.recovery:
            start = time.perf_counter()
            lora_finetune(model, context["calib"][self._split():], steps=self.lora_steps, rank=32, alpha=10.0,
                          lr=self.lora_lr, batch_size=self.train_batch, progress=self.progress)
            lora_s = time.perf_counter() - start
            ppl_lora = self.perplexities(context, model)
            scores = self.scores(context, model)
        return {"label": arm.key, "ratio": self.ratio, "slice_head": self.slice_head, "options": report["options"],
                "pca_windows": self._windows(context).shape[0], "lora_windows": self.nsamples - self._split(),
                "hidden_size": report["hidden_size"], "head_size": report["head_size"],
                "parameters": [report["parameters_before"], report["parameters_after"]],
                "ppl_sliced": ppl_sliced, "ppl_lora": ppl_lora,
                "zero_shot_sliced": sliced_scores, "zero_shot_lora": scores,
                "prune_s": report["time_s"], "lora_s": lora_s, "kept_variance": report["kept_variance"],
                "rotation_parameters": report["rotation_parameters"], "deviations": report["deviations"]}

    def describe(self, row):
        return (f"ppl sliced {row['ppl_sliced']}, + LoRA {row['ppl_lora']}, zero-shot sliced "
                f"{row['zero_shot_sliced']}, + LoRA {row['zero_shot_lora']}")

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        if not set(self.tasks or ()) <= set(result["dense_zero_shot"]):
            result["dense_zero_shot"].update(self.scores(context, context["model"]))
        return result

    def markdown(self, result):
        dress_rows = self.dress_rows(result["settings"])
        s = result["settings"]
        texts = list(result["dense"])
        tasks = sorted({t for r in result["rows"] + dress_rows
                        for t in {**r.get("zero_shot_sliced", {}), **(r.get("zero_shot_lora") or {})}})
        lines = [f"# SliceGPT beside DReSS on {model_label(s)}", "",
                 f"Hidden size {s['hidden']}; calibration {s['calibration']}; evaluation {s['evaluation']}; "
                 f"LoRA {s['lora']}; {s['threads']} threads. Dense perplexity "
                 + ", ".join(f"{t} {v:.2f}" for t, v in result["dense"].items()) + ". The same windows and "
                 "evaluation as `pyprune study dress`; its rows are quoted from dress-smollm2-135m.json. "
                 "'prune (s)' is SliceGPT's PCA + rotation, DReSS's regularisation + slicing.", "",
                 "| method | setting | " + " | ".join(PROTOCOL_HEADER) + " | parameters | "
                 + " | ".join(f"{t} sliced | {t} + LoRA" for t in texts)
                 + "".join(f" | {t} sliced | {t} + LoRA" for t in tasks) + " | prune (s) | LoRA (s) |",
                 "|---|---|---|---:|---|---:|" + "---:|---:|" * (len(texts) + len(tasks)) + "---:|---:|"]
        split, seqlen, lora_windows = re.match(r"(\d+) x (\d+) Emma windows train, (\d+) train LoRA",
                                               s["calibration"]).groups()
        eval_tokens = re.search(r"first (\d+) tokens", s["evaluation"]).group(1)

        def protocol(windows, lora_windows: Optional[str]) -> str:
            """The calibration (PCA or regularisation windows, then LoRA's), evaluation tokens and seed cells
            (every row draws its windows with seed 0; DReSS's training seeds are in its setting)."""
            lora = f" + {lora_windows} x {seqlen} LoRA" if lora_windows else ""
            return f"{windows} x {seqlen}{lora} | {eval_tokens} | 1 (seed 0)"

        def scores(row):
            """Each task's accuracy sliced, then after LoRA ('–' where not scored)."""
            found = [row.get("zero_shot_sliced") or {}, row.get("zero_shot_lora") or {}]
            return [f"{scored[t]['acc']:.3f} ± {scored[t]['stderr']:.3f}" if t in scored else "–"
                    for t in tasks for scored in found]

        for r in result["rows"]:
            lora = r["ppl_lora"] or {}
            lines.append(f"| SliceGPT | {r['label']} | "
                         f"{protocol(r['pca_windows'], r['lora_windows'] if r['ppl_lora'] else None)} | "
                         f"{r['parameters'][1]:,} | "
                         + " | ".join(f"{r['ppl_sliced'][t]:.2f} | " + (f"{lora[t]:.2f}" if t in lora else "–")
                                      for t in texts)
                         + "".join(f" | {v}" for v in scores(r)) + f" | {r['prune_s']:.0f} | "
                         + (f"{r['lora_s']:.0f} |" if r["lora_s"] is not None else "– |"))
        for r in dress_rows:
            lora = r["ppl_lora"] or {}  # none for a row without recovery
            lines.append(f"| DReSS ({r['channels']}) | {row_setting(r)} | "
                         f"{protocol(split, lora_windows if r['ppl_lora'] else None)} | "
                         f"{r['parameters'][1]:,} | "
                         + " | ".join(f"{r['ppl_sliced'][t]:.2f} | " + (f"{lora[t]:.2f}" if t in lora else "–")
                                      for t in texts)
                         + "".join(f" | {v}" for v in scores(r)) + f" | {r['train_s']:.0f} | "
                         + (f"{r['lora_s']:.0f} |" if r["lora_s"] is not None else "– |"))
        dense = result.get("dense_zero_shot", {})
        if dense:
            lines += ["", "Dense zero-shot: " + ", ".join(f"{t} {v['acc']:.3f} ± {v['stderr']:.3f}"
                                                        for t, v in sorted(dense.items())) + "."]
        for r in result["rows"]:
            kept, (d, k) = r["kept_variance"], r["hidden_size"]
            outputs = kept["block_output"] if r["slice_head"] else kept["block_output"][:-1]  # the sliced ones
            lines += ["", f"SliceGPT {r['label']}: share of the residual signal's variance (Σ eigenvalues) in the "
                      f"kept {k} of {d} directions: embedding {kept['embedding']:.4f}, block outputs min "
                      f"{min(outputs):.4f} / max {max(outputs):.4f}, attention outputs min "
                      f"{min(kept['attention_output']):.4f} / max {max(kept['attention_output']):.4f}"
                      + ("." if r["slice_head"] else f"; the last block's output and the LM head keep all {d}.")]
        return "\n".join(lines) + "\n"
