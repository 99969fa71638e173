"""pyprune's ALPS against the authors' code (mazumder-lab/ALPS ``alps.py``) on real SmolLM2-135M layers.

Both sides prune copies of the same linear layer from the same calibration inputs (block ``block``
of the dense model on 16 x 256 random windows of Emma, seed 0): the authors' ``ALPS_prune``
(imported read-only from ``alps_repo``; it hard-codes ``cuda:0``, so its device moves are mapped to
the CPU while it runs, :func:`cpu_for_cuda`) with ``ALPS_admm(rho=0.1)`` as their ``llama.py``
calls it, and :class:`pyprune.methods.alps.Alps`. Reported per layer and pattern (70% per tensor,
2:4): the relative layer error E(Ŵ)/E(0) of each (with the 1% ridge, normalised as both
normalise), the fraction of weights on which the two masks agree, each side's sparsity; each
side's time is in the .json only (the CPU is shared, so it is no speed comparison). The checkout
is recorded by its commit and the sha256 of ``alps.py`` (:mod:`pyprune.studies.authors_code`).
"""
from __future__ import annotations

import copy
import importlib.util
import os
import time
from typing import Tuple

import torch

from ..inputs import data
from ..inputs.models import load_model
from ..methods.alps import Alps
from ..methods.options import nonnegative, option
from ..methods.sparsegpt import _Hessian
from ..nn.dispatch import environment_record
from ..patterns import NM, Unstructured
from ..runtime import engine
from ..runtime.layer_solver import normalise, reconstruction_error
from .alps_layers import check_block_layers
from .authors_code import check_checkout, cpu_for_cuda, record
from .study import Arm, Study, model_label

DEFAULT_MODEL = "smollm2-135m"
AUTHORS_FILES = ("alps.py",)
PATTERNS = (Unstructured(0.7, "tensor"), NM(2, 4))
NSAMPLES, SEQLEN, BATCH = 16, 256, 8
PERCDAMP = 0.01



def one_block_protocol(study) -> dict:
    """The settings of a cross-check on one block's layers of ``study.model`` (recorded when not the
    default), calibrated on NSAMPLES x SEQLEN tokens of emma."""
    settings = {"calibration": f"{NSAMPLES} x {SEQLEN} tokens of emma (seed 0)", "block": study.block}
    if study.model != DEFAULT_MODEL:
        settings["model"] = study.model
    return settings

class _Stop(Exception):
    pass


