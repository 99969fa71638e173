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

Controls. A criterion with noise (MoreauPruner, SmoothGrad) is pruned once more with the next noise
seed in each of ``noise_formats`` (bf16 by default): ``noise_floor`` holds, per format, the
agreement, rank correlation and perplexity difference (``ppl_diff``, in ``eval_format``) of two
noise draws in the same format, the Monte-Carlo floor below which bf16/fp16 differences mean
nothing; its top-level agreement and rank correlation are the first format's. The agreement
between calibration seeds is the caller's (the benchmark compares its seeds' runs).

Arithmetic (``arithmetic``):

* ``"rounding"`` (the default): the weights are rounded to the format and held in fp32, and all
  arithmetic is fp32. The two runs then differ only by the weights' bit format, which is what the
  papers vary ("using both BF16 and FP16 weight bit formats"; the authors' script prunes on the
  CPU), and the gradients carry no 16-bit arithmetic error. It is also the fast one on CPUs.
* ``"fp32-accumulate"``: every linear layer multiplies the 16-bit weights and activations with
  fp32 accumulation and rounds its output to the format, as GPU tensor cores do; norms, attention
  and the activations' gradients stay 16-bit.
* ``"native"``: torch's 16-bit kernels throughout (on CPUs without AVX-512 FP16 fp16 matmuls are
  tens of times slower than bf16). Their products too accumulate in fp32 and are rounded once, so
  native and fp32-accumulate differ by the matmuls' summation order alone; the study sets each
  native run beside the fp32-accumulate run of its settings (:func:`against_arithmetic`) to show
  what that order moves.

The 16-bit arithmetics run the gradient passes with dynamic loss scaling (option ``loss_scaling``
of the structured methods, :class:`pyprune.runtime.engine.LossScaler`), so that fp16's range does not
flush the small logit and weight gradients to zero; without it fp16 is an underflow test.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import os
import statistics
import time
from typing import Dict, Iterator, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .. import methods
from ..files import atomic_path, write_text
from ..inputs import data
from ..inputs.models import load_model
from ..methods import pruning
from ..methods.options import at_least_one, fraction, nonnegative, option, positive
from ..methods.structured import STREAM
from ..evaluation.perplexity import perplexity
from ..nn.dispatch import environment_record
from ..patterns import Structured
from ..runtime.checkpoint import Checkpoint, model_fingerprint, tokens_digest
from .results import mean_std, verdict_cell
from .study import Arm, Study, model_label
from .verdict import RULE, paired_verdict

FORMATS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_FORMATS = {"float32": torch.float32, **FORMATS}
ARITHMETIC = ("rounding", "fp32-accumulate", "native")
#: what native 16-bit runs are set beside (:func:`against_arithmetic`): the same products, accumulated in fp32
REFERENCE = "fp32-accumulate"
#: the batch size of every prune and evaluation of the study (part of the key of kept scores)
BATCH_SIZE = 8

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


class ScoreStore:
    """The group scores of each prune of one arm, kept in ``directory`` so that they are computed
    once: a prune whose scores are there cuts them (at any ratio: the scores do not depend on it,
    :meth:`pyprune.methods.StructuredMethod.use_scores`) instead of scoring again, and a stopped
    arm resumes after its last finished prune. One safetensors state per method, format and noise
    seed (:class:`pyprune.runtime.checkpoint.Checkpoint`, written atomically) holds the scores, the
    scoring details (loss scale, Moreau diagnostics) and the time of the prune that computed them,
    keyed by everything the scores depend on: the method's settings, the format and arithmetic, the
    batch size, the model (:func:`~pyprune.runtime.checkpoint.model_fingerprint`) and the calibration
    tokens. A state of another key is refused, naming what differs, never reused or overwritten."""

    kind = "robustness scores"

    def __init__(self, directory: str, model: nn.Module, calib: Tensor, arithmetic: str, batch_size: int):
        self.directory, self.arithmetic, self.batch_size = directory, arithmetic, batch_size
        self.identity = {"model": model_fingerprint(model), "calibration": tokens_digest(calib)}

    def _state(self, runner: "methods.StructuredMethod", name: str) -> Tuple[Checkpoint, str]:
        settings = {"method": runner.name, "options": runner.settings, "format": name, "arithmetic": self.arithmetic,
                    "batch_size": self.batch_size}
        noise = f"-noise{runner.settings['noise_seed']}" if "noise_seed" in runner.settings else ""
        return (Checkpoint(self.directory, {"settings": settings, **self.identity}, self.kind),
                f"{runner.name}-{name}{noise}.safetensors")

    def load(self, runner: "methods.StructuredMethod", name: str) -> Optional[float]:
        """Set ``runner`` to prune from the kept scores of format ``name`` (:meth:`use_scores`): the
        time of the prune that computed them; None (nothing set) when none are kept."""
        states, file = self._state(runner, name)
        stored = states.load(file)
        if stored is None:
            return None
        tensors, meta = stored
        scores: Dict[int, Dict[str, Tensor]] = {}
        for key, values in tensors.items():
            layer, kind = key.split(".", 1)
            scores.setdefault(int(layer), {})[kind] = values
        runner.use_scores(scores, meta["details"])
        return meta["time_s"]

    def save(self, runner: "methods.StructuredMethod", name: str, time_s: float) -> None:
        """Keep the scores ``runner``'s last prune computed in format ``name`` (none when it scored nothing)."""
        if not runner.layer_scores:
            return
        states, file = self._state(runner, name)
        tensors = {f"{layer}.{kind}": values for layer, kinds in runner.layer_scores.items()
                   for kind, values in kinds.items()}
        states.save(file, tensors, {"details": runner.scoring_details(), "time_s": time_s})


