"""SAFE / SAFE⁺ settings sweep on single blocks: does the ADMM converge, and what does it buy on
held-out text?

Study ``safe-sweep``. Each chosen block is pruned alone on the dense model's inputs to it (the
first n of ``nsamples`` random 256-token windows of the first half of Emma), once per setting of
:data:`GRID` (λ, K, loss scale, norm gains, calibration size), with
:meth:`pyprune.methods.safe.Safe.prune_block`, the method's own per-block step. Recorded per run:
‖x − z‖/‖x‖ at the initial projection and at every dual update, the first and last calibration
loss, and the block's relative output error ‖B(X) − Y‖² / ‖Y‖² against the dense block on the
calibration inputs and on validation inputs (the first ``heldout_tokens`` tokens of the second
half of Emma in ``seqlen``-token windows: disjoint from the calibration windows, and a text no reported
table uses, so choosing settings on it does not tune on a test set). A reference per block and
calibration size is the one-shot projection of the dense weights by the same metric (for SAFE⁺:
Wanda's |W|·‖X_j‖; for SAFE: magnitude), i.e. the run's z₀; it is an arm of its own, stored in the
result's ``one_shot``. A run whose stored options differ from its setting's now (a changed
default) runs again.

The committed ``safe-sweep-smollm2-135m`` results are of the sweep's earlier protocol (whole Emma,
validation on Pride and Prejudice's first 4096 tokens, the text the SAFE defaults were then chosen
on): this study renders them but does not resume them (their settings differ); a run of this
protocol goes to another ``output``.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Optional, Tuple

import torch

from .. import methods, ops, patterns
from ..inputs import data
from ..inputs.models import load_model
from ..methods.options import at_least_one, nonnegative, option
from ..nn.dispatch import environment_record
from ..runtime import engine
from .safe import DEFAULT_MODEL
from .study import Arm, Study, model_label

#: the sweep calibrates on the first half of Emma and chooses on the first tokens of its second
#: half, a text no reported table uses (the tables calibrate on Emma's first half or whole Emma and
#: report on Pride and Prejudice); its runs before this split chose the defaults on the first 4096
#: tokens of Pride and Prejudice, the text safe-smollm2-135m.md reports on
CALIBRATION_TEXT, VALIDATION_TEXT = "emma:first_half", "emma:second_half"

#: (name, calibration samples, SAFE options), the most telling first; every run is 80 steps per block
#: (96 at 64 samples: 3 epochs); lr 5e-3 peak, so "decoupled" λ = 100 closes half the distance to
#: z − u per step at the peak
GRID = (
    ("dec-lam100-K8", 16, dict(penalty="decoupled", lam=100.0, dual_interval=8)),
    ("dec-lam200-K8", 16, dict(penalty="decoupled", lam=200.0, dual_interval=8)),
    ("dec-lam25-K8", 16, dict(penalty="decoupled", lam=25.0, dual_interval=8)),
    ("adam-lam0.1-K8", 16, dict(penalty="adam", lam=0.1, dual_interval=8)),
    ("adam-lam1-K8", 16, dict(penalty="adam", lam=1.0, dual_interval=8)),
    ("dec-lam100-K4", 16, dict(penalty="decoupled", lam=100.0, dual_interval=4)),
    ("dec-lam100-K16", 16, dict(penalty="decoupled", lam=100.0, dual_interval=16)),
    ("dec-lam100-K8-norms", 16, dict(penalty="decoupled", lam=100.0, dual_interval=8, train_norms=True)),
    ("dec-lam100-K8-n64", 64, dict(penalty="decoupled", lam=100.0, dual_interval=8, epochs=3)),
    ("paper-adam-mse-lam1e-3-K16", 16, dict(penalty="adam", loss="mse", lam=1e-3, dual_interval=16)),
    ("adam-lam0.01-K8", 16, dict(penalty="adam", lam=1e-2, dual_interval=8)),
    ("dec-lam50-K8", 16, dict(penalty="decoupled", lam=50.0, dual_interval=8)),
    ("dec-lam100-K8-n32", 32, dict(penalty="decoupled", lam=100.0, dual_interval=8, epochs=5)),
)
SETTINGS = tuple(name for name, _, _ in GRID)


def relative_error(block, dense_block, inputs, kwargs, batch_size=4):
    """‖B(X) − Y‖² / ‖Y‖² with Y the dense block's outputs."""
    error, total = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, inputs.shape[0], batch_size):
            x = inputs[start:start + batch_size]
            wanted = engine.first_tensor(dense_block(x, **kwargs)).float()
            got = engine.first_tensor(block(x, **kwargs)).float()
            error += float((got - wanted).square().sum())
            total += float(wanted.square().sum())
    return error / total


