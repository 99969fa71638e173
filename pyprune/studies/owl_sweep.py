"""OWL's M and λ tuned on a held-out text, then compared with uniform sparsity over calibration seeds
(study ``owl-sweep``).

The ``owl`` study runs OWL (Yin et al. 2024) at the paper's LLaMA-7B setting, M = 5 and λ = 0.08, on
one calibration draw. This study asks whether another setting helps a small model, without tuning on
a reported text:

1. **Tuning** (per method, the first seed's calibration): uniform sparsity and OWL at every (M, λ)
   of the grid (by default λ ∈ {0.02, 0.08, 0.2} × M ∈ {3, 5, 10}: the ends of the ranges the paper's
   ablation spans and its setting, a grid of 9 that a shared 2-core CPU runs in a few hours per model
   and method; ``--owl-ms`` and ``--owl-lambdas`` refine it, resuming the rows there). Each row's *tuning perplexity* is on the first ``tuning_tokens`` tokens
   of Persuasion (:data:`TUNING_SOURCE`): an Austen novel, like the evaluation text, that no reported
   table calibrates or evaluates on (the tables calibrate on Emma and report on Pride and Prejudice,
   Moby Dick and the second half of the six novels joined, which starts in Northanger Abbey). The
   chosen setting (:func:`select`) is the grid's OWL row with the lowest tuning perplexity.
2. **Seeds**: uniform, the paper's setting and the chosen one on every calibration seed, evaluated
   as the ``owl`` study does (16 × 256 Emma windows, the first 4096 tokens of Pride and Prejudice);
   per setting the mean ± std over seeds, and the verdict of :mod:`pyprune.studies.verdict` on each
   OWL setting against uniform, paired by seed.

Every row records both perplexities (so the first seed's rows of step 2 are those of step 1); the
choice reads only the tuning one. ``results/owl-sweep-<model>.{json,md}``; the methods, the grid
and the seeds are arms, so a run of part of them resumes into the same file.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods import owl
from ..methods.options import at_least_one, fraction, nonnegative, option, positive
from ..nn.dispatch import environment_record
from ..patterns import Unstructured
from ..runtime import engine
from .baselines import CALIB_SOURCE, EVAL_SOURCE, MODELS, OWL_METHODS, _PruneAndEvaluate
from .results import mean_std, verdict_cell
from .verdict import RULE, Verdict, paired_verdict
from .study import Arm

#: the text the setting is chosen on: no reported table calibrates or evaluates on it
TUNING_SOURCE = "persuasion"
#: the default grid: OWL's M (outlier threshold) and λ (half the block sparsities' spread)
GRID_M: Tuple[float, ...] = (3.0, 5.0, 10.0)
GRID_LAMBDA: Tuple[float, ...] = (0.02, 0.08, 0.2)
#: the paper's setting (LLaMA-7B at 70%), (M, λ): the ``owl`` study's
PAPER = (5.0, 0.08)

Setting = Optional[Tuple[float, float]]  # (M, λ), or None for uniform sparsity


def setting_of(row: dict) -> Setting:
    """A row's allocation: its (M, λ), or None for uniform."""
    return (row["m"], row["lambda"]) if row["owl"] else None


def select(rows: Iterable[dict], method: str, seed: int, grid: Sequence[Tuple[float, float]]) -> Optional[dict]:
    """The chosen setting: of ``method``'s rows at calibration ``seed``, the OWL row of the ``grid``'s
    settings with the lowest tuning perplexity (the first in the grid's order on a tie); None until
    every setting of the grid has its row."""
    found = {setting_of(row): row for row in rows
             if row["method"] == method and row["seed"] == seed and row["owl"]}
    if not grid or any(tuple(setting) not in found for setting in grid):
        return None
    return min((found[tuple(setting)] for setting in grid), key=lambda row: row["tuning_perplexity"])


