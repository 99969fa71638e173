"""pyprune's Wanda and SparseGPT against the authors' code (locuslab/wanda ``lib/``) on SmolLM2-135M.

Both sides prune the same model with the same calibration token ids and are scored on the same
evaluation windows. The authors' code targets transformers 4.3x, so it runs in a separate
virtual environment (``python``, with transformers 4.36.x) through :mod:`pyprune.studies._wanda_driver`,
which imports their ``lib`` read-only from ``wanda_repo``; the token ids and the model are
prepared here with pyprune and handed over with torch.save / save_pretrained. Runs: Wanda 2:4,
Wanda 50% unstructured (per row), SparseGPT 2:4, and the dense model. Results: perplexities, the
fraction of identical masks and the first differing layer (with the ties there, Wanda's score
|W|·‖X‖ of Sun et al. 2023, Eq. 1).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import tempfile

import torch

from .. import ops
from ..evaluation.perplexity import perplexity
from ..files import write_json
from ..inputs import data
from ..inputs.models import _rope_theta, load_model
from ..methods import pruning
from ..methods.options import at_least_one, nonnegative, option
from ..methods.wanda import Wanda
from ..nn.dispatch import environment_record
from ..patterns import NM, Unstructured
from ..runtime.engine import block_linears, block_prefix, decoder_blocks
from .study import Arm, Study
from ._wanda_driver import AUTHORS_FILES
from .authors_code import check_checkout, record

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_wanda_driver.py")
DEFAULT_MODEL = "smollm2-135m"
#: The authors' prepare_calibration_input holds 128 calibration rows whatever nsamples is.
MAX_NSAMPLES = 128
#: (name, method, pattern) run on both sides.
RUNS = [("wanda 2:4", "wanda", NM(2, 4)),
        ("wanda 50% unstructured (per row)", "wanda", Unstructured(0.5, "row")),
        ("sparsegpt 2:4", "sparsegpt", NM(2, 4))]
#: Prints the transformers version first, then imports what the authors' lib/ needs besides.
PYTHON_PROBE = "import transformers; print(transformers.__version__, flush=True); import torch, datasets"


def named_linears(model):
    prefix = block_prefix(model)
    return {f"{prefix}.{index}.{name}": linear
            for index, block in enumerate(decoder_blocks(model))
            for name, linear in block_linears(block).items()}


def nonzero_masks(model):
    return {name: linear.weight.detach() != 0 for name, linear in named_linears(model).items()}


def save_for_transformers4(model, directory):
    """save_pretrained plus the top-level rope_theta that transformers 4.x reads (a transformers-5
    config keeps it under rope_parameters, and 4.x silently falls back to 10000 without it)."""
    model.save_pretrained(directory, safe_serialization=True)
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["rope_theta"] = _rope_theta(model.config)
    write_json(path, config)


@contextlib.contextmanager
def recorded_wanda_norms():
    """Record, per linear module, the activation norms pyprune's Wanda scores it with."""
    norms = {}
    prune_layer = Wanda.prune_layer

    def recording(self, linear, stats, pattern):
        norms[linear] = stats.float()  # the fp32 norms the score takes (stats: float64 sums)
        prune_layer(self, linear, stats, pattern)

    Wanda.prune_layer = recording
    try:
        yield norms
    finally:
        Wanda.prune_layer = prune_layer


def compare_masks(ours, theirs):
    """Identical mask entries overall and per layer, and the first layer (in model order) that differs."""
    if set(ours) != set(theirs):
        raise RuntimeError(f"the two sides pruned different layers: {sorted(set(ours) ^ set(theirs))[:4]}")
    identical = total = 0
    fractions, first = [], None
    for name, mask in ours.items():
        same = int((mask == theirs[name]).sum())
        identical += same
        total += mask.numel()
        fractions.append(same / mask.numel())
        if first is None and same < mask.numel():
            first = {"layer": name, "differing": mask.numel() - same}
    return {"identical": identical, "total": total, "fraction": identical / total,
            "layers": len(ours), "layers_differing": sum(f < 1.0 for f in fractions),
            "min_layer_fraction": min(fractions), "first_differing": first}


