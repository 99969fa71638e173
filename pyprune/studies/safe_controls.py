"""The controls of the SAFE / SAFE⁺ study: is ADMM + SAM the cause of the gain over the one-shot
methods, or is plain block-wise reconstruction training? Is SAM's ascent of any size, and are
SAFE⁺'s weights flatter?

Study ``safe-controls``. Arms (option ``variants``, :data:`ARMS`), every one on the same calibration windows
and, where it trains, with the same budget (the training options ``epochs``, ``train_batch``,
``lr`` …, applied to every training arm alike: steps, batch, Adam betas, lr and schedule, relative
loss, minibatch seed, sequential propagation):

* ``wanda``, ``sparsegpt``: the one-shot methods;
* ``safe+`` / ``safe``: SAFE⁺ / SAFE with their CPU defaults; ``safe+ rho=0``: without SAM;
  ``safe+ rho=5e-3``: ρ scaled 25x, as the learning rate was (paper 2e-4 → 5e-3); ``safe+ dual_init=box``:
  u₀ = x₀ − z₀ (the printed box's u-step at t = 0) instead of Algorithm 1's u₀ = 0;
  ``safe+ lam_schedule=cosine``: λ ramped from 0 over each block's steps (the paper's penalty
  warm-up) and ``safe+ lam=25 K=4`` (the sweep's lowest error), two arms where ADMM has room to move
  the mask away from z₀ (Wanda's mask); the table reports how far it moved;
* ``masked-recon wanda`` / ``magnitude`` / ``sparsegpt``: the control
  (:mod:`pyprune.methods.reconstruction`), each block pruned one-shot by the start (Wanda's mask
  is SAFE⁺'s z₀, magnitude's SAFE's), then its kept weights trained with the same budget, no ADMM,
  no SAM.

Texts: calibration = random windows of the first half of Emma (``emma:first_half``, one draw per
seed of ``seeds``); reported = perplexity on the first ``eval_tokens`` tokens of the second half of
Pride and Prejudice (``pride_and_prejudice:second_half``), a text no setting was tuned on (the SAFE
defaults were chosen on the first 4096 tokens of Pride and Prejudice, in its first half) and no
calibration window comes from. Flatness, at the final pruned weights of the blocks
``flat_blocks``, on the block's relative reconstruction error
f = ‖B(X) − B_dense(X)‖² / ‖B_dense(X)‖² over X = the pruned model's inputs to the block for the
first 4 evaluation windows: the mean increase of f under antithetic random perturbations of
‖ε_t‖ = r·‖w_t‖ per weight on its kept entries, over f, and the top eigenvalue of ∇²f on the kept
entries (power iteration, :mod:`pyprune.runtime.flatness`).

Perplexity is reported as mean ± std over the calibration seeds run, and as paired differences
between arms on the seeds both ran (:data:`PAIRED`) with the verdict of
:func:`pyprune.studies.verdict.paired_verdict`; ``skip_flatness`` spares extra seeds the flatness
measure; with ``vary_train_seed`` each seed also draws the training arms' minibatches (their
``train_seed`` is the calibration seed). Each arm saves every finished block in
NAME.checkpoints/ beside the results file (removed once its row is written): a stopped run goes on
from the block after the last save, its row marked ``resumed`` (its ``time_s`` then counts the
blocks of the last process alone). The committed rows ran on one thread
(``pyprune study safe-controls --threads 1 …``).
"""
from __future__ import annotations

import copy
import math
import os
from typing import Optional, Tuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import methods, patterns
from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods.options import at_least_one, nonnegative, option
from ..methods.pruning import prune
from ..methods.reconstruction import BlockTraining
from ..nn.dispatch import environment_record
from ..runtime import engine
from ..runtime.flatness import perturbed_loss_increase, top_hessian_eigenvalue
from .safe import CALIBRATION_TEXT, DEFAULT_MODEL, REPORT_TEXT, given, method_setting
from .study import Arm, Study, arm_saves, model_label, remove_arm_saves
from .verdict import paired_verdict