def owl_verdict(rows: Iterable[dict], method: str, setting: Tuple[float, float]) -> Optional[Verdict]:
    """OWL at ``setting`` against uniform for ``method``, paired by calibration seed (perplexity on
    the evaluation text, lower is better); None until both share a seed."""
    rows = [row for row in rows if row["method"] == method]
    ours = {row["seed"]: row["perplexity"] for row in rows if setting_of(row) == tuple(setting)}
    theirs = {row["seed"]: row["perplexity"] for row in rows if setting_of(row) is None}
    return paired_verdict(ours, theirs) if ours.keys() & theirs.keys() else None


def _label(setting: Setting, chosen: Setting) -> str:
    if setting is None:
        return "uniform"
    names = [name for name, match in (("paper", tuple(setting) == PAPER), ("tuned", setting == chosen)) if match]
    return f"OWL M {setting[0]:g}, λ {setting[1]:g}" + (f" ({' = '.join(names)})" if names else "")


def markdown(result: dict) -> str:
    s = result["settings"]
    tuning_seed = result["tuning_seed"]
    lines = [f"# OWL's M and λ tuned at {s['sparsity']:g} sparsity on {result['model']}", "",
             f"Calibration {s['nsamples']} x {s['seqlen']} tokens of Emma; tuning text {result['tuning']} (no "
             f"reported table uses it); evaluation {result['evaluation']}. Dense perplexity: tuning "
             f"{result['dense']['tuning']:.2f}, evaluation {result['dense']['evaluation']:.2f}. The tuned setting "
             f"is the grid's OWL (M, λ) with the lowest tuning perplexity on calibration seed {tuning_seed}; the "
             f"verdict on OWL − uniform (evaluation perplexity, paired by seed): {RULE}. "
             f"Grid: λ ∈ {{{', '.join(f'{v:g}' for v in result['grid']['lambda'])}}} × "
             f"M ∈ {{{', '.join(f'{v:g}' for v in result['grid']['m'])}}}. "
             f"{result['environment']['cpu_threads']} thread(s).", ""]
    for method, chosen in result["selection"].items():
        rows = [r for r in result["rows"] if r["method"] == method]
        tuning = {setting_of(r): r for r in rows if r["seed"] == tuning_seed}
        ms = sorted({r["m"] for r in rows if r["owl"] and r["seed"] == tuning_seed})
        lams = sorted({r["lambda"] for r in rows if r["owl"] and r["seed"] == tuning_seed})
        best = (chosen["m"], chosen["lambda"]) if chosen else None
        lines += [f"## {method}: tuning perplexity (seed {tuning_seed})", "",
                  "Uniform: " + (f"{tuning[None]['tuning_perplexity']:.2f} / {tuning[None]['perplexity']:.2f}"
                                 if None in tuning else "–")
                  + ". Tuned: " + (f"M {best[0]:g}, λ {best[1]:g} ({chosen['tuning_perplexity']:.2f})"
                                  if best else "not yet (the grid is not complete)") + ". Each cell: tuning "
                  "perplexity / evaluation perplexity of the same pruned model (the choice reads only the first).",
                  ""]
        if ms:
            lines += ["| λ \\ M | " + " | ".join(f"{m:g}" for m in ms) + " |", "|---:|" + "---:|" * len(ms)]
        for lam in lams:
            cells = []
            for m in ms:
                row = tuning.get((m, lam))
                cell = f"{row['tuning_perplexity']:.2f} / {row['perplexity']:.2f}" if row else "–"
                cells.append(f"**{cell}**" if (m, lam) == best else cell)
            lines.append(f"| {lam:g} | " + " | ".join(cells) + " |")
        lines += [""] if ms else []
    lines += ["## Over calibration seeds: perplexity on the evaluation text", "",
              "| method | allocation | calibration (windows x tokens) | evaluation tokens | seeds | measured sparsity | "
              "block sparsity min–max | perplexity per seed | perplexity | tuning perplexity | OWL − uniform |",
              "|---|---|---|---:|---|---:|---|---|---:|---:|---|"]
    for method, chosen in result["selection"].items():
        best = (chosen["m"], chosen["lambda"]) if chosen else None
        shown = [None, PAPER] + ([best] if best and best != PAPER else [])
        for setting in shown:
            rows = sorted((r for r in result["rows"] if r["method"] == method and setting_of(r) == setting),
                          key=lambda r: r["seed"])
            if not rows:
                continue
            verdict = owl_verdict(result["rows"], method, setting) if setting else None
            spread = (f"{min(min(r['block_sparsity']) for r in rows):.3f}–"
                      f"{max(max(r['block_sparsity']) for r in rows):.3f}" if setting else "–")
            lines.append(
                f"| {method} | {_label(setting, best)} | {s['nsamples']} x {s['seqlen']} | {s['eval_tokens']} | "
                f"{len(rows)} ({', '.join(str(r['seed']) for r in rows)}) | "
                f"{mean_std((r['sparsity'] for r in rows), '.3f')} | {spread} | "
                f"{' / '.join(format(r['perplexity'], '.2f') for r in rows)} | "
                f"{mean_std((r['perplexity'] for r in rows), '.2f')} | "
                f"{mean_std((r['tuning_perplexity'] for r in rows), '.2f')} | "
                f"{verdict_cell(verdict, '.2f') if verdict else '–'} |")
    return "\n".join(lines) + "\n"


