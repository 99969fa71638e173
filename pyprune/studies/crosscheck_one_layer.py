"""pyprune's RIA and DSnoT against the authors' code on real SmolLM2-135M layers: studies
``crosscheck-ria`` (biomedical-cybernetics/Relative-importance-and-activation-pruning,
``lib/prune.py: prune_ria``) and ``crosscheck-dsnot`` (zyxxmu/DSnoT, ``lib/prune.py: prune_DSnoT``).

Their functions run whole block loops, so each runs, imported read-only in this process
(:func:`pyprune.studies.authors_code.import_package_module`), on a model of one block holding a copy of
one real layer under its name (:class:`pyprune.studies.authors_code.OneLayerModel`), fed that layer's
inputs in the dense model (block ``block`` on 16 x 256 random windows of Emma, seed 0; their
calibration loader is replaced by those windows, one sequence per forward as in their code; their
CUDA calls are mapped to the CPU). pyprune prunes another copy from the same inputs through the
method's layer step. Reported per layer and pattern: the fraction of weights on which the two masks
agree, each side's sparsity and a side-by-side figure of what the method optimises (RIA: the RIA score
the mask keeps, relative to the dense layer's total; DSnoT: Σ_i |ε_i| of Eq. 3, relative to the
initial Wanda mask's). The checkout is recorded by its commit and the sha256 of the files that ran.

RIA runs at the authors' defaults (per-layer comparison, a = 0.5) and with their channel
permutation (``--reallocation --lsa``, importance "sum"). DSnoT runs on Wanda (their README's
command: 50 cycles, threshold 0.1, variance power 1) with every layer refined on both sides (their
``--skip_layer no_skip``; the default refines the attention alone). Their ``--initial_method
sparsegpt`` is not compared: at the checked commit its layer wrapper never adds a batch to the
Hessian it allocates, so every input counts as dead and its initial mask is the first columns.
"""
from __future__ import annotations

import copy
import time
import types
from typing import Tuple

import torch

from ..inputs import data
from ..inputs.models import load_model
from ..methods.channel_permutation import kept_score
from ..methods.options import nonnegative, option
from ..methods.owl import add_sqnorms, new_sqnorms
from ..methods.ria import RIA, _LayerNorms, ria_score
from ..methods.wanda import Wanda
from ..nn.dispatch import environment_record
from ..patterns import NM, Unstructured
from .alps_layers import check_block_layers
from .authors_code import OneLayerModel, check_checkout, cpu_for_cuda, import_package_module, record
from .crosscheck_alps import DEFAULT_MODEL, NSAMPLES, SEQLEN, layer_inputs, one_block_protocol
from .study import Arm, Study, model_label

AUTHORS_FILES = ("lib/prune.py", "lib/layerwrapper.py")


