"""Robustness of a structured pruning criterion to the weights' 16-bit format (MoreauPruner Table 1).

The same model is pruned twice, once with its weights in bfloat16 and once in float16. A robust
criterion removes the same groups in both and gives both pruned models the same perplexity:

* ``agreement``: of the groups (query heads and MLP channels, per layer; or the hidden channels,
  with the structured methods' ``structure="hidden"``) pruned in the bf16 run, the fraction pruned
  in the fp16 run too (both runs remove equally many; 1.0 = identical);
* ``spearman``: the rank correlation of all group scores of each pruned layer between the two runs
  (channels and query heads separately, mean over layers; the hidden channels' scores with
  ``structure="hidden"``): how far the whole ranking moves, not only the cut;
* ``ppl_diff``: |perplexity(bf16 run) − perplexity(fp16 run)|, the paper's "Diff", with both pruned
  models evaluated in one common format (``eval_format``, fp32 by default) as the papers' authors
  do, so that it measures the pruning choice and not the evaluation format; ``ppl_cross`` holds
  the full 2 × 2 (pruned in × evaluated in the two 16-bit formats).

Controls. A criterion with noise (MoreauPruner, SmoothGrad) is pruned once more in bf16 with the
next noise seed: ``noise_floor`` is the agreement and rank correlation of two noise draws in the
same format, the Monte-Carlo floor below which bf16/fp16 differences mean nothing. The agreement
between calibration seeds is the caller's (the benchmark compares its seeds' runs).

Arithmetic (``arithmetic``):

* ``"rounding"`` (the default): the weights are rounded to the format and held in fp32, and all
  arithmetic is fp32. The two runs then differ only by the weights' bit format, which is what the
  papers vary ("using both BF16 and FP16 weight bit formats"; the authors' script prunes on the
  CPU), and the gradients carry no 16-bit arithmetic error. It is also the fast one on CPUs.
* ``"fp32-accumulate"``: every linear layer multiplies the 16-bit weights and activations with
  fp32 accumulation and rounds its output to the format, as GPU tensor cores do; norms, attention
  and the activations' gradients stay 16-bit.
* ``"native"``: torch's 16-bit kernels throughout (on CPUs fp16 matmuls are tens of times slower
  than bf16: a gradient pass over 10×128 tokens of SmolLM2-135M took 213 s in fp16, 5 s in bf16).

The 16-bit arithmetics run the gradient passes with dynamic loss scaling (option ``loss_scaling``
of the structured methods, :class:`pyprune.runtime.engine.LossScaler`), so that fp16's range does not
flush the small logit and weight gradients to zero; without it fp16 is an underflow test.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Dict, Iterator, Mapping, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .. import methods
from ..methods import pruning
from ..methods.structured import STREAM
from ..evaluation.perplexity import perplexity
from ..patterns import Structured

FORMATS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_FORMATS = {"float32": torch.float32, **FORMATS}
ARITHMETIC = ("rounding", "fp32-accumulate", "native")

#: the group scores compared: each layer's query heads and MLP channels, the hidden channels
KINDS = ("heads", "channels", "hidden")
Group = Tuple[int, str, int]
LayerScores = Mapping[int, Mapping[str, Tensor]]


def _fp32_accumulate_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear multiplied with fp32 accumulation and rounded once to ``x``'s dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class _Fp32Accumulate(TorchFunctionMode):
    """Every ``F.linear`` called inside (every ``nn.Linear`` forward, also of the smaller layers
    compaction creates) computes as :func:`_fp32_accumulate_linear`; everything else is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return _fp32_accumulate_linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _check_arithmetic(arithmetic: str) -> None:
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETIC)}; got {arithmetic!r}")


@contextlib.contextmanager
def linear_arithmetic(arithmetic: str) -> Iterator[None]:
    """Inside the block the linear layers compute as ``arithmetic`` says (see the module
    docstring; ``rounding`` and ``native`` leave them as they are). Scoped to the block and to the
    calling thread: no class is patched (a torch function mode), and everything is as before on
    exit, also after an exception."""
    _check_arithmetic(arithmetic)
    with (_Fp32Accumulate() if arithmetic == "fp32-accumulate" else contextlib.nullcontext()):
        yield


def to_format(model: nn.Module, name: str, arithmetic: str) -> nn.Module:
    """``model`` (in place) with its weights in format ``name`` (a key of :data:`EVAL_FORMATS`): with
    ``rounding`` rounded to it and held in fp32, otherwise stored in it; fp32 is fp32 either way."""
    _check_arithmetic(arithmetic)
    if name not in EVAL_FORMATS:
        raise ValueError(f"format must be one of {', '.join(EVAL_FORMATS)}; got {name!r}")
    model.to(EVAL_FORMATS[name])
    return model.float() if arithmetic == "rounding" else model


