"""REAP (Lasby et al., 2025, "REAP: Router-weighted Expert Activation Pruning"): remove whole experts
of every MoE block, those whose router-weighted outputs are smallest on the calibration tokens.

The saliency of expert j of a block is the mean, over the calibration tokens the router sends to j
(X_j), of its gate value times the norm of its output:

    S_j = 1/|X_j| · Σ_{x ∈ X_j} g_j(x) · ‖f_j(x)‖₂,

with g_j(x) the routing weight the block multiplies f_j(x) by (the top-k weights as the family
computes them: Mixtral's and Qwen-MoE's softmax, renormalised over the top-k where the family does,
gpt-oss's softmax over the top-k logits). It is the norm of the expert's contribution to the block's
output, which is how it is measured here (:meth:`pyprune.nn.experts.RoutedExperts.contributions`);
for Llama 4, whose router scales each token before its expert (σ of the logit), that contribution is
f_j(g_j(x)·x). An expert no token reaches scores 0.

In every MoE block the ``structured r`` share of the experts with the lowest saliency goes (keep
``kept_count(experts, r)``, at least the router's top-k; ties keep the lower index), the same count
in every block. Every block's saliency comes from the dense model in one block-wise pass
(:func:`pyprune.runtime.engine.run_blockwise`, its hidden states passed on unpruned); the experts
are removed after (:func:`pyprune.nn.compact.keep_experts_`): their slices of the fused parameters
and their router rows, so the router's top-k and renormalisation choose among the kept experts, and
the config's expert count, so plain ``from_pretrained`` reads the saved model. Shared experts,
attention and everything else stay as they are.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
from torch import Tensor, nn

from ..nn.compact import keep_experts_
from ..nn.experts import RoutedExperts, fused_experts, routers
from ..nn.families import experts_in_config
from ..ops.conventions import kept_count
from ..patterns import Structured
from ..runtime import distributed, engine
from .base import Method


def kept_experts(saliency: Tensor, count: int) -> Tensor:
    """The ``count`` experts of highest saliency (ties: the lower index), ascending."""
    return torch.sort(saliency.double().cpu(), descending=True, stable=True).indices[:count].sort().values


class REAP(Method):
    name = "reap"
    patterns = (Structured,)
    structured_moe = True
    data_parallel = True  # the saliency sums and token counts are summed over the ranks
    offload_refusal = "removing experts changes the shapes of the blocks it keeps on disk"

    def experts_kept(self, experts: int, top_k: int, ratio: float, where: str) -> int:
        """Experts each MoE block keeps at ``ratio``; ValueError when none would go or fewer than the
        router's ``top_k`` would stay."""
        kept = kept_count(experts, ratio)
        if kept >= experts or kept < top_k:
            low, high = 0.5 / experts, 1 - (top_k - 0.5) / experts
            raise ValueError(f"method 'reap': ratio {ratio} of the {experts} experts of {where} keeps {kept}; give a "
                             f"ratio that removes at least one and keeps the router's top-{top_k} "
                             f"(ratio in ({low:.4g}, {high:.4g}])")
        return kept

    def check_config(self, config, pattern) -> None:
        """Refused from the config: a dense model, or a ratio that keeps all experts or fewer than
        ``num_experts_per_tok``."""
        super().check_config(config, pattern)
        if config is None:
            return
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = experts_in_config(text)
        if not experts:
            raise ValueError(f"method 'reap' removes experts of MoE blocks; {type(config).__name__} has none "
                             "(num_local_experts / num_experts)")
        top_k = getattr(text, "num_experts_per_tok", 1)
        self.experts_kept(experts, top_k if isinstance(top_k, int) else 1, float(pattern.ratio),
                        type(config).__name__)

    def check(self, model: nn.Module, pattern) -> None:
        super().check(model, pattern)
        self.check_config(getattr(model, "config", None), pattern)
        prefix = engine.block_prefix(model)
        found = 0
        for index, block in enumerate(engine.decoder_blocks(model)):
            where = f"{prefix}.{index}"
            for name, router in routers(block).items():
                experts = fused_experts(block, where=where)[name].gate_up_proj.shape[0]
                self.experts_kept(experts, getattr(router, "top_k", 1), float(pattern.ratio), f"{where}.{name}")
                found += 1
        if not found:
            raise ValueError(f"method 'reap' removes experts of MoE blocks; {type(model).__name__} has no fused "
                             "experts module")

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        saliency: Dict = {}

        def observe(ctx) -> None:
            views = {name: module for name, module in ctx.block.named_modules() if isinstance(module, RoutedExperts)}
            sums = {name: torch.zeros(len(view), dtype=torch.float64) for name, view in views.items()}
            tokens = {name: torch.zeros(len(view), dtype=torch.float64) for name, view in views.items()}

            def add(name: str):
                def observer(expert: int, contribution: Tensor) -> None:
                    sums[name][expert] += contribution.detach().float().norm(dim=-1).double().sum().cpu()
                    tokens[name][expert] += contribution.shape[0]
                return observer

            with torch.no_grad(), contextlib.ExitStack() as stack:
                for name, view in views.items():
                    stack.enter_context(view.observed(add(name)))
                ctx.next_inputs = ctx.forward()
            for name in views:
                total, count = distributed.all_reduce_(sums[name]), distributed.all_reduce_(tokens[name])
                saliency[(ctx.index, name)] = (total / count.clamp(min=1), count)

        engine.run_blockwise(model, calib, observe, batch_size=batch_size, progress=progress, desc=self.name)
        keep: Dict = {}
        modules: List[Dict] = []
        for (index, name), (scores, count) in saliency.items():
            experts = scores.numel()
            router = routers(engine.decoder_blocks(model)[index])[name]
            kept = kept_experts(scores, self.experts_kept(experts, getattr(router, "top_k", 1), float(pattern.ratio),
                                                        f"{index}.{name}"))
            keep[(index, name)] = kept
            removed = sorted(set(range(experts)) - set(kept.tolist()))
            modules.append({"layer": index, "module": name, "saliency": scores.tolist(),
                            "routed_tokens": count.long().tolist(), "removed_experts": removed})
        keep_experts_(model, keep)
        experts = next(iter(saliency.values()))[0].numel()
        return {"experts": [experts, len(next(iter(keep.values())))], "experts_modules": modules,
                "config_compatible": True}