class _OneLayerCrosscheck(Study):
    """What both cross-checks share: the checkout, the model, the block's layers and their inputs."""

    resumes = False
    project = ""
    alias = ""
    patterns: Tuple = ()
    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    block: int = option(3, "the decoder block whose layers both sides prune (from the dense model's inputs)",
                        nonnegative)

    @property
    def repo(self) -> str:
        raise NotImplementedError

    def check_options(self) -> None:
        check_checkout(self.repo, AUTHORS_FILES, self.project, f"{self.alias}_repo", self.name)

    def prepare(self, path):
        authors = import_package_module(self.repo, "lib", "prune", f"authors_{self.alias}")
        model, tokenizer = load_model(self.model)
        check_block_layers(self, model)
        calib = data.calibration_samples(tokenizer, "emma", nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
        linears, inputs = layer_inputs(model, calib, self.block, self.layers)
        return {"authors": authors, "linears": linears, "inputs": inputs}

    def protocol(self, context):
        return one_block_protocol(self)

    def start(self, settings, context):
        return {"command": self.command(), "settings": settings,
                "authors_code": record(self.repo, AUTHORS_FILES, self.project), "rows": []}

    def arms(self, context):
        for name in self.layers:
            for label, pattern, variant in self.patterns:
                yield Arm((name, label), f"{name} {label}", (name, pattern, variant))

    def row_key(self, row):
        return row["layer"], row["pattern"]

    def run_authors(self, context, name, pattern, variant):
        """A pruned copy of layer ``name`` by the authors' function, and the seconds it took."""
        theirs = copy.deepcopy(context["linears"][name])
        model = OneLayerModel(name, theirs, context["inputs"][name])
        authors = context["authors"]
        authors.get_loaders = lambda *args, **kwargs: (model.loader, None)
        nm = isinstance(pattern, NM)
        start = time.perf_counter()
        with cpu_for_cuda(), torch.no_grad():
            self.call_authors(authors, model, pattern, variant, prune_n=pattern.m - pattern.n if nm else 0,
                              prune_m=pattern.m if nm else 0)
        return theirs, time.perf_counter() - start

    def compare(self, name, label, theirs, ours, authors_s, pyprune_s):
        w_theirs, w_ours = theirs.weight.detach(), ours.weight.detach()
        return {"layer": name, "pattern": label,
                "mask_agreement": float(((w_theirs != 0) == (w_ours != 0)).float().mean()),
                "sparsity_authors": float((w_theirs == 0).float().mean()),
                "sparsity_pyprune": float((w_ours == 0).float().mean()),
                "authors_s": authors_s, "pyprune_s": pyprune_s}

    def describe(self, row):
        return f"masks agree {row['mask_agreement']:.6f}"

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        return result


def _quiet_args(**values):
    return types.SimpleNamespace(model="llama", seed=0, **values)


class CrosscheckRia(_OneLayerCrosscheck):
    """pyprune's RIA against the authors' ``prune_ria``; see the module docstring."""

    name = "crosscheck-ria"
    summary = "pyprune's RIA against the authors' code on one block's layers: masks, kept score"
    results = "crosscheck-ria"
    project = "biomedical-cybernetics/Relative-importance-and-activation-pruning"
    alias = "ria"
    patterns = (("unstructured 0.5", Unstructured(0.5, "tensor"), False), ("2:4", NM(2, 4), False),
                ("2:4 permuted", NM(2, 4), True))

    ria_repo: str = option("", "a checkout of biomedical-cybernetics/Relative-importance-and-activation-pruning "
                           "(holding lib/prune.py), imported read-only")
    layers: Tuple[str, ...] = option(("self_attn.o_proj", "mlp.up_proj"), "linears of the block (one arm per "
                                     "layer and pattern)")

    @property
    def repo(self):
        return self.ria_repo

    def call_authors(self, authors, model, pattern, permuted, prune_n, prune_m):
        args = _quiet_args(calib_dataset="c4", nsamples=len(model.loader), seqlen=model.seqlen, gptq=False,
                           reconstruction=False, prune_method="ria", a=0.5, reallocation=permuted, lsa=permuted,
                           importance_score="sum", fast=False, semi_sparse_acc=False, per_outneuron=False,
                           sparsity_ratio=pattern.sparsity)
        authors.prune_ria(args, model, None, torch.device("cpu"), prune_n=prune_n, prune_m=prune_m)

    def run_arm(self, context, arm, row, checkpoint):
        name, pattern, permuted = arm.spec
        theirs, authors_s = self.run_authors(context, name, pattern, permuted)
        dense = context["linears"][name]
        stats = _LayerNorms(name, new_sqnorms(dense))
        for x in context["inputs"][name]:
            add_sqnorms(stats.sqnorm, x)
        ours, method = copy.deepcopy(dense), RIA(channel_permutation=permuted)
        start = time.perf_counter()
        method.prune_layer(ours, stats, pattern)
        pyprune_s = time.perf_counter() - start
        scores = ria_score(dense.weight, stats.sqnorm, 0.5).double()
        result = self.compare(name, arm.key[1], theirs, ours, authors_s, pyprune_s)
        result["kept_score_authors"] = float(scores[theirs.weight != 0].sum() / scores.sum())
        result["kept_score_pyprune"] = float(scores[ours.weight != 0].sum() / scores.sum())
        if isinstance(pattern, NM):
            result["kept_score_unpermuted"] = kept_score(scores, pattern.n, pattern.m) / float(scores.sum())
        return result

    def markdown(self, result):
        lines = [f"# RIA: pyprune against the authors' code, {model_label(result['settings'])} layers", "",
                 f"Block {result['settings']['block']} of the dense model, {result['settings']['calibration']}; "
                 "unstructured per layer (the authors' default), a = 0.5; \"permuted\": their channel "
                 "permutation (--reallocation --lsa). Kept score: the RIA score the mask keeps, a fraction of the "
                 "layer's total.", "",
                 "| layer | pattern | masks agree | sparsity authors / pyprune | kept score authors / pyprune |",
                 "|---|---|---:|---|---|"]
        lines += [f"| {r['layer']} | {r['pattern']} | {r['mask_agreement']:.6f} | {r['sparsity_authors']:.6f} / "
                  f"{r['sparsity_pyprune']:.6f} | {r['kept_score_authors']:.6f} / {r['kept_score_pyprune']:.6f} |"
                  for r in result["rows"]]
        return "\n".join(lines) + "\n"


class CrosscheckDsnot(_OneLayerCrosscheck):
    """pyprune's DSnoT on Wanda against the authors' ``prune_DSnoT``; see the module docstring."""

    name = "crosscheck-dsnot"
    summary = "pyprune's DSnoT (on Wanda) against the authors' code on one block's layers: masks, expected error"
    results = "crosscheck-dsnot"
    project = "zyxxmu/DSnoT"
    alias = "dsnot"
    patterns = (("unstructured 0.5", Unstructured(0.5, "row"), None), ("unstructured 0.7", Unstructured(0.7, "row"),
                                                                        None), ("2:4", NM(2, 4), None))

    dsnot_repo: str = option("", "a checkout of zyxxmu/DSnoT (holding lib/prune.py), imported read-only")
    layers: Tuple[str, ...] = option(("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"),
                                     "linears of the block (one arm per layer and pattern)")

    @property
    def repo(self):
        return self.dsnot_repo

    def call_authors(self, authors, model, pattern, variant, prune_n, prune_m):
        args = _quiet_args(nsamples=len(model.loader), sparsity_ratio=pattern.sparsity, initial_method="wanda",
                           max_cycle_time=50, without_DSnoT=False, update_threshold=0.1, pow_of_var_regrowing=1.0,
                           pow_of_var_pruning=1.0, skip_layer="no_skip", skip_sub_layer="no_skip",
                           without_same_sign=True, get_time_overhead=False)
        authors.prune_DSnoT(args, model, None, torch.device("cpu"), prune_n=prune_n, prune_m=prune_m)

    def run_arm(self, context, arm, row, checkpoint):
        name, pattern, _ = arm.spec
        theirs, authors_s = self.run_authors(context, name, pattern, None)
        dense = context["linears"][name]
        method = Wanda(dsnot=True, dsnot_layers="all")
        stats = method.layer_statistics(name, dense)
        for x in context["inputs"][name]:
            method.observe(stats, x, None)
        ours, initial = copy.deepcopy(dense), copy.deepcopy(dense)
        start = time.perf_counter()
        method.prune_from(ours, stats, pattern)
        pyprune_s = time.perf_counter() - start
        Wanda().prune_layer(initial, stats.base, pattern)
        effect = dense.weight.detach().double() * stats.moments.sequence_sum

        def expected_error(linear):  # Σ_i |ε_i| (Eq. 3)
            return float((effect * (linear.weight == 0)).sum(dim=1).abs().sum())

        result = self.compare(name, arm.key[1], theirs, ours, authors_s, pyprune_s)
        result.update(error_wanda=expected_error(initial), error_authors=expected_error(theirs),
                      error_pyprune=expected_error(ours),
                      changed_authors=int(((theirs.weight != 0) != (initial.weight != 0)).sum()),
                      changed_pyprune=int(((ours.weight != 0) != (initial.weight != 0)).sum()))
        return result

    def markdown(self, result):
        lines = ["# DSnoT on Wanda: pyprune against the authors' code (zyxxmu/DSnoT), "
                 f"{model_label(result['settings'])} layers", "",
                 f"Block {result['settings']['block']} of the dense model, {result['settings']['calibration']}; "
                 "per output row; 50 cycles, threshold 0.1, variance power 1, every layer refined (their "
                 "--skip_layer no_skip). Expected error: Σ_i |ε_i| of Eq. 3 (per sequence), Wanda's initial mask "
                 "→ after DSnoT. Changed: mask entries DSnoT changed.", "",
                 "| layer | pattern | masks agree | changed authors / pyprune | expected error Wanda → authors / "
                 "pyprune | sparsity authors / pyprune |", "|---|---|---:|---|---|---|"]
        lines += [f"| {r['layer']} | {r['pattern']} | {r['mask_agreement']:.6f} | {r['changed_authors']} / "
                  f"{r['changed_pyprune']} | {r['error_wanda']:.1f} → {r['error_authors']:.1f} / "
                  f"{r['error_pyprune']:.1f} | {r['sparsity_authors']:.6f} / {r['sparsity_pyprune']:.6f} |"
                  for r in result["rows"]]
        return "\n".join(lines) + "\n"
