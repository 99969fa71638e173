"""Robustness of a structured pruning criterion to the weights' 16-bit format (MoreauPruner Table 1).

The same model is pruned twice, once with its weights held in bfloat16 and once in float16; each
run computes its gradients/scores and its perplexity in its own format. A robust criterion
removes the same groups in both and gives both pruned models the same perplexity:

* ``agreement``: of the groups (query heads and MLP channels, per layer) pruned in the bf16 run,
  the fraction pruned in the fp16 run too (both runs remove equally many; 1.0 = identical);
* ``ppl_diff``: |perplexity(bf16 run) − perplexity(fp16 run)|, the paper's "Diff".

Arithmetic. The papers' effect lives in low-precision arithmetic, so neither run is done in fp32.
``arithmetic="native"`` runs torch's 16-bit kernels throughout. ``"fp32-accumulate"`` (the
default) multiplies the 16-bit weights and activations of every linear layer with fp32
accumulation and rounds the result to the 16-bit format, as GPU tensor cores do; everything else
(norms, attention, the loss) stays in the 16-bit format. On CPUs torch's fp16 matmuls are tens of
times slower than bf16, which makes ``native`` impractical there (a gradient pass over 10×128
tokens of SmolLM2-135M: 213 s in fp16 against 5 s in bf16); the report says which was used.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Dict, Iterator, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import pruning
from .eval import perplexity
from .patterns import Structured

FORMATS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
ARITHMETIC = ("fp32-accumulate", "native")

Group = Tuple[int, str, int]


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


@contextlib.contextmanager
def linear_arithmetic(arithmetic: str) -> Iterator[None]:
    """Inside the block the linear layers compute as ``arithmetic`` says (see the module
    docstring). Scoped to the block and to the calling thread: no class is patched (a torch
    function mode), and everything is as before on exit, also after an exception."""
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETIC)}; got {arithmetic!r}")
    with (_Fp32Accumulate() if arithmetic == "fp32-accumulate" else contextlib.nullcontext()):
        yield


def pruned_groups(report: Dict) -> Set[Group]:
    """The (layer, "head" | "channel", index) groups a structured pruning report removed."""
    groups: Set[Group] = set()
    for entry in report["structure"]:
        groups.update((entry["layer"], "head", i) for i in entry.get("pruned_heads", ()))
        groups.update((entry["layer"], "channel", i) for i in entry.get("pruned_channels", ()))
    return groups


def agreement(first: Set[Group], second: Set[Group]) -> float:
    """|first ∩ second| / max(|first|, |second|): 1.0 when both prune the same groups (or none)."""
    largest = max(len(first), len(second))
    return 1.0 if largest == 0 else len(first & second) / largest


def study(model: nn.Module, method: str, ratio: float, calib: Tensor, eval_tokens: Tensor, *,
          eval_seqlen: int = 128, arithmetic: str = "fp32-accumulate", uniform: bool = False,
          batch_size: int = 8, progress: bool = True, **options) -> Dict:
    """Prune copies of ``model`` in bf16 and in fp16 with ``method`` at structured ``ratio`` and
    compare them (see the module docstring). ``model`` itself is not changed. Returns the report:
    ``method``, ``ppl_bf16``, ``ppl_fp16``, ``ppl_diff``, ``agreement`` at the top level, and the
    per-format runs with their sparsity and time."""
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETIC)}; got {arithmetic!r}")
    pattern = Structured(ratio, uniform=uniform)
    runs, groups = {}, {}
    for name, dtype in FORMATS.items():
        pruned = copy.deepcopy(model).to(dtype)
        with linear_arithmetic(arithmetic):
            report = pruning.prune(pruned, method, pattern, calib, batch_size=batch_size,
                                   progress=progress, **options)
            ppl = perplexity(pruned, eval_tokens, eval_seqlen, batch_size=batch_size, progress=progress)
        groups[name] = pruned_groups(report)
        runs[name] = {"perplexity": ppl, "sparsity": report["sparsity"], "time_s": report["time_s"],
                      "pruned_groups": len(groups[name])}
        options_used = report["options"]
        del pruned
    return {
        "method": method,
        "ppl_bf16": runs["bfloat16"]["perplexity"],
        "ppl_fp16": runs["float16"]["perplexity"],
        "ppl_diff": abs(runs["bfloat16"]["perplexity"] - runs["float16"]["perplexity"]),
        "agreement": agreement(groups["bfloat16"], groups["float16"]),
        "ratio": ratio,
        "arithmetic": arithmetic,
        "options": options_used,
        "runs": runs,
    }