def pruned_groups(report: Dict) -> Set[Group]:
    """The (layer, "head" | "channel", index) groups a structured pruning report removed; hidden
    channels as (:data:`pyprune.methods.structured.STREAM`, "hidden", index)."""
    groups: Set[Group] = {(STREAM, "hidden", i) for i in report.get("pruned_hidden_channels", ())}
    for entry in report["structure"]:
        groups.update((entry["layer"], "head", i) for i in entry.get("pruned_heads", ()))
        groups.update((entry["layer"], "channel", i) for i in entry.get("pruned_channels", ()))
    return groups


def agreement(first: Set[Group], second: Set[Group]) -> float:
    """|first ∩ second| / max(|first|, |second|): 1.0 when both prune the same groups (or none)."""
    largest = max(len(first), len(second))
    return 1.0 if largest == 0 else len(first & second) / largest


def _ranks(x: Tensor) -> Tensor:
    """Ranks 0..n−1 of the entries of ``x`` (fp64), tied entries sharing their mean rank."""
    x = x.detach().double().flatten().cpu()
    ranks = torch.empty_like(x)
    ranks[torch.argsort(x, stable=True)] = torch.arange(x.numel(), dtype=torch.float64)
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    return (torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, ranks) / counts)[inverse]


def spearman(first: Tensor, second: Tensor) -> float:
    """Spearman's rank correlation of two score vectors of equal length (NaN when one is constant)."""
    if first.numel() != second.numel():
        raise ValueError(f"spearman needs equally many scores; got {first.numel()} and {second.numel()}")
    a, b = _ranks(first), _ranks(second)
    a, b = a - a.mean(), b - b.mean()
    norm = float((a.square().sum() * b.square().sum()).sqrt())
    return float((a * b).sum()) / norm if norm > 0 else float("nan")


def rank_correlation(first: LayerScores, second: LayerScores) -> Dict[str, float]:
    """Mean over the layers both score of :func:`spearman` between their group scores, per kind
    both hold (``layer -> {"heads": [heads], "channels": [channels]}``, or the hidden channels'
    ``{STREAM: {"hidden": [hidden_size]}}``)."""
    layers = sorted(set(first) & set(second))
    if not layers:
        raise ValueError("rank_correlation needs scores of at least one common layer")
    kinds = [kind for kind in KINDS if all(kind in first[i] and kind in second[i] for i in layers)]
    return {kind: sum(spearman(first[i][kind], second[i][kind]) for i in layers) / len(layers) for kind in kinds}


def _prune_copy(model: nn.Module, name: str, arithmetic: str, method: str, pattern: Structured, calib: Tensor,
                batch_size: int, progress: bool, options: Dict) -> Tuple[nn.Module, Dict, Dict]:
    """A copy of ``model`` in format ``name`` pruned by ``method``: (the pruned copy, the pruning
    report, its layer scores ``layer -> {"heads", "channels"}``)."""
    runner = methods.get(method, **options)
    if not isinstance(runner, methods.StructuredMethod):
        raise ValueError(f"method must be a structured method; got {method!r}")
    pruned = to_format(copy.deepcopy(model), name, arithmetic)
    with linear_arithmetic(arithmetic):
        report = pruning.prune(pruned, runner, pattern, calib, batch_size=batch_size, progress=progress)
    scores = {layer: {kind: grouped[kind] for kind in KINDS if kind in grouped}
              for layer, grouped in runner.layer_scores.items()}
    return pruned, report, scores


def _perplexity_in(model: nn.Module, name: str, arithmetic: str, tokens: Tensor, seqlen: int, batch_size: int,
                   progress: bool) -> float:
    """Perplexity of a copy of ``model`` in format ``name`` computed in ``arithmetic``."""
    evaluated = to_format(copy.deepcopy(model), name, arithmetic)
    with linear_arithmetic(arithmetic):
        return perplexity(evaluated, tokens, seqlen, batch_size=batch_size, progress=progress)


