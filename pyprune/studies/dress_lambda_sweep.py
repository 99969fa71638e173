"""DReSS's penalty weight λ (study ``dress-lambda-sweep``): one regularise-then-slice run per λ
(1e-3 ... 10 by default; the paper's 1e-3, this project's CPU default 1) with everything else at
the settings of study ``dress`` (quiet channels, ``steps`` AdamW steps at ``lr`` over the first
three quarters of its Emma windows, ratio 0.25), no LoRA. Each row: the slice mass after/before
(Fig. 5's measure), the LM loss and the penalty at the first and last step, perplexity of the
sliced model on Pride and Prejudice and Moby Dick. With AdamW, once λ·penalty dominates the LM
loss's gradient every penalised weight moves ~lr per step toward 0 (scheduled zeroing); below that
λ trades the penalty against the loss.
"""
from __future__ import annotations

import copy
import time
from typing import Tuple

import torch

from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods.dress import DReSS
from ..methods.options import at_least_one, fraction, nonnegative, option
from ..methods.pruning import prune
from ..nn.dispatch import environment_record
from ..patterns import Structured
from .dress import CHANNELS, DEFAULT_MODEL, EVAL_TEXTS, dress_option
from .study import Arm, Study, model_label


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# DReSS λ sweep on {model_label(s)}", "",
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


class DressLambdaSweep(Study):
    """DReSS-ℓ2 regularise-then-slice at each λ of ``lams``, no LoRA; see
    :mod:`pyprune.studies.dress_lambda_sweep`. A rerun skips the λ already in the results."""

    name = "dress-lambda-sweep"
    summary = "DReSS's penalty weight λ: slice mass, loss and penalty, sliced perplexity per λ"
    results = "dress-lambda-sweep-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    lams: Tuple[float, ...] = option((1e-3, 1e-2, 1e-1, 1.0, 10.0), "the penalty weights λ, one row each", nonnegative)
    channels: str = option("quiet", "which hidden channels go (as DReSS's option channels)", choices=CHANNELS)
    ratio: float = option(0.25, "share of the hidden channels removed", fraction)
    nsamples: int = option(DReSS.calibration[0], "calibration windows drawn (as study dress: the first three "
                           "quarters regularise)", at_least_one)
    seqlen: int = option(DReSS.calibration[1], "calibration window length", at_least_one)
    steps: int = dress_option("steps")
    lr: float = dress_option("lr", 1e-3)  # the rate the SmolLM2-135M results were measured at
    eval_tokens: int = option(4096, "evaluation tokens of each text", at_least_one)
    eval_seqlen: int = option(256, "evaluation window length", at_least_one)

    def check_options(self) -> None:
        if (3 * self.nsamples) // 4 < 1:
            raise ValueError("option nsamples of study 'dress-lambda-sweep' must leave at least one window in its "
                             f"first three quarters; got {self.nsamples}")

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        calib = data.calibration_samples(tokenizer, "emma", nsamples=self.nsamples, seqlen=self.seqlen, seed=0)
        tokens = {text: data.eval_tokens(tokenizer, text, max_tokens=self.eval_tokens) for text in EVAL_TEXTS}
        return {"model": model, "regularise": calib[:(3 * self.nsamples) // 4], "tokens": tokens}

    def protocol(self, context):
        settings = {"method": f"DReSS-{DReSS.norm.default}, {self.channels} channels, ratio {self.ratio}, "
                              f"{self.steps} AdamW steps at lr {self.lr:g}, batch {DReSS.train_batch.default}",
                    "calibration": f"{context['regularise'].shape[0]} x {self.seqlen} Emma windows",
                    "evaluation": f"first {self.eval_tokens} tokens of {' and '.join(EVAL_TEXTS)}, "
                                  f"{self.eval_seqlen}-token windows", "threads": torch.get_num_threads()}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def _evaluate(self, context, model):
        return {text: perplexity(model, ids, self.eval_seqlen, progress=False)
                for text, ids in context["tokens"].items()}

    def start(self, settings, context):
        return {"settings": settings, "environment": environment_record(torch.device("cpu")),
                "dense": self._evaluate(context, context["model"]), "rows": []}

    def arms(self, context):
        return [Arm(lam, f"λ {lam:g}") for lam in self.lams]

    def row_key(self, row):
        return row["lam"]

    def run_arm(self, context, arm, row, checkpoint):
        model = copy.deepcopy(context["model"])
        start = time.perf_counter()
        report = prune(model, "dress", Structured(self.ratio), context["regularise"], progress=self.progress,
                       lam=arm.key, steps=self.steps, lr=self.lr, channels=self.channels)
        log = report["regularisation"]
        return {"lam": arm.key, "slice_mass_ratio": report["slice_mass_ratio"],
                "slice_mass_ratio_per_kind": report["slice_mass_ratio_per_kind"],
                "loss": log["loss"], "penalty": log["penalty"], "time_s": time.perf_counter() - start,
                "ppl_sliced": self._evaluate(context, model)}

    def describe(self, row):
        return f"mass {row['slice_mass_ratio']:.3f}, ppl sliced {row['ppl_sliced']}"

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)
