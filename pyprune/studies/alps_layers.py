"""ALPS against SparseGPT on the layer objective, on real SmolLM2-135M layers (ALPS's
reconstruction-error comparison, Meng et al. 2024, small).

For each chosen linear layer of decoder block ``block`` of the dense model: H from its inputs on
the calibration of the SAFE table (64 x 256 random windows of Emma, seed 0), then the relative
layer error E(Ŵ)/E(0) = tr((Ŵ−W)H(Ŵ−W)ᵀ)/tr(WHWᵀ) (with the solver's 1% ridge, H normalised as
ALPS normalises it, :func:`pyprune.runtime.layer_solver.normalise`) of: magnitude on the normalised
weights (ALPS's starting support, |W_ij|·‖X_j‖), SparseGPT, ALPS's projected ADMM iterate, and ALPS
after the PCG refit; per tensor at unstructured patterns for both methods (their defaults). Every
method sees the same dense inputs. Resumable: one row per layer and pattern.
"""
from __future__ import annotations

import copy
import time
from typing import Tuple

import torch

from ..inputs import data
from ..inputs.models import load_model
from ..methods.options import nonnegative, option
from ..methods.sparsegpt import SparseGPT, _Hessian
from ..nn.dispatch import environment_record
from ..patterns import Unstructured, parse
from ..runtime import engine
from ..runtime.layer_solver import admm_support, normalise, pcg_on_support, reconstruction_error
from .study import Arm, Study, model_label

DEFAULT_MODEL = "smollm2-135m"
NSAMPLES, SEQLEN, BATCH = 64, 256, 8
PERCDAMP = 0.01


def layer_pattern(spec: str):
    """The pattern of ``spec`` as both methods run it here: N:M, or unstructured per tensor."""
    pattern = parse(spec)
    return Unstructured(pattern.sparsity, "tensor") if isinstance(pattern, Unstructured) else pattern


def check_block_layers(study, model) -> None:
    """``study.block`` is a decoder block of ``model`` and ``study.layers`` are linears of it (the
    options of the studies that measure one block's layers)."""
    blocks = engine.decoder_blocks(model)
    if study.block >= len(blocks):
        raise ValueError(f"option block of study {study.name!r} must be below the model's {len(blocks)} decoder "
                         f"blocks; got {study.block}")
    known = engine.block_linears(blocks[study.block])
    unknown = [name for name in study.layers if name not in known]
    if unknown:
        raise ValueError(f"option layers of study {study.name!r}: {', '.join(unknown)} is not a linear of block "
                         f"{study.block}; allowed: {', '.join(known)}")


def hessians(model, calib, block, names):
    """SparseGPT's H of each named linear of decoder block ``block``, on the dense model."""
    linears = engine.block_linears(engine.decoder_blocks(model)[block])
    stats = {name: _Hessian(linears[name].in_features, "cpu") for name in names}
    handles = [linears[name].register_forward_hook(lambda module, args, out, name=name: stats[name].add(args[0]))
               for name in names]
    try:
        with torch.no_grad():
            for start in range(0, calib.shape[0], BATCH):
                model(calib[start:start + BATCH])
    finally:
        for handle in handles:
            handle.remove()
    return {name: linears[name] for name in names}, stats


def markdown(result) -> str:
    s, env = result["settings"], result["environment"]
    lines = [f"# ALPS and SparseGPT on the layer objective, {model_label(s)}", "",
             f"Block {s['block']} of the dense model; calibration {s['calibration']}; relative layer error "
             "E(Ŵ)/E(0) with a 1% ridge (lower is better); per tensor at unstructured patterns; "
             f"{env['device']}, {env['cpu_threads']} threads, torch {env['torch']}.", "",
             "| layer | pattern | magnitude ·‖X_j‖ | SparseGPT | ALPS ADMM (projected) | ALPS + PCG | ALPS / SparseGPT "
             "| ADMM iterations | ALPS time (s) | SparseGPT time (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['layer']} | {r['pattern']} | {r['magnitude']:.5f} | {r['sparsegpt']:.5f} | "
                     f"{r['alps_admm']:.5f} | {r['alps']:.5f} | {r['alps'] / r['sparsegpt']:.3f} | "
                     f"{r['iterations']} | {r['alps_s']:.1f} | {r['sparsegpt_s']:.1f} |")
    return "\n".join(lines) + "\n"


class AlpsLayers(Study):
    """ALPS against SparseGPT on the layer objective of one block's linears; see the module
    docstring. One arm per layer and pattern (layers the outer loop)."""

    name = "alps-layers"
    summary = "ALPS against SparseGPT (and magnitude) on the layer objective E(Ŵ)/E(0) of one block's linears"
    results = "alps-layers-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    patterns: Tuple[str, ...] = option(("0.5", "0.7", "2:4", "4:8"), "patterns: an unstructured sparsity (per "
                                       "tensor) or N:M")
    layers: Tuple[str, ...] = option(("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj"), "linears of the block "
                                     "(one arm per layer and pattern)")
    block: int = option(15, "the decoder block whose linears are measured (on the dense model's inputs)",
                        nonnegative)

    def check_options(self) -> None:
        for spec in self.patterns:
            try:
                layer_pattern(spec)
            except ValueError as error:
                raise ValueError(f"option patterns of study {self.name!r}: {error}") from None

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        check_block_layers(self, model)
        calib = data.calibration_samples(tokenizer, "emma", nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
        linears, stats = hessians(model, calib, self.block, self.layers)
        return {"linears": linears, "stats": stats}

    def protocol(self, context):
        settings = {"calibration": f"{NSAMPLES} x {SEQLEN} tokens of emma (seed 0)", "block": self.block}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def arms(self, context):
        for name in self.layers:
            for spec in self.patterns:
                pattern = layer_pattern(spec)
                yield Arm((name, str(pattern)), f"{name} {pattern}", (name, pattern))

    def row_key(self, row):
        return row["layer"], row["pattern"]

    def run_arm(self, context, arm, row, checkpoint):
        name, pattern = arm.spec
        stats = context["stats"][name]
        W = context["linears"][name].weight.detach().float()
        H, Wn, scale = normalise(stats.H, W, PERCDAMP)
        start = time.perf_counter()
        projected, keep, trace = admm_support(H, Wn, pattern)
        refit = pcg_on_support(H, Wn, projected, keep)
        alps_s = time.perf_counter() - start
        layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        layer.weight.data.copy_(W)
        start = time.perf_counter()
        SparseGPT(percdamp=PERCDAMP).prune_layer(layer, copy.deepcopy(stats), pattern)  # it damps H in place
        sparsegpt_s = time.perf_counter() - start
        return {"layer": name, "pattern": str(pattern),
                "magnitude": reconstruction_error(H, Wn, Wn * pattern.weight_mask(Wn)),
                "sparsegpt": reconstruction_error(H, Wn, layer.weight.detach() * scale),
                "alps_admm": reconstruction_error(H, Wn, projected),
                "alps": reconstruction_error(H, Wn, refit), "iterations": trace.iterations,
                "alps_s": alps_s, "sparsegpt_s": sparsegpt_s}

    def describe(self, row):
        return (f"magnitude {row['magnitude']:.5f}, SparseGPT {row['sparsegpt']:.5f}, ALPS {row['alps_admm']:.5f} "
                f"→ {row['alps']:.5f} after PCG ({row['iterations']} iterations)")

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)