def prune_copy(model: nn.Module, name: str, arithmetic: str, method: str, pattern: Structured, calib: Tensor,
               batch_size: int, progress: bool, options: Dict, store: Optional[ScoreStore] = None,
               stored_only: bool = False) -> Optional[Tuple[nn.Module, Dict, Dict]]:
    """A copy of ``model`` in format ``name`` pruned by ``method``: (the pruned copy, the pruning
    report, its layer scores ``layer -> {"heads", "channels"}``), from the scores ``store`` keeps
    when it keeps them (the report's ``time_s`` is then the time of the prune that computed them),
    otherwise scored here and kept in ``store`` (with ``stored_only``: None, nothing scored)."""
    runner = methods.get(method, **options)
    if not isinstance(runner, methods.StructuredMethod):
        raise ValueError(f"method must be a structured method; got {method!r}")
    scored_in = store.load(runner, name) if store is not None else None
    if scored_in is None and stored_only:
        return None
    pruned = to_format(copy.deepcopy(model), name, arithmetic)
    with linear_arithmetic(arithmetic):
        report = pruning.prune(pruned, runner, pattern, calib, batch_size=batch_size, progress=progress)
    if scored_in is not None:
        report["time_s"] = scored_in
    elif store is not None:
        store.save(runner, name, report["time_s"])
    scores = {layer: {kind: grouped[kind] for kind in KINDS if kind in grouped}
              for layer, grouped in runner.layer_scores.items()}
    return pruned, report, scores


def method_options(arithmetic: str, options: Mapping) -> Dict:
    """The method's ``options`` in ``arithmetic``: loss scaling on by default for the 16-bit arithmetics."""
    return {"loss_scaling": arithmetic != "rounding", **options}


def perplexity_in(model: nn.Module, name: str, arithmetic: str, tokens: Tensor, seqlen: int, batch_size: int,
                   progress: bool) -> float:
    """Perplexity of a copy of ``model`` in format ``name`` computed in ``arithmetic``."""
    evaluated = to_format(copy.deepcopy(model), name, arithmetic)
    with linear_arithmetic(arithmetic):
        return perplexity(evaluated, tokens, seqlen, batch_size=batch_size, progress=progress)


def study(model: nn.Module, method: str, ratio: float, calib: Tensor, eval_tokens: Tensor, *,
          eval_seqlen: int = 128, arithmetic: str = "rounding", eval_format: str = "float32",
          cross: bool = True, noise_control: bool = True, noise_formats: Sequence[str] = ("bfloat16",),
          keep_scores: bool = False, uniform: bool = False, batch_size: int = BATCH_SIZE, progress: bool = True,
          scores_dir: Optional[str] = None, **options) -> Dict:
    """Prune copies of ``model`` in bf16 and in fp16 with ``method`` at structured ``ratio`` and
    compare them (see the module docstring). ``model`` itself is not changed; ``options`` go to the
    method (``loss_scaling`` defaults to on for the 16-bit arithmetics). With ``scores_dir`` each
    prune's group scores are kept there and reused by a later call with the same settings (another
    ratio, a resumed run; :class:`ScoreStore`); one directory per method variant and calibration.

    Returns the report: ``method``, ``agreement``, ``spearman``, ``ppl_bf16`` / ``ppl_fp16`` /
    ``ppl_diff`` in ``eval_format``; with ``cross`` ``ppl_cross[pruned in][evaluated in]`` over the
    two 16-bit formats; with ``noise_control`` (methods with a ``noise_seed``) ``noise_floor`` of
    the ``noise_formats`` (:func:`noise_floor`); the
    per-format runs (sparsity, time, the Moreau diagnostics and loss scale where there are). With
    ``keep_scores``, also ``scores`` and ``groups`` per format (tensors and sets, not JSON)."""
    _check_arithmetic(arithmetic)
    if eval_format not in EVAL_FORMATS:
        raise ValueError(f"eval_format must be one of {', '.join(EVAL_FORMATS)}; got {eval_format!r}")
    if not noise_formats or any(name not in FORMATS for name in noise_formats):
        raise ValueError(f"noise_formats must be one or more of {', '.join(FORMATS)}; got {list(noise_formats)!r}")
    options = method_options(arithmetic, options)
    pattern = Structured(ratio, uniform=uniform)
    evaluated_in = list(dict.fromkeys([eval_format] + (list(FORMATS) if cross else [])))
    store = ScoreStore(scores_dir, model, calib, arithmetic, batch_size) if scores_dir is not None else None
    runs, groups, scores = {}, {}, {}
    for name in FORMATS:
        pruned, report, scores[name] = prune_copy(model, name, arithmetic, method, pattern, calib, batch_size,
                                                   progress, options, store)
        groups[name] = pruned_groups(report)
        ppl = {}
        for fmt in evaluated_in:
            if arithmetic == "rounding" and fmt == name and eval_format == "float32":
                ppl[fmt] = ppl[eval_format]  # its weights are already exactly the rounded ones: the same run
            else:
                ppl[fmt] = perplexity_in(pruned, fmt, arithmetic, eval_tokens, eval_seqlen, batch_size, progress)
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
        per_format = {}
        for name in dict.fromkeys(noise_formats):
            pruned, report, other = prune_copy(model, name, arithmetic, method, pattern, calib, batch_size,
                                                progress, {**options, "noise_seed": seeds[1]}, store)
            ppl = perplexity_in(pruned, eval_format, arithmetic, eval_tokens, eval_seqlen, batch_size, progress)
            del pruned
            per_format[name] = {"agreement": agreement(groups[name], pruned_groups(report)),
                                "spearman": rank_correlation(scores[name], other), "perplexity": ppl,
                                "ppl_diff": abs(runs[name]["perplexity"] - ppl)}
        first = per_format[noise_formats[0]]
        result["noise_floor"] = {"format": noise_formats[0], "noise_seeds": seeds, "agreement": first["agreement"],
                                 "spearman": first["spearman"],
                                 "ppl_diff": {name: floor["ppl_diff"] for name, floor in per_format.items()},
                                 "formats": per_format}
    if keep_scores:
        result.update(scores=scores, groups=groups)
    return result


