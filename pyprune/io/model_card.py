"""The model card (``README.md``) of every model directory pyprune writes: the file the Hugging Face hub
shows, and that ``hf upload`` / ``push_to_hub`` publish as it is.

:func:`render` writes it from the directory's ``pyprune.json`` alone (:mod:`pyprune.io.manifest`: the
format, the run's report, the base model), so the card and the manifest never disagree: YAML front
matter (``base_model``, ``library_name: pyprune``, ``license``, ``tags``, ``sparsity_pattern``,
``sparsity``, and a ``model-index`` of the perplexities and accuracies the run measured) and a short
body: what was done, what it measured, how to load it. :func:`pyprune.save` writes it with the rest of
the directory, atomically; :func:`pyprune.io.write_report` rewrites it when a report arrives after the
save (the CLI evaluates after saving).

The base model and its license are what :func:`pyprune.io.provenance.base_of` recorded in the manifest.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ..files import write_text
from .recipe_file import RECIPE

__all__ = ["CARD", "render", "write", "write_source_card"]

#: the card's file name in a model directory
CARD = "README.md"


def _pattern_tag(pattern: str) -> str:
    return f"{pattern}-sparsity" if ":" in pattern else f"{pattern.split()[0]}-sparsity"


def _eval_results(report: Dict[str, Any]):
    from huggingface_hub import EvalResult
    results = [EvalResult(task_type="text-generation", dataset_type=entry["data"], dataset_name=entry["data"],
                          metric_type="perplexity", metric_value=entry["perplexity"],
                          metric_config=f"{entry['tokens']} tokens, windows of {entry['seqlen']}")
               for entry in report.get("eval") or report.get("eval_after") or []]
    results += [EvalResult(task_type="multiple-choice", dataset_type=name, dataset_name=name, metric_type="accuracy",
                           metric_value=result["acc"], metric_config=f"{result.get('num_fewshot', 0)}-shot")
                for name, result in (report.get("tasks") or {}).items()]
    return results


def _what_was_done(report: Dict[str, Any], base: Dict[str, Any]) -> List[str]:
    origin = (f"[{base['id']}](https://huggingface.co/{base['id']})" + (f" (revision `{base['revision']}`)"
              if base.get("revision") else "")) if base.get("id") else "a local model (no hub id known)"
    lines = []
    if "recovery" in report:
        done = report["recovery"]
        lines.append(f"LoRA recovery of `{report.get('model')}` (derived from {origin}): rank {done.get('rank')}, "
                     f"{done.get('steps')} steps, merged into the weights under their mask, so its zeros stay zeros.")
        if report.get("method"):
            lines.append(f"That model was pruned with {report['method']} to {report.get('pattern')}.")
    elif report.get("method"):
        options = ", ".join(f"{k}={v}" for k, v in sorted((report.get("options") or {}).items()) if v is not None)
        if report.get("model") and report["model"] != base.get("id"):  # an alias (a dequantised GGUF), a revision
            origin += f", loaded as `{report['model']}`,"
        lines.append(f"{origin} pruned by pyprune with **{report['method']}** to **{report.get('pattern')}**"
                     + (f" (options: {options})" if options else "") + ".")
    else:
        lines.append(f"{origin}, saved by pyprune with no prune report.")
    if report.get("calib"):
        run = report.get("recovery") or report  # recovery records its own samples
        sizes = (f"{run['nsamples']} × {run['seqlen']} tokens of " if run.get("nsamples") else "")
        seed = f", seed {run['seed']}" if run.get("seed") is not None else ""
        lines.append(f"{'Training' if 'recovery' in report else 'Calibration'}: {sizes}`{report['calib']}`{seed}.")
    elif "calib" in report and report.get("method"):
        lines.append("Calibration: none (the method reads the weights alone).")
    elif report.get("method"):
        lines.append("Calibration: not recorded (saved by `pyprune.save` with `pyprune.prune`'s report; the command "
                     "line records it).")
    if report.get("sparsity") is not None:
        kind = "parameters removed" if str(report.get("pattern", "")).startswith("structured") \
            else "zeros in the pruned linear layers"
        when = " when it was pruned (the recovery keeps every zero)" if "recovery" in report else ""
        lines.append(f"Measured sparsity{when}: {report['sparsity']:.4f} ({kind}).")
    left = (report.get("left_dense") or {}).get("tensors")
    if left:
        lines.append(f"Left dense: {len(left)} block matrices (e.g. `{left[0]}`), outside that sparsity.")
    return lines


def _evaluation(report: Dict[str, Any]) -> List[str]:
    rows = [f"| {e['data']} | {e['perplexity']} | {e['tokens']} | {e['seqlen']} |"
            for e in report.get("eval") or report.get("eval_after") or []]
    lines = (["| text | perplexity | tokens | window |", "|---|---:|---:|---:|", *rows] if rows else [])
    tasks = report.get("tasks") or {}
    if tasks:
        lines += ["", "| task | accuracy | items |", "|---|---:|---:|",
                  *[f"| {name} | {result['acc']:.4f} | {result.get('n')} |" for name, result in tasks.items()]]
    return lines or ["This run measured no evaluation (`pyprune eval --model DIR --data TEXT` measures one)."]


def _why_pyprune(manifest: Dict[str, Any]) -> List[str]:
    reasons = []
    if manifest.get("sparse_layers"):
        reasons.append("its N:M layers are stored compressed (SparseLinear: the kept values and their positions), "
                       "a layer transformers does not have")
    if manifest.get("sparse_experts"):
        reasons.append("its MoE experts are held as SparseLinear layers")
    if manifest.get("residual_rotations"):
        reasons.append("it is sliced by SliceGPT: every block carries two shortcut rotations no transformers "
                       "architecture has")
    if not reasons:
        reasons.append("its decoder blocks have different sizes (structured pruning), which one config.json "
                       "cannot state")
    return reasons


def _how_to_load(manifest: Dict[str, Any], name: str) -> List[str]:
    if manifest.get("config_compatible", True):
        return ["A plain transformers checkpoint:", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f'model = AutoModelForCausalLM.from_pretrained("{name}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", "",
                "`pyprune.load` reads it too, with its `pyprune.json` (the per-block shapes and the prune report)."]
    return ["Load it with pyprune (`pip install pyprune`), which rebuilds it exactly:", "", "```python",
            "import pyprune", f'model, tokenizer = pyprune.load("{name}")', "```", "",
            "Plain `from_pretrained` cannot: " + "; ".join(_why_pyprune(manifest)) + ". Its `config.json` "
            "is marked (`model_type` says to use `pyprune.load`), so transformers refuses it rather than load "
            "wrong shapes or random weights."]


def _reproduce(name: str) -> List[str]:
    return ["", "## Reproduce it", "", f"`{RECIPE}` beside the weights is the recipe that produced this model "
            f"(`pyprune run {name}/` runs it again; `pyprune run {RECIPE} --output DIR` elsewhere)."]


def render(manifest: Dict[str, Any], name: str, has_recipe: bool = False) -> str:
    """The card of a directory named ``name`` whose ``pyprune.json`` is ``manifest`` (and, with
    ``has_recipe``, a ``recipe.yaml``)."""
    from huggingface_hub import ModelCardData
    report = manifest.get("report") or {}
    base = manifest.get("base_model") or {}
    tags = ["pyprune", "pruning"] + ([report["method"]] if report.get("method") else []) \
        + ([_pattern_tag(str(report["pattern"]))] if report.get("pattern") else []) \
        + (["lora-recovery"] if "recovery" in report else [])
    extra = {key: base[key] for key in ("license_name", "license_link") if base.get(key)}
    if report.get("pattern"):
        extra["sparsity_pattern"] = str(report["pattern"])
    if report.get("sparsity") is not None:
        extra["sparsity"] = round(float(report["sparsity"]), 6)
    results = _eval_results(report)
    data = ModelCardData(base_model=base.get("id"), library_name="pyprune", license=base.get("license"),
                         pipeline_tag="text-generation", tags=tags, model_name=name if results else None,
                         eval_results=results or None, **extra)
    title = f"{name}: {report['method']} {report.get('pattern')}" if report.get("method") else name
    title += " + LoRA recovery" if "recovery" in report else ""
    body = [f"# {title}", "", "## What was done", "", *[f"- {line}" for line in _what_was_done(report, base)], "",
            "## Evaluation", "",
            *_evaluation(report), "", "## How to load it", "", *_how_to_load(manifest, name),
            *(_reproduce(name) if has_recipe else []), ""]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)


def write(directory: str, manifest: Dict[str, Any], name: Optional[str] = None) -> None:
    """Write the card of ``manifest`` into ``directory`` (atomically); ``name``, the directory's name
    in the card, defaults to its own (:func:`pyprune.save` writes into a temporary one)."""
    write_text(os.path.join(directory, CARD), render(manifest, name or os.path.basename(os.path.abspath(directory)),
                                                     has_recipe=os.path.exists(os.path.join(directory, RECIPE))))


def write_source_card(directory: str, base_model: str, license: str, description: str) -> None:
    """The card of a model pyprune made from ``base_model`` by other means than a prune (an alias's
    dequantised GGUF), so a model pruned from it names its base and license."""
    from huggingface_hub import ModelCardData
    data = ModelCardData(base_model=base_model, library_name="pyprune", license=license, tags=["pyprune"])
    write_text(os.path.join(directory, CARD), f"---\n{data.to_yaml()}\n---\n\n{description}\n")