def one_shot(method, dense_block, pattern, inputs, kwargs):
    """The dense block projected once by the z-step's metric (the run's z₀)."""
    block = copy.deepcopy(dense_block)
    ctx = engine.BlockContext(0, "block", block, inputs, kwargs, 4)
    linears = ctx.linears()
    sqnorms = {name: torch.zeros(linear.in_features) for name, linear in linears.items()}
    if method.weighted_projection:
        ctx.capture(lambda name, linear, x, y: ops.accumulate_sqnorm_(sqnorms[name], x))
    with torch.no_grad():
        for name, linear in linears.items():
            act = sqnorms[name] if method.weighted_projection else None
            linear.weight.mul_(pattern.weight_mask(linear.weight, act).to(linear.weight.dtype))
    return block


def _largest_rise(residuals) -> float:
    """The largest increase of ‖x − z‖/‖x‖ from one dual update to the next (0: it never rises)."""
    return max([0.0] + [b - a for a, b in zip(residuals, residuals[1:])])


def markdown(result) -> str:
    s = result["settings"]
    lines = [f"# SAFE sweep on single {model_label(s)} blocks", "",
             f"{s['method']} at {s['pattern']}, blocks {s['blocks']} each alone on the dense model's inputs; "
             f"calibration {s['calibration']}; held-out {s['heldout']}. Relative error = ‖B(X) − Y‖²/‖Y‖² "
             "of the block against the dense block; \"÷ one-shot\" divides it by the one-shot projection's "
             "(the run's z₀: Wanda's mask for SAFE⁺). Residual ‖x − z‖/‖x‖ at z₀ = proj(x₀), then at every "
             "dual update.", "",
             "## Per setting (over the blocks run)", "",
             "| setting | blocks | held-out error ÷ one-shot (mean) | calib. error ÷ one-shot (mean) | "
             "last residual (max) | largest rise between updates (max) |",
             "|---|---|---:|---:|---:|---|"]
    settings = []
    for row in result["rows"]:
        if row["setting"] not in settings:
            settings.append(row["setting"])
    for name in settings:
        rows = [r for r in result["rows"] if r["setting"] == name]
        shots = [result["one_shot"][f"{r['block']}-{r['nsamples']}"] for r in rows]
        held = sum(r["heldout_error"] / o["heldout_error"] for r, o in zip(rows, shots)) / len(rows)
        calib = sum(r["calib_error"] / o["calib_error"] for r, o in zip(rows, shots)) / len(rows)
        lines.append(f"| {name} | {', '.join(str(r['block']) for r in rows)} | {held:.3f} | {calib:.3f} | "
                     f"{max(r['residuals'][-1] for r in rows):.4f} | {max(_largest_rise(r['residuals']) for r in rows):.4f} |")
    lines += ["", "## Every run", "",
              "| setting | block | calib. samples | held-out rel. error | ÷ one-shot | calib. rel. error | ÷ one-shot "
              "| ‖x−z‖/‖x‖: z₀ → each dual update | largest rise | time (s) | load avg |",
              "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for row in result["rows"]:
        r = row["residuals"]
        shot = result["one_shot"][f"{row['block']}-{row['nsamples']}"]
        lines.append(f"| {row['setting']} | {row['block']} | {row['nsamples']} | {row['heldout_error']:.3g} | "
                     f"{row['heldout_error'] / shot['heldout_error']:.3f} | {row['calib_error']:.3g} | "
                     f"{row['calib_error'] / shot['calib_error']:.3f} | {' → '.join(f'{x:.3f}' for x in r)} | "
                     f"{_largest_rise(r):.4f} | {row['time_s']:.0f} | {row['load_avg']:.1f} |")
    return "\n".join(lines) + "\n"


class SafeSweep(Study):
    """The SAFE / SAFE⁺ settings sweep on single blocks (see the module docstring). Arms: per
    setting of the grid (in its order, so a cut-short sweep has whole settings) and block, the run,
    preceded by the block's one-shot reference at that calibration size when it is not there yet."""

    name = "safe-sweep"
    summary = "SAFE / SAFE⁺ settings (λ, K, penalty, calibration size) on single blocks against the one-shot mask"
    results = "safe-sweep-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    method: str = option("safe+", "the method swept", choices=("safe", "safe+"))
    pattern: str = option("2:4", "the pattern: an unstructured sparsity or N:M")
    blocks: Tuple[int, ...] = option((1, 15, 29), "the blocks, each pruned alone", nonnegative)
    only: Optional[Tuple[str, ...]] = option(None, "run only these settings of the grid (default: all, in the grid's "
                                             "order): " + "; ".join(f"{name} = {n} windows, {options}"
                                                                    for name, n, options in GRID), choices=SETTINGS)
    nsamples: int = option(64, "calibration windows drawn (a setting uses the first n)", at_least_one)
    seqlen: int = option(256, "calibration and validation window length", at_least_one)
    heldout_tokens: int = option(4096, "validation tokens (of emma's second half)", at_least_one)

    def grid(self):
        """The grid's entries this run runs, in the grid's order."""
        return [entry for entry in GRID if self.only is None or entry[0] in self.only]

    @property
    def resolved(self):
        """The pattern as the method prunes it (its default scope filled in)."""
        return methods.get(self.method).resolve(patterns.parse(self.pattern))

    def check_options(self) -> None:
        try:
            self.resolved
        except ValueError as error:
            raise ValueError(f"option pattern of study 'safe-sweep': {error}") from None
        for name, nsamples, options in self.grid():
            methods.get(self.method, **options)
            if nsamples > self.nsamples:
                raise ValueError(f"option nsamples of study 'safe-sweep' must be at least {nsamples} (setting "
                                 f"{name} uses the first {nsamples} windows); got {self.nsamples}")

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        model.eval()
        layers = engine.decoder_blocks(model)
        if max(self.blocks) >= len(layers):
            raise ValueError(f"option blocks of study 'safe-sweep': the model has blocks 0..{len(layers) - 1}; "
                             f"got {max(self.blocks)}")
        calib = data.calibration_samples(tokenizer, CALIBRATION_TEXT, nsamples=self.nsamples, seqlen=self.seqlen,
                                         seed=0)
        stream = data.eval_tokens(tokenizer, VALIDATION_TEXT, max_tokens=self.heldout_tokens)
        heldout = stream[:stream.numel() // self.seqlen * self.seqlen].reshape(-1, self.seqlen)
        calib_inputs, kwargs = engine.capture_block_inputs(model, calib, 4)  # kwargs: each block's arguments
        held_inputs, held_kwargs = engine.capture_block_inputs(model, heldout, 4)
        dense = {}  # block index -> (dense block, its calibration inputs and arguments, its held-out ones)
        for index, block in enumerate(layers[:max(self.blocks) + 1]):
            if index in self.blocks:
                dense[index] = (block, calib_inputs, kwargs[index], held_inputs, held_kwargs[index])
            with torch.no_grad():
                calib_inputs = torch.cat([engine.first_tensor(block(calib_inputs[s:s + 4], **kwargs[index]))
                                          for s in range(0, calib_inputs.shape[0], 4)])
                held_inputs = torch.cat([engine.first_tensor(block(held_inputs[s:s + 4], **held_kwargs[index]))
                                         for s in range(0, held_inputs.shape[0], 4)])
        return {"dense": dense, "heldout_windows": heldout.shape[0]}

    def protocol(self, context):
        settings = {"method": self.method, "pattern": str(self.resolved), "blocks": list(self.blocks),
                    "calibration": f"the first n of {self.nsamples} x {self.seqlen} windows of {CALIBRATION_TEXT} "
                                   "(seed 0)",
                    "heldout": f"{context['heldout_windows']} x {self.seqlen} tokens of {VALIDATION_TEXT} "
                               "(validation: no reported table uses it)"}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def start(self, settings, context):
        return {"settings": settings, "environment": {}, "rows": [], "one_shot": {}}

    def arms(self, context):
        references = set()
        for name, nsamples, options in self.grid():
            method = methods.get(self.method, **options)
            for index in self.blocks:
                if (index, nsamples) not in references:
                    references.add((index, nsamples))
                    yield Arm(("one-shot", f"{index}-{nsamples}"), f"block {index} one-shot at {nsamples} windows",
                              (method, index, nsamples))
                yield Arm((name, index), f"block {index} {name}", (method, index, nsamples))

    def row_key(self, row):
        return row["setting"], row["block"]

    def done(self, result, arm):
        if arm.key[0] == "one-shot":
            return arm.key[1] in result["one_shot"]
        row = self.find(result, arm.key)
        return row is not None and row["options"] == arm.spec[0].settings

    def record(self, result, arm, row):
        if arm.key[0] == "one-shot":
            result["one_shot"][arm.key[1]] = row
        else:
            super().record(result, arm, row)

    def merge(self, result, on_disk):
        """A concurrent run's rows and its one-shot references."""
        super().merge(result, on_disk)
        for key, reference in on_disk.get("one_shot", {}).items():
            result["one_shot"].setdefault(key, reference)

    def run_arm(self, context, arm, row, checkpoint):
        method, index, nsamples = arm.spec
        dense_block, all_inputs, kwargs, held, held_kwargs = context["dense"][index]
        inputs = all_inputs[:nsamples]
        if arm.key[0] == "one-shot":
            reference = one_shot(method, dense_block, self.resolved, inputs, kwargs)
            return {"heldout_error": relative_error(reference, dense_block, held, held_kwargs),
                    "calib_error": relative_error(reference, dense_block, inputs, kwargs)}
        block = copy.deepcopy(dense_block)
        ctx = engine.BlockContext(index, f"block.{index}", block, inputs, kwargs, 4)
        steps, warmup = method.schedule(nsamples)
        start = time.perf_counter()
        details = method.prune_block(ctx, self.resolved, steps=steps, warmup=warmup, progress=False)
        elapsed = time.perf_counter() - start
        return {"setting": arm.key[0], "block": index, "nsamples": nsamples, "options": method.settings,
                "steps": steps, "residuals": details["residuals"], "loss_first": details["loss_first"],
                "loss_last": details["loss_last"],
                "heldout_error": relative_error(block, dense_block, held, held_kwargs),
                "calib_error": relative_error(block, dense_block, inputs, kwargs),
                "time_s": elapsed, "load_avg": os.getloadavg()[0]}

    def describe(self, row):
        if "setting" not in row:  # a one-shot reference
            return f"held-out {row['heldout_error']:.4f}"
        return (f"held-out {row['heldout_error']:.4f}, residuals {' '.join(f'{x:.3f}' for x in row['residuals'])} "
                f"({row['time_s']:.0f} s)")

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)