def against_arithmetic(model: nn.Module, method: str, ratio: float, calib: Tensor, options: Dict,
                       stores: Mapping[str, ScoreStore], batch_size: int = BATCH_SIZE) -> Optional[Dict]:
    """The prunes of two arithmetics set side by side, from the scores their ``stores`` keep (arithmetic ->
    :class:`ScoreStore`, the first the run's, the second the reference; same method, ``options`` with the
    noise seed, calibration and batch size): per format the agreement of the pruned groups and the rank
    correlation of all group scores, and the reference arithmetic's name; None unless both keep both
    formats. Nothing is scored: each prune cuts its kept scores."""
    pattern, per_format = Structured(ratio), {}
    for name in FORMATS:
        pruned = [prune_copy(model, name, arithmetic, method, pattern, calib, batch_size, False, options, store,
                             stored_only=True) for arithmetic, store in stores.items()]
        if any(prune is None for prune in pruned):
            return None
        (_, first, first_scores), (_, second, second_scores) = pruned
        per_format[name] = {"agreement": agreement(pruned_groups(first), pruned_groups(second)),
                            "spearman": rank_correlation(first_scores, second_scores)}
    return {"arithmetic": list(stores)[1], **per_format}


def eta_sweep(model: nn.Module, etas, ratio: float, calib: Tensor, *, name: str = "bfloat16",
              arithmetic: str = "rounding", batch_size: int = BATCH_SIZE, progress: bool = False, **options) -> Dict:
    """MoreauPruner-GS at each of ``etas`` against η = 0 (the same ρ, γ, T and noise, format
    ``name``): per η the threshold γη, the agreement and rank correlation with η = 0 and the -GS
    diagnostics. Where the agreement first drops below 1 is where the group-sparse prox starts to
    change the selection."""
    _check_arithmetic(arithmetic)
    options = {"loss_scaling": arithmetic != "rounding", **options}
    pattern = Structured(ratio)
    _, report, base_scores = prune_copy(model, name, arithmetic, "moreau-gs", pattern, calib, batch_size, progress,
                                         {**options, "eta": 0.0})
    base = pruned_groups(report)
    rows = []
    for eta in etas:
        _, report, scores = prune_copy(model, name, arithmetic, "moreau-gs", pattern, calib, batch_size, progress,
                                        {**options, "eta": eta})
        rows.append({"eta": eta, "threshold": eta * report["options"]["gamma"],
                     "agreement": agreement(base, pruned_groups(report)),
                     "spearman": rank_correlation(base_scores, scores), "moreau": report["moreau"]})
    return {"format": name, "arithmetic": arithmetic, "ratio": ratio, "options": report["options"], "rows": rows}



# -- the study: MoreauPruner's Table 1 on SmolLM2-135M, with its controls ------------------------

#: the table's rows: a name -> (pyprune method, its options)
VARIANTS = {
    "taylor": ("taylor", {}),
    "smoothgrad": ("smoothgrad", {}),  # averages the scores (v2 paper)
    "smoothgrad-gradients": ("smoothgrad", {"average": "gradients"}),  # averages the gradients (v1 paper)
    "moreau": ("moreau", {}),
    "moreau-gs": ("moreau-gs", {}),
    # the authors' released loop (spec Appendix X): no decay, mean δ of the last 5 steps, per-row RMS operator,
    # every parameter smoothed
    "moreau-gs-released": ("moreau-gs", {"operator": "released", "decay": False, "average_last": 5, "smooth": "all"}),
}
VARIANT_NAMES = tuple(VARIANTS)
PAPER_LAYERS, PAPER_FIRST, PAPER_END = 32, 4, 30  # LLaMA-7B: layers 4..29 pruned (range(4, 30))
DEFAULT_MODEL = "smollm2-135m"


def layer_protocol(layers: str, ratio: float, n_layers: int):
    """(first_layer, last_layer, per-layer ratio) of protocol ``layers`` at overall ``ratio``: ``all``
    prunes every layer at the ratio; ``middle`` is the v2 paper's (App. E.2) scaled to ``n_layers``."""
    if layers == "all":
        return 0, n_layers - 1, ratio
    first = round(PAPER_FIRST * n_layers / PAPER_LAYERS)
    last = round(PAPER_END * n_layers / PAPER_LAYERS) - 1
    return first, last, ratio * n_layers / (last - first + 1)