def authors_module(repo):
    """The authors' ``alps.py`` of checkout ``repo``, imported read-only under the name ``authors_alps``."""
    spec = importlib.util.spec_from_file_location("authors_alps", os.path.join(repo, "alps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.dev = "cpu"
    return module


def layer_inputs(model, calib, block, names):
    """Every calibration input of the named linears of decoder block ``block`` (the forward stops there)."""
    blocks = engine.decoder_blocks(model)
    linears = engine.block_linears(blocks[block])
    inputs = {name: [] for name in names}
    handles = [linears[name].register_forward_hook(lambda m, args, out, name=name: inputs[name].append(args[0]))
               for name in names]

    def stop(module, args, out):
        raise _Stop

    handles.append(blocks[block].register_forward_hook(stop))
    try:
        with torch.no_grad():
            for start in range(0, calib.shape[0], BATCH):
                try:
                    model(calib[start:start + BATCH])
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: linears[name] for name in names}, inputs


def markdown(result) -> str:
    block, rows = result["settings"]["block"], result["rows"]
    lines = ["# ALPS: pyprune against the authors' code (mazumder-lab/ALPS), "
             f"{model_label(result['settings'])} layers", "",
             f"Block {block} of the dense model, 16 x 256 Emma tokens; relative layer error E(Ŵ)/E(0) with the "
             "1% ridge (lower is better); per tensor at 70%.", "",
             "| layer | pattern | error, authors | error, pyprune | masks agree | sparsity authors / pyprune |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['layer']} | {r['pattern']} | {r['error_authors']:.5f} | {r['error_pyprune']:.5f} | "
              f"{r['mask_agreement']:.4f} | {r['sparsity_authors']:.4f} / {r['sparsity_pyprune']:.4f} |" for r in rows]
    return "\n".join(lines) + "\n"


class CrosscheckAlps(Study):
    """pyprune's ALPS against the authors' ``alps.py``; see the module docstring. Every run
    replaces the results (nothing to resume: a one-shot check)."""

    name = "crosscheck-alps"
    summary = "pyprune's ALPS against the authors' code (mazumder-lab/ALPS) on one block's layers: errors and masks"
    results = "crosscheck-alps"
    resumes = False

    alps_repo: str = option("", "a checkout of mazumder-lab/ALPS (holding alps.py), imported read-only")
    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    block: int = option(15, "the decoder block whose layers both sides prune (from the dense model's inputs)",
                        nonnegative)
    layers: Tuple[str, ...] = option(("self_attn.q_proj", "mlp.up_proj"), "linears of the block (one arm per "
                                     "layer and pattern)")

    def check_options(self) -> None:
        check_checkout(self.alps_repo, AUTHORS_FILES, "mazumder-lab/ALPS", "alps_repo", self.name)

    def prepare(self, path):
        authors = authors_module(self.alps_repo)
        model, tokenizer = load_model(self.model)
        check_block_layers(self, model)
        calib = data.calibration_samples(tokenizer, "emma", nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
        linears, inputs = layer_inputs(model, calib, self.block, self.layers)
        stats = {}
        for name in self.layers:
            stats[name] = _Hessian(linears[name].in_features, "cpu")
            for x in inputs[name]:
                stats[name].add(x)
        return {"authors": authors, "linears": linears, "inputs": inputs, "stats": stats}

    def protocol(self, context):
        return one_block_protocol(self)

    def start(self, settings, context):
        return {"command": self.command(), "settings": settings,
                "authors_code": record(self.alps_repo, AUTHORS_FILES, "mazumder-lab/ALPS"), "rows": []}

    def arms(self, context):
        for name in self.layers:
            for pattern in PATTERNS:
                yield Arm((name, str(pattern)), f"{name} {pattern}", (name, pattern))

    def row_key(self, row):
        return row["layer"], row["pattern"]

    def run_arm(self, context, arm, row, checkpoint):
        name, pattern = arm.spec
        dense, inputs, stats = context["linears"][name], context["inputs"][name], context["stats"][name]
        H, Wn, scale = normalise(stats.H, dense.weight.detach(), PERCDAMP)
        theirs = copy.deepcopy(dense)
        start = time.perf_counter()
        with cpu_for_cuda(), torch.no_grad():
            solver = context["authors"].ALPS_prune(theirs, nsamples=NSAMPLES, seqlen=SEQLEN)
            for x in inputs:
                solver.add_batch(x, theirs(x))
            nm = (pattern.n, pattern.m) if isinstance(pattern, NM) else (0, 0)
            solver.ALPS_admm(sp=pattern.sparsity, nm_n=nm[0], nm_m=nm[1], rho=0.1)
        theirs_s = time.perf_counter() - start
        ours = copy.deepcopy(dense)
        start = time.perf_counter()
        Alps().prune_layer(ours, copy.deepcopy(stats), pattern)
        ours_s = time.perf_counter() - start
        w_theirs, w_ours = theirs.weight.detach(), ours.weight.detach()
        return {"layer": name, "pattern": str(pattern),
                "error_authors": reconstruction_error(H, Wn, w_theirs * scale),
                "error_pyprune": reconstruction_error(H, Wn, w_ours * scale),
                "mask_agreement": float(((w_theirs != 0) == (w_ours != 0)).float().mean()),
                "sparsity_authors": float((w_theirs == 0).float().mean()),
                "sparsity_pyprune": float((w_ours == 0).float().mean()),
                "authors_s": theirs_s, "pyprune_s": ours_s}

    def describe(self, row):
        return (f"error {row['error_authors']:.5f} (authors) / {row['error_pyprune']:.5f} (pyprune), masks agree "
                f"{row['mask_agreement']:.4f}")

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)