def tied_differences(weight, act_sqnorm, ours, theirs, pattern):
    """Where the masks differ: how many entries have a Wanda score (pyprune's) equal to another
    score of the group the selection compares them in (their row, or their N:M group), and the
    largest relative distance from a differing entry to the nearest other score of its group."""
    scores = ops.wanda_score(weight, act_sqnorm)
    group = pattern.m if isinstance(pattern, NM) else scores.shape[1]
    rows, cols = (ours != theirs).nonzero(as_tuple=True)
    tied, widest = 0, 0.0
    for row, col in zip(rows.tolist(), cols.tolist()):
        start = col - col % group
        score = scores[row, col]
        others = torch.cat([scores[row, start:col], scores[row, col + 1:start + group]])
        gap = float((others - score).abs().min()) / max(float(score), torch.finfo(torch.float32).tiny)
        tied += gap == 0.0
        widest = max(widest, gap)
    return {"differing": len(rows), "tied": tied, "largest_relative_gap": widest}


def run_authors(study, model, calib, eval_windows, workdir):
    """The authors' code on the same inputs, in the ``python`` environment; returns its results."""
    model_dir = os.path.join(workdir, "model")
    save_for_transformers4(model, model_dir)
    job, out, log = (os.path.join(workdir, name) for name in ("job.pt", "authors.pt", "authors.log"))
    torch.save({"wanda_repo": os.path.abspath(study.wanda_repo), "model_dir": model_dir,
                "rope_theta": _rope_theta(model.config), "calib": calib.clone(),
                "eval_windows": eval_windows.clone(), "seed": study.seed, "log": log,
                "runs": [{"name": name, "method": method, "sparsity": pattern.sparsity,
                          "n": pattern.n if isinstance(pattern, NM) else 0,
                          "m": pattern.m if isinstance(pattern, NM) else 0}
                         for name, method, pattern in RUNS]}, job)
    done = subprocess.run([study.python, DRIVER, job, out])
    if done.returncode != 0:
        with open(log, encoding="utf-8") as handle:
            tail = "".join(handle.readlines()[-20:])
        raise RuntimeError(f"the authors' code failed (exit status {done.returncode}); its output ended:\n{tail}")
    return torch.load(out, weights_only=True)  # floats, dicts and mask tensors the driver wrote


def percent_down(fraction):
    """A fraction as a percentage rounded down to 0.01 (so an imperfect match never shows 100%)."""
    return "100%" if fraction == 1.0 else f"{math.floor(fraction * 1e4) / 100:.2f}%"