def _key(run):
    return (run["method"], run["arithmetic"], run["layers"], run["overall_ratio"], run.get("structure", "groups"))


def _run_key(run):
    return (*_key(run), run["seed"])


def _scores_path(directory, run, seed):
    method, arithmetic, layers, ratio, structure = _key(run)
    hidden = "-hidden" if structure == "hidden" else ""
    return os.path.join(directory, f"{method}-{arithmetic}-{layers}{hidden}-{ratio}-seed{seed}.safetensors")


def _arm_scores_dir(directory, run):
    """Where the arm of ``run`` keeps each prune's scores (:class:`ScoreStore`): one directory per
    variant, arithmetic, layers, structure and seed, shared by the ratios."""
    method, arithmetic, layers, _, structure = _key(run)
    hidden = "-hidden" if structure == "hidden" else ""
    return os.path.join(directory, "arms", f"{method}-{arithmetic}-{layers}{hidden}-seed{run['seed']}")


def save_scores(path, report):
    """The bf16 run's group scores and pruned groups (safetensors, atomically)."""
    from safetensors.torch import save_file
    tensors = {}
    for layer, scores in report["scores"]["bfloat16"].items():
        for kind, values in scores.items():
            tensors[f"{layer}.{kind}"] = values.float().contiguous()
    for layer, kind, index in report["groups"]["bfloat16"]:
        tensors.setdefault(f"{layer}.pruned_{kind}s", [])
        tensors[f"{layer}.pruned_{kind}s"].append(index)
    tensors = {k: (torch.tensor(sorted(v)) if isinstance(v, list) else v) for k, v in tensors.items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_path(path) as temporary:
        save_file(tensors, temporary)


def load_scores(path):
    """(layer scores, pruned groups) of a file :func:`save_scores` wrote."""
    from safetensors.torch import load_file
    tensors = load_file(path)
    scores, groups = {}, set()
    for name, values in tensors.items():
        layer, kind = name.split(".", 1)
        if kind.startswith("pruned_"):
            groups.update((int(layer), kind[len("pruned_"):-1], int(i)) for i in values.tolist())
        else:
            scores.setdefault(int(layer), {})[kind] = values
    return scores, groups


def _floor_key(key):
    """A setting's key in ``calibration_floor`` (the structure only when not the default)."""
    return "|".join(map(str, key if key[4] != "groups" else key[:4]))


def calibration_floor(runs, directory, previous=None):
    """Per setting: mean agreement and rank correlation of the bf16 runs over pairs of seeds; a
    ``previous`` floor stays when its runs' score files are not here (another machine's)."""
    keys = {_key(r) for r in runs}
    floors = {k: v for k, v in (previous or {}).items() if k in {_floor_key(key) for key in keys}}
    for key in keys:
        seeds = sorted(r["seed"] for r in runs if _key(r) == key)
        paths = {s: _scores_path(directory, next(r for r in runs if _key(r) == key), s) for s in seeds}
        if len(seeds) < 2 or not all(os.path.exists(p) for p in paths.values()):
            continue
        loaded = {s: load_scores(p) for s, p in paths.items()}
        pairs = list(itertools.combinations(seeds, 2))
        agreements = [agreement(loaded[a][1], loaded[b][1]) for a, b in pairs]
        correlations = [rank_correlation(loaded[a][0], loaded[b][0]) for a, b in pairs]
        floors[_floor_key(key)] = {
            "pairs": [list(p) for p in pairs], "agreement": statistics.fmean(agreements),
            "spearman": {kind: statistics.fmean(c[kind] for c in correlations) for kind in correlations[0]}}
    return floors


def _rho_channels(spearman):
    """The channels' rank correlation: of the MLP channels, or of the hidden channels (structure hidden)."""
    return spearman["channels"] if "channels" in spearman else spearman["hidden"]


def verdicts(runs):
    """MoreauPruner against the baselines over calibration seeds: for every MoreauPruner variant
    and every other variant run in the same arithmetic, layers, ratio and structure, the
    (MoreauPruner key, baseline key, agreement verdict, ppl_diff verdict) on the seeds both ran
    (:func:`pyprune.studies.verdict.paired_verdict`; agreement: higher is better, ppl_diff: lower)."""
    keys = sorted({_key(r) for r in runs}, key=lambda k: (k[4], k[2], k[3], VARIANT_NAMES.index(k[0]), k[1]))
    found = []
    for ours in (key for key in keys if key[0].startswith("moreau")):
        for theirs in (key for key in keys if not key[0].startswith("moreau") and key[1:] == ours[1:]):
            side = {key: {r["seed"]: r for r in runs if _key(r) == key} for key in (ours, theirs)}
            if not side[ours].keys() & side[theirs].keys():
                continue
            found.append((ours, theirs, *(paired_verdict({s: r[metric] for s, r in side[ours].items()},
                                                         {s: r[metric] for s, r in side[theirs].items()},
                                                         lower_is_better=metric != "agreement")
                                          for metric in ("agreement", "ppl_diff"))))
    return found


def verdict_lines(runs):
    """The markdown of :func:`verdicts` (nothing when no MoreauPruner variant shares a seed with a baseline)."""
    found = verdicts(runs)
    if not found:
        return []
    lines = ["", f"MoreauPruner against the baselines, paired by calibration seed: ahead or behind only when {RULE} "
             "(pyprune.studies.verdict), otherwise unsettled. Difference = MoreauPruner − baseline; agreement: "
             "higher is better, ppl_diff: lower is better.", "",
             "| method | against | arithmetic | structure | layers | ratio | agreement | ppl_diff |",
             "|---|---|---|---|---|---:|---|---|"]
    for ours, theirs, agreement_verdict, ppl_verdict in found:
        lines.append(f"| {ours[0]} | {theirs[0]} | {ours[1]} | {ours[4]} | {ours[2]} | {ours[3]:g} | "
                     f"{verdict_cell(agreement_verdict)} | {verdict_cell(ppl_verdict, '.2f')} |")
    return lines


def _noise_ppl(run) -> Dict[str, float]:
    """The noise floor's perplexity difference per format (none where the run has no such floor)."""
    return (run.get("noise_floor") or {}).get("ppl_diff", {})


def format_against_noise(runs):
    """Per setting with a noise floor, the bf16/fp16 comparison against two noise draws of one format,
    paired by calibration seed (:func:`pyprune.studies.verdict.paired_verdict`): (key, its runs,
    the agreement verdict, the ppl_diff verdict). Differences: the run's agreement − its noise
    floor's (higher is better: the formats' selections agree more than two noise draws'), and its
    ppl_diff − the mean over the floor's formats of their ppl_diff (lower is better); the ppl_diff
    verdict is None where no run has a perplexity floor. "ahead" thus reads: the format moves the
    choice (the perplexity) less than the method's own noise does."""
    found = []
    for key in sorted({_key(r) for r in runs if r.get("noise_floor")},
                      key=lambda k: (k[4], k[2], k[3], VARIANT_NAMES.index(k[0]), k[1])):
        rows = [r for r in runs if _key(r) == key and r.get("noise_floor")]
        agreement_verdict = paired_verdict({r["seed"]: r["agreement"] for r in rows},
                                           {r["seed"]: r["noise_floor"]["agreement"] for r in rows},
                                           lower_is_better=False)
        floors = {r["seed"]: statistics.fmean(_noise_ppl(r).values()) for r in rows if _noise_ppl(r)}
        ppl_verdict = paired_verdict({r["seed"]: r["ppl_diff"] for r in rows}, floors) if floors else None
        found.append((key, rows, agreement_verdict, ppl_verdict))
    return found


def format_against_noise_lines(runs):
    """The markdown of :func:`format_against_noise` (nothing when no run has a noise floor)."""
    found = format_against_noise(runs)
    if not found:
        return []
    lines = ["", "The format against the noise draw, paired by calibration seed: the bf16/fp16 agreement and the "
             "paper's Diff (ppl_diff) beside the same measures between two noise draws of one format (perplexity: "
             f"the mean over the floor's formats); ahead or behind only when {RULE}. Difference = bf16/fp16 − "
             "noise floor; ahead: the format moves the selection (the perplexity) less than a second noise draw "
             "does.", "",
             "| method | arithmetic | structure | layers | ratio | agreement bf16/fp16 | noise floor agr. | "
             "agreement − floor | ppl_diff (the paper's Diff) | noise floor ppl_diff | ppl_diff − floor |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|---|"]
    for key, rows, agreement_verdict, ppl_verdict in found:
        floors = [statistics.fmean(_noise_ppl(r).values()) if _noise_ppl(r) else None for r in rows]
        lines.append(f"| {key[0]} | {key[1]} | {key[4]} | {key[2]} | {key[3]:g} | "
                     f"{mean_std([r['agreement'] for r in rows])} | "
                     f"{mean_std([r['noise_floor']['agreement'] for r in rows])} | {verdict_cell(agreement_verdict)} | "
                     f"{mean_std([r['ppl_diff'] for r in rows], '.2f')} | {mean_std(floors, '.2f')} | "
                     f"{'–' if ppl_verdict is None else verdict_cell(ppl_verdict, '.2f')} |")
    return lines


def against_lines(runs):
    """The markdown of the native runs set beside fp32 accumulation (:func:`against_arithmetic`; nothing
    when no native run has its reference kept)."""
    compared = [r for r in runs if r.get("against")]
    if not compared:
        return []
    lines = ["", "Native 16-bit against fp32 accumulation: the same method, format, calibration and noise seed "
             "pruned once with torch's 16-bit kernels and once with every linear layer accumulating in fp32; "
             "agreement of the pruned groups and rank correlation of all group scores between the two "
             "(1.0 = the same choice), mean ± std over the calibration seeds.", "",
             "| method | structure | layers | ratio | seeds | agreement bf16 | ρ ch. bf16 | agreement fp16 | "
             "ρ ch. fp16 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted({_key(r) for r in compared}, key=lambda k: (k[4], k[2], k[3], VARIANT_NAMES.index(k[0]))):
        rows = [r["against"] for r in compared if _key(r) == key]
        cells = [f"{mean_std([row[name]['agreement'] for row in rows])} | "
                 f"{mean_std([_rho_channels(row[name]['spearman']) for row in rows], '.5f')}" for name in FORMATS]
        lines.append(f"| {key[0]} | {key[4]} | {key[2]} | {key[3]:g} | {len(rows)} | " + " | ".join(cells) + " |")
    return lines


def markdown(result) -> str:
    settings, runs = result["settings"], result["runs"]
    lines = [f"{model_label(settings)}; calibration {settings['calibration']}, evaluation {settings['evaluation']}; "
             f"{result['environment']['device']}, {result['environment']['cpu_threads']} threads, torch "
             f"{result['environment']['torch']}. Perplexities of both pruned models in fp32 (the common format). "
             "Mean ± std over the calibration seeds; noise floor: bf16 runs of noise seeds 0 and 1 (noise floor ppl_diff: "
             "|perplexity difference| of the noise seed 0 and 1 runs of one format, bf16 / fp16); "
             "calibration floor: bf16 runs of two calibration seeds (mean over pairs). Variants: "
             + "; ".join(f"{name} = {method} {options}" for name, (method, options) in VARIANTS.items()
                         if name != method) + ". Structure: groups = each layer's heads and MLP channels; hidden = "
             "hidden channels in every layer (LLM-Pruner's channel-wise protocol), ρ channels then over hidden "
             "channels.", "",
             "| method | arithmetic | structure | layers | ratio | seeds | agreement bf16/fp16 | ρ channels | ρ heads | "
             "noise floor agr. | noise floor ρ ch. | calib. floor agr. | calib. floor ρ ch. | ppl bf16 | ppl fp16 | "
             "ppl_diff (the paper's Diff) | noise floor ppl_diff bf16 / fp16 | ‖δ‖/‖σ\\|w\\|‖ | decay | "
             "GS rows shrunk >1% |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in sorted({_key(r) for r in runs}, key=lambda k: (k[4], k[2], k[3], VARIANT_NAMES.index(k[0]), k[1])):
        rows = [r for r in runs if _key(r) == key]
        floor = result["calibration_floor"].get(_floor_key(key))
        noise = [r["noise_floor"] for r in rows if r["noise_floor"]]
        moreau = [r["runs"]["bfloat16"].get("moreau") or {} for r in rows]
        ppl = [mean_std([r[k] for r in rows], ".2f") for k in ("ppl_bf16", "ppl_fp16", "ppl_diff")]
        cells = [key[0], key[1], key[4], key[2], f"{key[3]:g}", str(len(rows)),
                 mean_std([r["agreement"] for r in rows]),
                 mean_std([_rho_channels(r["spearman"]) for r in rows], ".5f"),
                 mean_std([r["spearman"].get("heads") for r in rows]),
                 mean_std([n["agreement"] for n in noise]),
                 mean_std([_rho_channels(n["spearman"]) for n in noise], ".5f"),
                 f"{floor['agreement']:.4f}" if floor else "–",
                 f"{_rho_channels(floor['spearman']):.5f}" if floor else "–",
                 *ppl,
                 " / ".join(mean_std([_noise_ppl(r).get(name) for r in rows], ".2f") for name in FORMATS),
                 mean_std([m.get("delta_to_noise") for m in moreau], ".2e"),
                 mean_std([m.get("decay") for m in moreau], ".3f"),
                 mean_std([m.get("gs_shrunk_1pct") for m in moreau])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += verdict_lines(runs)
    lines += format_against_noise_lines(runs)
    lines += against_lines(runs)
    lines += ["", "Per run (perplexity: pruned in → evaluated in; fp32 is the common format):", "",
              "| method | arithmetic | structure | layers | ratio | seed | agreement | ρ ch. | ρ heads | ppl fp32 bf16-run | "
              "ppl fp32 fp16-run | bf16→bf16 | bf16→fp16 | fp16→bf16 | fp16→fp16 | loss-scale backoffs | "
              "prune s (bf16, fp16) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cross = r["ppl_cross"] or {name: {fmt: None for fmt in FORMATS} for name in FORMATS}
        backoffs = [r["runs"][f].get("loss_scale", {}).get("backoffs") for f in ("bfloat16", "float16")]
        lines.append(
            f"| {r['method']} | {r['arithmetic']} | {r.get('structure', 'groups')} | {r['layers']} | "
            f"{r['overall_ratio']:g} | {r['seed']} | {r['agreement']:.4f} | {_rho_channels(r['spearman']):.5f} | "
            f"{mean_std([r['spearman'].get('heads')])} | "
            f"{r['ppl_bf16']:.2f} | {r['ppl_fp16']:.2f} | "
            + " | ".join(mean_std([cross[name][fmt]], ".2f") for name in FORMATS for fmt in FORMATS)
            + f" | {', '.join('–' if b is None else str(b) for b in backoffs)} | "
            f"{r['runs']['bfloat16']['time_s']:.0f}, {r['runs']['float16']['time_s']:.0f} |")
    if not runs:
        lines = lines[:1]
    sweep = result.get("eta_sweep")
    if sweep:
        lines += ["", f"MoreauPruner-GS η sweep ({sweep['format']}, {sweep['arithmetic']}, ratio {sweep['ratio']:g}, "
                  f"calibration seed {sweep['seed']}): selection against η = 0 (same ρ = {sweep['options']['rho']}, "
                  f"γ = {sweep['options']['gamma']}, noise).", "",
                  "| η | threshold γη | agreement with η = 0 | ρ channels | rows zeroed | rows shrunk >1% | "
                  "median shrink |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in sweep["rows"]:
            m = row["moreau"]
            lines.append(f"| {row['eta']:g} | {row['threshold']:.3g} | {row['agreement']:.4f} | "
                         f"{row['spearman']['channels']:.4f} | {m['gs_zeroed']:.4f} | {m['gs_shrunk_1pct']:.4f} | "
                         f"{'–' if m['gs_shrink_median'] is None else format(m['gs_shrink_median'], '.3g')} |")
    return "\n".join(lines) + "\n"


class Robustness(Study):
    """MoreauPruner's robustness claim (Table 1) on SmolLM2-135M, with its controls.

    Every arm (method variant × arithmetic × ratio × calibration seed, seeds the outer loop) runs
    :func:`study`: the agreement of the bf16 and fp16 runs' pruned groups, the rank correlation of
    all group scores, both pruned models' perplexities in fp32 (each pruned model evaluated once;
    with ``cross`` also the 2 × 2 pruned-in × evaluated-in). Controls: the Monte-Carlo floor
    (``noise_floor``) and the calibration floor (agreement and rank correlation between the bf16
    runs of two calibration seeds, from the per-run scores kept in the ``.scores`` directory beside
    the results, not committed). Each prune's group scores are kept there too, under ``arms/``
    (:class:`ScoreStore`), as soon as they are computed: the ratios of one arm share them (scored
    once, cut at every ratio) and a stopped arm resumes after its last finished prune.
    ``eta_sweep`` runs instead a MoreauPruner-GS η sweep against η = 0 (:func:`eta_sweep`; bf16,
    rounding, the first seed and ratio) into ``NAME-eta-sweep.{json,md}``.

    Layers ``middle``: the v2 paper's protocol (App. E.2) scaled to the model (:func:`layer_protocol`).
    Structure ``hidden``: LLM-Pruner's channel-wise protocol (every layer's hidden channels).
    Calibration: ``nsamples`` × ``seqlen`` random windows of Emma, one draw per seed; evaluation:
    the first ``eval_tokens`` tokens of Pride and Prejudice in ``eval_seqlen``-token windows.
    """

    name = "robustness"
    summary = "prune in bf16 and in fp16 and compare the choices, with noise and calibration floors (MoreauPruner Table 1)"
    results = "robustness-smollm2-135m"
    row_list = "runs"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    methods: Tuple[str, ...] = option(("taylor", "moreau"), "the method variants: "
                                      + "; ".join(f"{n} = {m} {o}" for n, (m, o) in VARIANTS.items() if o),
                                      choices=VARIANT_NAMES)
    arithmetic: Tuple[str, ...] = option(("rounding", "fp32-accumulate"), "how the 16-bit runs compute",
                                         choices=ARITHMETIC)
    seeds: Tuple[int, ...] = option((0, 1, 2), "calibration seeds", nonnegative)
    layers: str = option("all", "the pruned layers: all, or the paper's middle layers scaled to the model",
                         choices=("all", "middle"))
    structure: str = option("groups", "what is removed: each layer's heads and MLP channels, or hidden channels "
                            "(every layer)", choices=("groups", "hidden"))
    ratios: Tuple[float, ...] = option((0.2,), "share of all blocks' groups removed", fraction)
    nsamples: int = option(10, "calibration windows per seed", at_least_one)
    seqlen: int = option(128, "calibration window length", at_least_one)
    eval_tokens: int = option(4096, "evaluation tokens", at_least_one)
    eval_seqlen: int = option(128, "evaluation window length", at_least_one)
    smoothgrad_passes: int = option(10, "SmoothGrad's K (paper: 100)", at_least_one)
    noise_floor: bool = option(True, "prune once more in bf16 with the next noise seed (methods with noise; +50% "
                               "time)")
    cross: bool = option(False, "evaluate each pruned model in bf16 and fp16 too (ppl_cross, the 2 x 2 of pruned in x "
                         "evaluated in); otherwise once, in fp32")
    noise_formats: Tuple[str, ...] = option(("bfloat16",), "the formats the noise floor prunes once more in (with "
                                            "noise_floor): two noise draws of one format, their agreement, rank "
                                            "correlation and perplexity difference", choices=tuple(FORMATS))
    eta_sweep: Optional[Tuple[float, ...]] = option(None, "only a MoreauPruner-GS η sweep: these η against η = 0 "
                                                    "(bf16, rounding, the first seed and ratio)", positive)

    def check_options(self) -> None:
        if self.structure == "hidden" and (self.layers != "all" or self.eta_sweep is not None):
            raise ValueError("option structure of study 'robustness': hidden removes hidden channels in every layer; "
                             "it takes layers 'all' and no eta_sweep")

    def output_path(self, output):
        path = super().output_path(output)
        return os.path.splitext(path)[0] + "-eta-sweep.json" if self.eta_sweep is not None else path

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        scores_dir = os.path.splitext(path)[0].removesuffix("-eta-sweep") + ".scores"
        os.makedirs(scores_dir, exist_ok=True)
        write_text(os.path.join(scores_dir, ".gitignore"), "*\n")
        tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=self.eval_tokens)
        return {"model": model, "tokenizer": tokenizer, "tokens": tokens, "scores": scores_dir}

    def protocol(self, context):
        tokens = context["tokens"]
        settings = {"calibration": f"{self.nsamples} x {self.seqlen} tokens of emma",
                    "evaluation": f"first {tokens.numel() // self.eval_seqlen * self.eval_seqlen} tokens of "
                                  f"pride_and_prejudice, {self.eval_seqlen}-token windows",
                    "smoothgrad_passes": self.smoothgrad_passes}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        if self.eta_sweep is not None:
            settings.update(eta_sweep=list(self.eta_sweep), seed=self.seeds[0], layers=self.layers,
                            ratio=self.ratios[0])
        return settings

    def arms(self, context):
        if self.eta_sweep is not None:
            yield Arm("eta-sweep", f"eta sweep {', '.join(map(str, self.eta_sweep))}")
            return
        for seed in self.seeds:
            for ratio, arithmetic, method in itertools.product(self.ratios, self.arithmetic, self.methods):
                yield Arm((method, arithmetic, self.layers, ratio, self.structure, seed),
                          f"{method} {arithmetic} {self.structure} {self.layers} {ratio:g} seed {seed}")

    def row_key(self, row):
        return _run_key(row)

    def done(self, result, arm):
        return bool(result.get("eta_sweep")) if arm.key == "eta-sweep" else super().done(result, arm)

    def record(self, result, arm, row):
        if arm.key == "eta-sweep":
            result["eta_sweep"] = row
        else:
            super().record(result, arm, row)

    def _method(self, run, n_layers):
        """(method, ratio within the pruned layers, options) of the arm of ``run``."""
        first, last, layer_ratio = layer_protocol(run["layers"], run["overall_ratio"], n_layers)
        name, options = VARIANTS[run["method"]]
        options = {**options, "first_layer": first, "last_layer": last} if run["structure"] == "groups" \
            else {**options, "structure": "hidden"}
        if name == "smoothgrad":
            options["passes"] = self.smoothgrad_passes
        return name, layer_ratio, options

    def _against_reference(self, context, run):
        """:func:`against_arithmetic` of a native run and the fp32-accumulate run of its settings and seed."""
        model = context["model"]
        calib = self._calibration(context, run["seed"])
        name, layer_ratio, options = self._method(run, model.config.num_hidden_layers)
        stores = {arithmetic: ScoreStore(_arm_scores_dir(context["scores"], {**run, "arithmetic": arithmetic}), model,
                                         calib, arithmetic, BATCH_SIZE) for arithmetic in ("native", REFERENCE)}
        return against_arithmetic(model, name, layer_ratio, calib, method_options("native", options), stores)

    def _calibration(self, context, seed):
        return data.calibration_samples(context["tokenizer"], "emma", nsamples=self.nsamples, seqlen=self.seqlen,
                                        seed=seed)

    def run_arm(self, context, arm, row, checkpoint):
        model, n_layers = context["model"], context["model"].config.num_hidden_layers
        if arm.key == "eta-sweep":
            first, last, layer_ratio = layer_protocol(self.layers, self.ratios[0], n_layers)
            sweep = eta_sweep(model, self.eta_sweep, layer_ratio, self._calibration(context, self.seeds[0]),
                              first_layer=first, last_layer=last)
            return {**sweep, "seed": self.seeds[0], "layers": self.layers}
        method, arithmetic, layers, ratio, structure, seed = arm.key
        run = {"method": method, "arithmetic": arithmetic, "layers": layers, "overall_ratio": ratio, "seed": seed,
               "structure": structure}
        name, layer_ratio, options = self._method(run, n_layers)
        start = time.perf_counter()
        report = study(model, name, layer_ratio, self._calibration(context, seed), context["tokens"],
                       eval_seqlen=self.eval_seqlen, arithmetic=arithmetic, cross=self.cross, keep_scores=True,
                       noise_control=self.noise_floor, noise_formats=self.noise_formats, progress=False,
                       scores_dir=_arm_scores_dir(context["scores"], run), **options)
        report["method"] = method
        save_scores(_scores_path(context["scores"], run, seed), report)
        del report["scores"], report["groups"]
        run.update(report, wall_s=round(time.perf_counter() - start, 1))
        return run

    def describe(self, row):
        if "rows" in row:  # the η sweep
            return "agreement with η = 0: " + ", ".join(f"{r['eta']:g} {r['agreement']:.4f}" for r in row["rows"])
        floor = row["noise_floor"]
        return (f"agreement {row['agreement']:.4f}" + (f" (noise floor {floor['agreement']:.4f})" if floor else "")
                + "".join(f", noise floor ppl_diff {name} {diff:.2f}" for name, diff in _noise_ppl(row).items())
                + f", rho {_rho_channels(row['spearman']):.4f}, ppl {row['ppl_bf16']:.2f} / {row['ppl_fp16']:.2f} "
                f"({row['wall_s']} s)")

    def complete(self, result, context):
        runs = result["runs"]
        runs.sort(key=lambda run: run["seed"])  # stable: each seed's runs in the order they were made
        result["environment"] = environment_record(torch.device("cpu"))
        result["calibration_floor"] = calibration_floor(runs, context["scores"], result.get("calibration_floor"))
        for run in runs:
            if run["arithmetic"] == "native" and run.get("against") is None:
                run["against"] = self._against_reference(context, run)
        return result

    def markdown(self, result):
        return markdown(result)