#: arm name → (method, options beyond the shared training options)
ARMS = {
    "wanda": ("wanda", {}),
    "sparsegpt": ("sparsegpt", {}),
    "safe+": ("safe+", {}),
    "masked-recon wanda": ("masked-recon", {"start": "wanda"}),
    "masked-recon sparsegpt": ("masked-recon", {"start": "sparsegpt"}),
    "safe": ("safe", {}),
    "masked-recon magnitude": ("masked-recon", {"start": "magnitude"}),
    "safe+ rho=0": ("safe+", {"rho": 0.0}),
    "safe+ rho=5e-3": ("safe+", {"rho": 5e-3}),
    "safe+ dual_init=box": ("safe+", {"dual_init": "box"}),
    "safe+ lam_schedule=cosine": ("safe+", {"lam_schedule": "cosine"}),
    "safe+ lam=25 K=4": ("safe+", {"lam": 25.0, "dual_interval": 4}),
}
TRAINING = ("safe", "safe+", "masked-recon")
#: the training options every training arm shares (the settings' "training": epochs and those given)
TRAINING_OPTIONS = ("epochs", "train_batch", "lr", "warmup_epochs", "loss", "beta2", "train_seed")
RELATIVE_NORMS = (0.01, 0.05)
#: (arm, against): perplexity differences on the calibration seeds both ran (the seed's windows cancel)
PAIRED = (("safe+", "masked-recon wanda"), ("safe+", "sparsegpt"), ("masked-recon wanda", "sparsegpt"),
          ("masked-recon sparsegpt", "sparsegpt"),
          ("safe+", "safe+ rho=0"), ("safe+", "safe+ rho=5e-3"), ("safe+", "safe+ dual_init=box"),
          ("safe", "masked-recon magnitude"), ("safe+ lam_schedule=cosine", "masked-recon wanda"),
          ("safe+ lam=25 K=4", "masked-recon wanda"))
#: the settings' tuning line (the defaults were chosen by the sweep when it was a script,
#: benchmarks/safe_sweep_smollm2.py; the files record it under that name)
TUNING = ("the SAFE defaults (decoupled penalty, λ 100, K 8, lr 5e-3, 64 windows) were chosen by "
          "safe_sweep_smollm2.py on the first 4096 tokens of pride_and_prejudice (its first half); nothing "
          "in this file was tuned")


def flatness(model, dense, windows, blocks, pairs, iterations):
    """Per block of ``blocks``: the flatness of its relative reconstruction error at its pruned
    weights (kept entries only), on the pruned model's inputs to it for ``windows``."""
    with torch.no_grad():
        hidden = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states
    arguments = engine.capture_block_arguments(model, windows)
    out = {}
    for index in blocks:
        block, dense_block = engine.decoder_blocks(model)[index], engine.decoder_blocks(dense)[index]
        inputs, kwargs = hidden[index], arguments[index]
        with torch.no_grad():
            wanted = engine.first_tensor(dense_block(inputs, **kwargs)).float()
        scale = wanted.square().sum()
        weights = [linear.weight for linear in engine.block_linears(block).values()]
        masks = {w: w.detach() != 0 for w in weights}

        def loss():
            return (engine.first_tensor(block(inputs, **kwargs)).float() - wanted).square().sum() / scale

        row = {}
        for r in RELATIVE_NORMS:
            measured = perturbed_loss_increase(loss, weights, relative_norm=r, pairs=pairs, masks=masks)
            row["loss"] = measured["loss"]
            row[f"increase_r{r}"] = measured["relative_increase"]
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention has no double backward
            row["top_eigenvalue"] = top_hessian_eigenvalue(loss, weights, iterations=iterations, masks=masks)
        out[str(index)] = row
    return out


def summary(blocks):
    """Means over blocks of the per-block diagnostics a training arm reports."""
    if not blocks:
        return {}
    out = {"loss_last": sum(b["loss_last"] for b in blocks) / len(blocks)}
    for key in ("mask_moved", "sam_relative", "sam_per_weight", "step_over_sam"):
        values = [b[key] for b in blocks if b.get(key) is not None]
        if values:
            out[key] = sum(values) / len(values)
    if "residuals" in blocks[0]:
        out["residual_last_max"] = max(b["residuals"][-1] for b in blocks)
    return out