def study(model: nn.Module, method: str, ratio: float, calib: Tensor, eval_tokens: Tensor, *,
          eval_seqlen: int = 128, arithmetic: str = "rounding", eval_format: str = "float32",
          cross: bool = True, noise_control: bool = True, keep_scores: bool = False, uniform: bool = False,
          batch_size: int = 8, progress: bool = True, **options) -> Dict:
    """Prune copies of ``model`` in bf16 and in fp16 with ``method`` at structured ``ratio`` and
    compare them (see the module docstring). ``model`` itself is not changed; ``options`` go to the
    method (``loss_scaling`` defaults to on for the 16-bit arithmetics).

    Returns the report: ``method``, ``agreement``, ``spearman``, ``ppl_bf16`` / ``ppl_fp16`` /
    ``ppl_diff`` in ``eval_format``; with ``cross`` ``ppl_cross[pruned in][evaluated in]`` over the
    two 16-bit formats; with ``noise_control`` (methods with a ``noise_seed``) ``noise_floor``; the
    per-format runs (sparsity, time, the Moreau diagnostics and loss scale where there are). With
    ``keep_scores``, also ``scores`` and ``groups`` per format (tensors and sets, not JSON)."""
    _check_arithmetic(arithmetic)
    if eval_format not in EVAL_FORMATS:
        raise ValueError(f"eval_format must be one of {', '.join(EVAL_FORMATS)}; got {eval_format!r}")
    options = {"loss_scaling": arithmetic != "rounding", **options}
    pattern = Structured(ratio, uniform=uniform)
    evaluated_in = list(dict.fromkeys([eval_format] + (list(FORMATS) if cross else [])))
    runs, groups, scores = {}, {}, {}
    for name in FORMATS:
        pruned, report, scores[name] = _prune_copy(model, name, arithmetic, method, pattern, calib, batch_size,
                                                   progress, options)
        groups[name] = pruned_groups(report)
        ppl = {}
        for fmt in evaluated_in:
            if arithmetic == "rounding" and fmt == name and eval_format == "float32":
                ppl[fmt] = ppl[eval_format]  # its weights are already exactly the rounded ones: the same run
            else:
                ppl[fmt] = _perplexity_in(pruned, fmt, arithmetic, eval_tokens, eval_seqlen, batch_size, progress)
        del pruned
        runs[name] = {"perplexity": ppl[eval_format], "perplexity_in": ppl, "sparsity": report["sparsity"],
                      "time_s": report["time_s"], "pruned_groups": len(groups[name]),
                      **{key: report[key] for key in ("moreau", "loss_scale") if key in report}}
        options_used = report["options"]
    result = {
        "method": method,
        "ppl_bf16": runs["bfloat16"]["perplexity"],
        "ppl_fp16": runs["float16"]["perplexity"],
        "ppl_diff": abs(runs["bfloat16"]["perplexity"] - runs["float16"]["perplexity"]),
        "agreement": agreement(groups["bfloat16"], groups["float16"]),
        "spearman": rank_correlation(scores["bfloat16"], scores["float16"]),
        "ppl_cross": {name: {fmt: runs[name]["perplexity_in"][fmt] for fmt in FORMATS} for name in FORMATS}
        if cross else None,
        "noise_floor": None,
        "ratio": ratio,
        "arithmetic": arithmetic,
        "eval_format": eval_format,
        "options": options_used,
        "runs": runs,
    }
    if noise_control and "noise_seed" in options_used:
        seeds = [options_used["noise_seed"], options_used["noise_seed"] + 1]
        _, report, other = _prune_copy(model, "bfloat16", arithmetic, method, pattern, calib, batch_size, progress,
                                       {**options, "noise_seed": seeds[1]})
        result["noise_floor"] = {"format": "bfloat16", "noise_seeds": seeds,
                                 "agreement": agreement(groups["bfloat16"], pruned_groups(report)),
                                 "spearman": rank_correlation(scores["bfloat16"], other)}
    if keep_scores:
        result.update(scores=scores, groups=groups)
    return result


def eta_sweep(model: nn.Module, etas, ratio: float, calib: Tensor, *, name: str = "bfloat16",
              arithmetic: str = "rounding", batch_size: int = 8, progress: bool = False, **options) -> Dict:
    """MoreauPruner-GS at each of ``etas`` against η = 0 (the same ρ, γ, T and noise, format
    ``name``): per η the threshold γη, the agreement and rank correlation with η = 0 and the -GS
    diagnostics. Where the agreement first drops below 1 is where the group-sparse prox starts to
    change the selection."""
    _check_arithmetic(arithmetic)
    options = {"loss_scaling": arithmetic != "rounding", **options}
    pattern = Structured(ratio)
    _, report, base_scores = _prune_copy(model, name, arithmetic, "moreau-gs", pattern, calib, batch_size, progress,
                                         {**options, "eta": 0.0})
    base = pruned_groups(report)
    rows = []
    for eta in etas:
        _, report, scores = _prune_copy(model, name, arithmetic, "moreau-gs", pattern, calib, batch_size, progress,
                                        {**options, "eta": eta})
        rows.append({"eta": eta, "threshold": eta * report["options"]["gamma"],
                     "agreement": agreement(base, pruned_groups(report)),
                     "spearman": rank_correlation(base_scores, scores), "moreau": report["moreau"]})
    return {"format": name, "arithmetic": arithmetic, "ratio": ratio, "options": report["options"], "rows": rows}