def markdown(result):
    ours, theirs = result["environment"], result["authors_code"]["environment"]
    commit = result["authors_code"]["commit"] or "unknown commit"
    lines = [
        "# Cross-check against locuslab/wanda (`lib/prune.py`, `lib/sparsegpt.py`)", "",
        f"Written by `{result['command']}` ({ours['timestamp']}).", "",
        f"The authors' code (locuslab/wanda {commit}) ran unmodified and read-only in its own virtual "
        f"environment (torch {theirs['torch']}, transformers {theirs['transformers']}, "
        f"{theirs['attention']} attention) through `pyprune/studies/_wanda_driver.py`, fed the same "
        f"calibration token ids and model as pyprune (torch {ours['torch']}, transformers "
        f"{ours['transformers']}); {ours['device']}, {ours['cpu_threads']} threads. Nothing of their code "
        f"is in this repository.", "",
        f"- Model: {result['model']}.",
        f"- Calibration: {result['calibration']}.",
        f"- Evaluation: {result['evaluation']}.",
        "- Masks: the nonzero pattern of every pruned linear of the decoder blocks, compared entry by entry "
        "(percentages rounded down).", "",
        "| run | pyprune perplexity | authors' code perplexity | pyprune vs authors | masks identical | "
        "first differing layer |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in result["results"]:
        masks = row.get("masks")
        if masks is None:
            identical, first = "—", "—"
        else:
            identical = f"{percent_down(masks['fraction'])} ({masks['identical']:,} of {masks['total']:,})"
            first = masks["first_differing"]
            if first is None:
                first = "none"
            elif "tied" in first:
                first = (f"`{first['layer']}`: {first['differing']:,} entries, {first['tied']:,} of them "
                         f"exactly tied with another score of their group (pyprune's Wanda scores), all "
                         f"within {first['largest_relative_gap']:.1e} (relative) of one")
            else:
                first = f"`{first['layer']}`: {first['differing']:,} entries"
        lines.append(f"| {row['run']} | {row['pyprune']['perplexity']:.3f} | {row['authors']['perplexity']:.3f} "
                     f"| {100 * row['relative_difference']:+.2f}% | {identical} | {first} |")
    lines += ["", "| run | layers with any difference | lowest per-layer agreement | measured sparsity "
              "(pyprune / authors) | prune time s (pyprune / authors) |", "|---|---:|---:|---:|---:|"]
    for row in result["results"][1:]:
        masks, ours_run, theirs_run = row["masks"], row["pyprune"], row["authors"]
        lines.append(f"| {row['run']} | {masks['layers_differing']} of {masks['layers']} | "
                     f"{percent_down(masks['min_layer_fraction'])} | {ours_run['sparsity']:.4f} / "
                     f"{theirs_run['sparsity']:.4f} | {ours_run['time_s']:.1f} / {theirs_run['time_s']:.1f} |")
    lines += ["", "Ties: among equal scores the authors' unstructured Wanda (ascending stable sort, prune the "
              "first k) prunes the lower index, pyprune keeps it; their N:M paths use `torch.topk`, whose tie "
              "order is unspecified. After a first difference, later blocks see slightly different inputs, so "
              "decisions near the keep boundary drift. SparseGPT updates the kept weights, so its masks drift "
              "with any rounding difference. Prune times are wall-clock on a shared machine."]
    return "\n".join(lines) + "\n"


class CrosscheckWanda(Study):
    """pyprune's Wanda and SparseGPT against the authors' code; see the module docstring. Every
    run replaces the results (nothing to resume: the authors' side runs in one go)."""

    name = "crosscheck-wanda"
    summary = "pyprune's Wanda and SparseGPT against the authors' code (locuslab/wanda), masks and perplexities"
    results = "crosscheck-wanda"
    row_list = "results"
    resumes = False

    wanda_repo: str = option("", "a checkout of locuslab/wanda (holding lib/prune.py)")
    python: str = option("", "python of a virtualenv with torch, transformers 4.36.x and datasets (their "
                         "lib/data.py imports it), where the authors' code runs")
    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory")
    calib: str = option("emma", "calibration text (a pyprune.inputs.data source)")
    eval: str = option("pride_and_prejudice", "evaluation text (a pyprune.inputs.data source)")
    nsamples: int = option(16, f"calibration windows (at most {MAX_NSAMPLES}, as the authors' code holds)",
                           at_least_one)
    seqlen: int = option(256, "calibration and evaluation window length", at_least_one)
    eval_tokens: int = option(8192, "first N tokens of the evaluation text", at_least_one)
    seed: int = option(0, "calibration sampling seed", nonnegative)

    def check_options(self) -> None:
        """Everything checkable before any heavy work: the checkout, the other python, the counts."""
        where = "of study 'crosscheck-wanda'"
        check_checkout(self.wanda_repo, AUTHORS_FILES, "locuslab/wanda", "wanda_repo", self.name)
        if not self.python:
            raise ValueError(f"option python {where} is required: the python of a virtualenv with "
                             "transformers 4.36.x")
        try:
            probe = subprocess.run([self.python, "-c", PYTHON_PROBE], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise ValueError(f"option python {where}: {self.python!r} cannot be run: {error}") from None
        version = probe.stdout.strip()
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        if not version:
            raise ValueError(f"option python {where}: {self.python!r} cannot import transformers: {reason}")
        if not version.startswith("4.36."):
            raise ValueError(f"option python {where}: {self.python!r} has transformers {version}; the authors' "
                             "code needs 4.36.x")
        if probe.returncode != 0:
            raise ValueError(f"option python {where}: {self.python!r} cannot import torch or datasets (their "
                             f"lib/data.py imports datasets): {reason}")
        if self.nsamples > MAX_NSAMPLES:
            raise ValueError(f"option nsamples {where} must be in 1..{MAX_NSAMPLES} (the authors' code holds "
                             f"{MAX_NSAMPLES} calibration rows); got {self.nsamples}")
        for name in ("calib", "eval"):
            try:
                data.check_source(getattr(self, name))
            except (FileNotFoundError, ValueError, TypeError) as error:
                raise ValueError(f"option {name} {where}: {error}") from None

    def prepare(self, path):
        dense, tokenizer = load_model(self.model)
        calib = data.calibration_samples(tokenizer, self.calib, nsamples=self.nsamples, seqlen=self.seqlen,
                                         seed=self.seed)
        windows = data.windows(data.eval_tokens(tokenizer, self.eval, max_tokens=self.eval_tokens), self.seqlen)
        if windows.shape[0] == 0:
            raise ValueError(f"option eval_tokens of study 'crosscheck-wanda': {self.eval_tokens} is less than one "
                             f"window of seqlen {self.seqlen}")
        with tempfile.TemporaryDirectory(prefix="crosscheck-wanda-") as workdir:
            authors = run_authors(self, dense, calib, windows, workdir)
        return {"dense": dense, "calib": calib, "stream": windows.reshape(-1), "authors": authors}

    def protocol(self, context):
        return {"model": self.model, "calib": self.calib, "eval": self.eval, "nsamples": self.nsamples,
                "seqlen": self.seqlen, "eval_tokens": self.eval_tokens, "seed": self.seed}

    def start(self, settings, context):
        import transformers
        authors = context["authors"]
        return {
            "command": self.command(),
            "model": f"{self.model} (pyprune.inputs.models.load_model)",
            "calibration": f"pyprune.inputs.data.calibration_samples({self.calib!r}, nsamples={self.nsamples}, "
                           f"seqlen={self.seqlen}, seed={self.seed})",
            "evaluation": f"first {context['stream'].numel()} tokens of {self.eval!r} in {self.seqlen}-token "
                          f"windows, exp(mean next-token NLL)",
            "authors_code": {**record(self.wanda_repo, AUTHORS_FILES, "locuslab/wanda"),
                             "environment": authors["environment"]},
            "environment": {"transformers": transformers.__version__},
            "results": [],
        }

    def arms(self, context):
        yield Arm("dense", "dense")
        for name, method, pattern in RUNS:
            yield Arm(name, name, (method, pattern))

    def row_key(self, row):
        return row["run"]

    def run_arm(self, context, arm, row, checkpoint):
        dense, stream, authors = context["dense"], context["stream"], context["authors"]
        if arm.spec is None:
            return {"run": "dense", "pyprune": {"perplexity": perplexity(dense, stream, self.seqlen, progress=False)},
                    "authors": {"perplexity": authors["dense_perplexity"]}}
        method, pattern = arm.spec
        model = copy.deepcopy(dense)
        with recorded_wanda_norms() as norms:
            report = pruning.prune(model, method, pattern, context["calib"], progress=False)
        ppl = perplexity(model, stream, self.seqlen, progress=False)
        ours, theirs = nonzero_masks(model), authors["runs"][arm.key]["masks"]
        masks = compare_masks(ours, theirs)
        first = masks["first_differing"]
        if first and method == "wanda":
            layer = first["layer"]
            first.update(tied_differences(named_linears(dense)[layer].weight.detach(),
                                          norms[named_linears(model)[layer]], ours[layer], theirs[layer], pattern))
        return {"run": arm.key, "masks": masks,
                "pyprune": {"perplexity": ppl, "time_s": report["time_s"],
                            "sparsity": 1.0 - sum(int(m.sum()) for m in ours.values()) / masks["total"]},
                "authors": {"perplexity": authors["runs"][arm.key]["perplexity"],
                            "time_s": round(authors["runs"][arm.key]["time_s"], 3),
                            "sparsity": 1.0 - sum(int(m.sum()) for m in theirs.values()) / masks["total"]}}

    def describe(self, row):
        masks = row.get("masks")
        return f"perplexity {row['pyprune']['perplexity']:.3f}" + (
            f", masks identical {masks['fraction']:.6f}" if masks else "")

    def complete(self, result, context):
        for row in result["results"]:
            row["relative_difference"] = row["pyprune"]["perplexity"] / row["authors"]["perplexity"] - 1.0
        transformers_version = result["environment"].get("transformers")
        result["environment"] = {**environment_record(torch.device("cpu")), "transformers": transformers_version}
        return result

    def markdown(self, result):
        return markdown(result)