def _mean_std(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")
    return mean, std


def markdown(result) -> str:
    s, env = result["settings"], result["environment"]
    lines = [f"# SAFE / SAFE⁺ controls on {model_label(s)}", "",
             f"Calibration: {s['calibration']}. Reported: {s['evaluation']}. Tuning: {s['tuning']}. "
             f"Training arms: {s['training']}. Protocol cut: {s['protocol_cut']}. "
             f"{env['device']}, {env['cpu_threads']} threads, torch {env['torch']}.", "",
             f"Dense perplexity: {result['dense']:.3f}", "",
             "Perplexity, mean ± std over the calibration seeds run (each seed's value in the seeds column); block "
             f"diagnostics are means over blocks and seeds. Flatness, per block ({' / '.join(s['flat_blocks'])}, "
             "means over the seeds that measured it; a seed run without it, `--skip-flatness`, is marked ° in the "
             "seeds column) on held-out windows: f = the block's relative reconstruction error at the final "
             "weights, Δf/f = its relative increase under random perturbations of relative norm r on the kept "
             "weights (antithetic pairs), and the top eigenvalue of ∇²f on the kept weights.", "",
             "| pattern | arm | perplexity | seeds | mean last training loss (calibration; SAFE: at x before "
             "its final projection) | f (held-out, final weights) | "
             + " | ".join(f"Δf/f at r={r}" for r in RELATIVE_NORMS) + " | top eigenvalue of ∇²f | prune time (s) |",
             "|---|---|---:|---|---:|---:|" + "---:|" * len(RELATIVE_NORMS) + "---:|---:|"]
    groups = {}
    for row in result["rows"]:
        groups.setdefault((row["pattern"], row["arm"]), []).append(row)
    for (pattern, arm), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        mean, std = _mean_std([r["perplexity"] for r in rows])
        ppl = f"{mean:.3f}" + (f" ± {std:.3f}" if len(rows) > 1 else "")
        seeds = ", ".join(f"{r['seed']}{'' if r['flatness'] else '°'}: {r['perplexity']:.3f}" for r in rows)
        loss_last = [r["summary"]["loss_last"] for r in rows if r["summary"]]
        def avg(key, fmt):  # per flatness block (mean over seeds), "first / second / …"
            per_block = [[r["flatness"][b][key] for r in rows if b in r["flatness"]] for b in s["flat_blocks"]]
            return " / ".join(format(sum(v) / len(v), fmt) for v in per_block if v) or "–"

        lines.append(f"| {pattern} | {arm} | {ppl} | {seeds} | "
                     + (f"{sum(loss_last) / len(loss_last):.4f}" if loss_last else "–")
                     + f" | {avg('loss', '.2g')} | "
                     + " | ".join(avg(f"increase_r{r}", ".3f") for r in RELATIVE_NORMS)
                     + f" | {avg('top_eigenvalue', '.3g')} | {sum(r['time_s'] for r in rows) / len(rows):.0f} |")
    paired = []
    for pattern in dict.fromkeys(pattern for pattern, _ in groups):
        for arm, against in PAIRED:
            ours = {r["seed"]: r["perplexity"] for r in groups.get((pattern, arm), [])}
            theirs = {r["seed"]: r["perplexity"] for r in groups.get((pattern, against), [])}
            differences = [(seed, ours[seed] - theirs[seed]) for seed in sorted(ours.keys() & theirs.keys())]
            if differences:
                mean, std = _mean_std([d for _, d in differences])
                paired.append(f"| {pattern} | {arm} − {against} | {mean:+.3f}" + (f" ± {std:.3f}" if len(
                    differences) > 1 else "") + " | " + ", ".join(f"{seed}: {d:+.3f}" for seed, d in differences)
                    + f" | {paired_verdict(ours, theirs).word} |")
    if paired:
        lines += ["", "Paired perplexity differences, arm − the arm it is set against, on the calibration seeds both "
                  "ran (mean ± std over those seeds; negative = the first arm is better); verdict: the first arm "
                  "ahead or behind only when the differences have the same sign on every seed and |mean| > 2·sem "
                  "(pyprune.studies.verdict), otherwise unsettled:", "",
                  "| pattern | difference | mean ± std | per seed | verdict |", "|---|---|---:|---|---|", *paired]
    sam = [(pattern, arm, rows) for (pattern, arm), rows in groups.items()
           if rows[0]["summary"].get("sam_relative") is not None]
    if sam:
        lines += ["", "SAFE's ascent and ADMM (means over blocks and seeds): ‖ε‖/‖w‖ = ρ over the norm of a "
                  "block's 7 final weights; per-weight ascent = ρ/√n (RMS); Adam step = the mean norm of a step's "
                  "Adam move (before the decoupled penalty's own step) in units of ρ; mask moved = fraction of z₀'s "
                  "kept entries pruned at the end; last residual = worst block's ‖x − z‖/‖x‖ at the last dual "
                  "update.", "",
                  "| pattern | arm | ρ | ‖ε‖/‖w‖ | per-weight ascent | Adam step / ‖ε‖ | mask moved from z₀ | "
                  "worst last residual |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for pattern, arm, rows in sam:
            def avg(key):
                values = [r["summary"][key] for r in rows if r["summary"].get(key) is not None]
                return sum(values) / len(values) if values else None
            step = avg("step_over_sam")
            lines.append(f"| {pattern} | {arm} | {rows[0]['options']['rho']:g} | {avg('sam_relative'):.2e} | "
                         f"{avg('sam_per_weight'):.2e} | " + (f"{step:.0f}" if step is not None else "– (ρ = 0)")
                         + f" | {100 * avg('mask_moved'):.2g}% | "
                         + f"{max(r['summary']['residual_last_max'] for r in rows):.4f} |")
    return "\n".join(lines) + "\n"


class SafeControls(Study):
    """SAFE / SAFE⁺ against masked reconstruction from the same start, SAM's size and flatness
    (see the module docstring). One arm per calibration seed × pattern × arm of :data:`ARMS`."""

    name = "safe-controls"
    summary = "SAFE / SAFE⁺ against block training of the one-shot mask (no ADMM, no SAM), SAM's size, flatness"
    results = "safe-controls-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    patterns: Tuple[str, ...] = option(("0.5",), "patterns: an unstructured sparsity or N:M")
    variants: Tuple[str, ...] = option(tuple(ARMS), "the arms: "
                                   + "; ".join(f"{name} = {method} {options}" for name, (method, options)
                                               in ARMS.items() if options), choices=tuple(ARMS))
    seeds: Tuple[int, ...] = option((0,), "calibration seeds (one draw of windows each)", nonnegative)
    nsamples: int = option(16, "calibration windows per seed", at_least_one)
    seqlen: int = option(128, "calibration window length", at_least_one)
    eval_tokens: int = option(2048, "evaluation tokens", at_least_one)
    eval_seqlen: int = option(256, "evaluation window length", at_least_one)
    flat_blocks: Tuple[int, ...] = option((2, 15, 28), "blocks whose flatness is measured", nonnegative)
    flat_pairs: int = option(2, "flatness: antithetic perturbation pairs", at_least_one)
    flat_iterations: int = option(6, "flatness: power iterations for the top Hessian eigenvalue", at_least_one)
    skip_flatness: bool = option(False, "rows of this run skip the flatness measure (for extra seeds; the table "
                                 "marks them)")
    # the training arms' shared options (the settings' "training": epochs and those given)
    epochs: int = option(3, "training arms: passes over the calibration samples per block (24 steps per block at "
                         "16 windows, batch 2)", at_least_one)
    train_batch: Optional[int] = method_setting(BlockTraining, "train_batch", "training arms")
    lr: Optional[float] = method_setting(BlockTraining, "lr", "training arms")
    warmup_epochs: Optional[float] = method_setting(BlockTraining, "warmup_epochs", "training arms")
    loss: Optional[str] = method_setting(BlockTraining, "loss", "training arms")
    beta2: Optional[float] = method_setting(BlockTraining, "beta2", "training arms")
    train_seed: Optional[int] = method_setting(BlockTraining, "train_seed", "training arms")
    vary_train_seed: bool = option(False, "training arms: the minibatch seed is the calibration seed, so that the "
                                   "seeds vary the minibatch order too (instead of train_seed)")

    @property
    def training(self) -> dict:
        """The options every training arm shares."""
        return given(self, TRAINING_OPTIONS)

    def arm_options(self, arm: str, seed: int = 0) -> Tuple[str, dict]:
        """(method, options) of arm ``arm`` on calibration seed ``seed``: its own options and, for a
        training arm, the shared ones (with ``vary_train_seed`` the minibatch seed is ``seed``)."""
        method, options = ARMS[arm]
        if method not in TRAINING:
            return method, dict(options)
        return method, {**options, **self.training, **({"train_seed": seed} if self.vary_train_seed else {})}

    def check_options(self) -> None:
        if self.vary_train_seed and self.train_seed is not None:
            raise ValueError("options train_seed and vary_train_seed of study 'safe-controls': give one; "
                             "vary_train_seed takes the calibration seed as the training seed")
        for spec in self.patterns:
            try:
                patterns.parse(spec)
            except ValueError as error:
                raise ValueError(f"option patterns of study 'safe-controls': {error}") from None
        for arm in self.variants:  # the constraints between the methods' options, before anything loads
            method, options = self.arm_options(arm)
            methods.get(method, **options)

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        tokens = data.eval_tokens(tokenizer, REPORT_TEXT, max_tokens=self.eval_tokens)
        return {"model": model, "tokenizer": tokenizer, "tokens": tokens, "bos": data.window_bos(tokenizer),
                "flat_windows": data.windows(tokens, self.eval_seqlen)[:4], "calib": {},
                "stem": os.path.splitext(path)[0]}

    def _protocol_cut(self, steps: int, batch: int) -> str:
        """How this run's calibration and training budget stands against the table's 64 x 256 windows and 96
        steps of 2 x 256 tokens: cut when it has fewer calibration tokens, otherwise none."""
        if self.nsamples * self.seqlen < 64 * 256:
            return (f"{self.nsamples} x {self.seqlen} calibration windows instead of the table's 64 x 256, {steps} "
                    f"steps per block of {batch} x {self.seqlen} tokens (the table: 96 steps of 2 x 256), "
                    f"{self.eval_tokens} evaluation tokens, for the CPU time a core shared by ~10 jobs allows; "
                    "identical for every arm")
        return (f"none: {self.nsamples} x {self.seqlen} calibration windows (the table's 64 x 256), {steps} steps per "
                f"block of {batch} x {self.seqlen} tokens (the table: 96 steps of 2 x 256), {self.eval_tokens} "
                "evaluation tokens; identical for every arm")

    def protocol(self, context):
        probe = methods.get("masked-recon", **self.training)
        steps, batch = probe.schedule(self.nsamples)[0], probe.train_batch
        settings = {
            "calibration": f"{self.nsamples} x {self.seqlen} random windows of {CALIBRATION_TEXT}",
            "evaluation": f"perplexity on the first {self.eval_tokens} tokens of {REPORT_TEXT} in {self.eval_seqlen}-"
                          "token windows (never tuned on, disjoint from calibration)",
            "tuning": TUNING,
            "training": self.training,
            "protocol_cut": self._protocol_cut(steps, batch),
            "flat_blocks": [str(b) for b in self.flat_blocks],
            "flat": {"relative_norms": list(RELATIVE_NORMS), "pairs": self.flat_pairs,
                     "iterations": self.flat_iterations, "windows": "first 4 evaluation windows"},
        }
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        if self.vary_train_seed:
            settings["train_seed"] = "the calibration seed"
        return settings

    def start(self, settings, context):
        dense = perplexity(context["model"], context["tokens"], self.eval_seqlen, progress=False,
                           bos_token_id=context["bos"])
        return {"settings": settings, "environment": {}, "dense": dense, "rows": []}

    def arms(self, context):
        for seed in self.seeds:
            for spec in self.patterns:
                pattern = patterns.parse(spec)
                for arm in self.variants:
                    yield Arm((str(pattern), arm, seed), f"{pattern} {arm} seed {seed}", pattern)

    def row_key(self, row):
        return row["pattern"], row["arm"], row["seed"]

    def _calibration(self, context, seed):
        if seed not in context["calib"]:
            context["calib"] = {seed: data.calibration_samples(context["tokenizer"], CALIBRATION_TEXT,
                                                               nsamples=self.nsamples, seqlen=self.seqlen, seed=seed)}
        return context["calib"][seed]

    def run_arm(self, context, arm, row, checkpoint):
        _, name, seed = arm.key
        method, options = self.arm_options(name, seed)
        saves = arm_saves(context["stem"], arm)  # every finished block, for a stopped run to go on from
        resumed = os.path.isdir(saves) and bool(os.listdir(saves))
        model = copy.deepcopy(context["model"])
        report = prune(model, method, arm.spec, self._calibration(context, seed), progress=self.progress,
                       checkpoint=saves, **options)
        options = {key: value for key, value in report["options"].items() if key != "checkpoint"}
        row = {"pattern": str(arm.spec), "arm": name, "seed": seed, "options": options,
               "perplexity": perplexity(model, context["tokens"], self.eval_seqlen, progress=False,
                                        bos_token_id=context["bos"]),
               "sparsity": report["sparsity"], "time_s": report["time_s"],
               "load_avg": os.getloadavg()[0], "summary": summary(report.get("blocks"))}
        row["flatness"] = {} if self.skip_flatness else flatness(
            model, context["model"], context["flat_windows"], self.flat_blocks, self.flat_pairs, self.flat_iterations)
        row["blocks"] = report.get("blocks")
        if resumed:
            row["resumed"] = True  # time_s then counts the blocks after the last save alone
        remove_arm_saves(saves)
        return row

    def describe(self, row):
        return f"perplexity {row['perplexity']:.3f} (prune {row['time_s']:.0f} s)"

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        result["rows"].sort(key=lambda r: (":" in r["pattern"], r["pattern"], list(ARMS).index(r["arm"]), r["seed"]))
        return result

    def markdown(self, result):
        return markdown(result)