class OwlSweep(_PruneAndEvaluate):
    """OWL's (M, λ) chosen on a held-out text, then OWL beside uniform over calibration seeds (see
    the module docstring). Arms, per method: the first seed's uniform and grid rows, then on every seed
    uniform, the paper's setting and the one chosen from those rows (:func:`select`)."""

    name = "owl-sweep"
    summary = "OWL's M and λ tuned on a held-out text, then OWL beside uniform over calibration seeds"
    results = "owl-sweep-<model>"

    eval_tokens: int = option(4096, "the first N tokens of Pride and Prejudice evaluated", at_least_one)
    tuning_tokens: int = option(4096, "the first N tokens of Persuasion (the text the setting is chosen on)",
                                at_least_one)
    sparsity: float = option(0.7, "the unstructured sparsity (the blocks' mean under OWL)", fraction)
    methods: Tuple[str, ...] = option(("wanda", "sparsegpt"), "the methods (each tuned on its own)",
                                      choices=OWL_METHODS)
    owl_ms: Tuple[float, ...] = option(GRID_M, "the grid's OWL M values (outlier above M x the block's mean score)",
                                       positive)
    owl_lambdas: Tuple[float, ...] = option(GRID_LAMBDA, "the grid's OWL λ values (the block sparsities span "
                                            "2λ around the target, their mean)", positive)
    seeds: Tuple[int, ...] = option((0, 1, 2), "the calibration seeds; the first is the one the grid is tuned on",
                                    nonnegative)

    def grid(self) -> List[Tuple[float, float]]:
        """The (M, λ) settings tuned over, λ-major."""
        return [(m, lam) for lam in self.owl_lambdas for m in self.owl_ms]

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        blocks = len(engine.decoder_blocks(model))
        for lam in self.owl_lambdas:
            try:
                owl.check_spread(self.sparsity, lam, blocks)
            except ValueError as error:
                raise ValueError(f"option owl_lambdas of study 'owl-sweep': {error}") from None
        calib = {seed: data.calibration_samples(tokenizer, CALIB_SOURCE, nsamples=self.nsamples, seqlen=self.seqlen,
                                                seed=seed) for seed in self.seeds}
        return {"model": model, "bos": data.window_bos(tokenizer), "calib": calib,
                "tokens": data.eval_tokens(tokenizer, EVAL_SOURCE, max_tokens=self.eval_tokens),
                "tuning": data.eval_tokens(tokenizer, TUNING_SOURCE, max_tokens=self.tuning_tokens)}

    def protocol(self, context):
        return {"model": self.model, "calibration": CALIB_SOURCE, "nsamples": self.nsamples, "seqlen": self.seqlen,
                "sparsity": self.sparsity, "tuning": TUNING_SOURCE, "tuning_tokens": self.tuning_tokens,
                "evaluation": EVAL_SOURCE, "eval_tokens": self.eval_tokens}

    def _windows(self, context) -> str:
        return f"{self.seqlen}-token windows" + (" each starting with <bos>" if context["bos"] is not None else "")

    def start(self, settings, context):
        return {"model": MODELS.get(self.model, self.model), "settings": settings,
                "tuning": f"first {context['tuning'].numel()} tokens of austen/{TUNING_SOURCE}.txt, "
                          + self._windows(context),
                "evaluation": f"first {context['tokens'].numel()} tokens of austen/{EVAL_SOURCE}.txt, "
                              + self._windows(context),
                "dense": {"tuning": self.score(context, context["model"], "tuning"),
                          "evaluation": self.score(context, context["model"], "tokens")},
                "rows": []}

    def score(self, context, model, text: str) -> float:
        return perplexity(model, context[text], self.seqlen, bos_token_id=context["bos"], progress=False)

    def arm(self, method: str, setting: Setting, seed: int) -> Arm:
        label = "uniform" if setting is None else f"owl M {setting[0]:g} λ {setting[1]:g}"
        return Arm((method, setting, seed), f"{method} {label} seed {seed}")

    def arms(self, context):
        tuning_seed = self.seeds[0]
        for method in self.methods:
            yield self.arm(method, None, tuning_seed)
            for setting in self.grid():
                yield self.arm(method, setting, tuning_seed)
            chosen = select(self.current["rows"], method, tuning_seed, self.grid())
            for seed in self.seeds:
                for setting in dict.fromkeys([None, PAPER, (chosen["m"], chosen["lambda"])]):
                    yield self.arm(method, setting, seed)

    def row_key(self, row):
        return row["method"], setting_of(row), row["seed"]

    def run_arm(self, context, arm, row, checkpoint):
        method, setting, seed = arm.key
        options = {} if setting is None else {"owl": True, "owl_m": setting[0], "owl_lambda": setting[1]}
        start = time.perf_counter()
        model, report = self.pruned({"model": context["model"], "calib": context["calib"][seed]}, method,
                                    Unstructured(self.sparsity), **options)
        allocation = report.get("owl", {})
        m, lam = setting if setting is not None else (None, None)
        return {"method": method, "owl": setting is not None, "m": m, "lambda": lam, "seed": seed, "sparsity": round(report["sparsity"], 4),
                "tuning_perplexity": self.score(context, model, "tuning"),
                "perplexity": self.score(context, model, "tokens"), "prune_time_s": report["time_s"],
                "time_s": round(time.perf_counter() - start, 1),
                "block_sparsity": allocation.get("block_sparsity"), "outlier_ratio": allocation.get("outlier_ratio")}

    def describe(self, row):
        return (f"tuning perplexity {row['tuning_perplexity']:.3f}, perplexity {row['perplexity']:.3f}, "
                f"{row['time_s']:.1f} s")

    def complete(self, result, context):
        """The environment, and per method the setting chosen so far (None until its grid is complete)."""
        result["environment"] = environment_record(torch.device("cpu"))
        result["tuning_seed"] = self.seeds[0]
        result["grid"] = {"m": list(self.owl_ms), "lambda": list(self.owl_lambdas)}
        selection: Dict[str, Optional[dict]] = dict(result.get("selection", {}))
        for method in self.methods:
            chosen = select(result["rows"], method, self.seeds[0], self.grid())
            selection[method] = None if chosen is None else {
                "m": chosen["m"], "lambda": chosen["lambda"], "tuning_perplexity": chosen["tuning_perplexity"],
                "rule": f"lowest tuning perplexity over the grid at calibration seed {self.seeds[0]}"}
        result["selection"] = selection
        result["rows"] = result.pop("rows")  # the rows last, as the file has them
        return result

    def markdown(self, result):
        return markdown(result)
