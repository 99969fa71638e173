"""MoE experts stored as fused 3-D parameters (transformers 5: ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I]), presented to the linear-layer methods as one nn.Linear per expert matrix.

Within :func:`expert_linears` a block's fused experts module is replaced by an :class:`ExpertLinears`
whose linears (``mlp.experts.3.gate_up_proj``, ...) hold views of the fused weights, so pruning them
prunes the fused parameters, and whose forward calls each expert's linears on exactly the tokens the
router sends to it: hooks on a linear see that expert's tokens, and the block's outputs are unchanged.
That forward is :class:`RoutedExperts`', shared with :class:`pyprune.nn.sparse.SparseExperts` (the experts
held as one SparseLinear per expert matrix after :func:`pyprune.nn.sparsify_`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch
from torch import Tensor, nn

#: the fused matrices of an experts module, as transformers names them
MATRICES = ("gate_up_proj", "down_proj")
#: the layout flags transformers' ``use_experts_implementation`` sets on an experts module, with the values
#: (also the defaults of an undecorated module) whose computation :class:`ExpertLinears` reproduces
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False}
_SUPPORTED = ("3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I] without bias, computing "
              "down(act_fn(gate) * up) per expert weighted by its routing score (Mixtral, Qwen2-MoE)")


def _unsupported(module: nn.Module) -> Optional[str]:
    """Why pyprune does not reproduce this fused experts module's computation; None when it does."""
    fused = {name: p for name, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if set(fused) != set(MATRICES) or len(list(module.parameters(recurse=False))) != len(MATRICES):
        return f"its parameters are {sorted(name for name, _ in module.named_parameters(recurse=False))}"
    (experts, double, hidden), down = fused["gate_up_proj"].shape, fused["down_proj"].shape
    if double % 2 or tuple(down) != (experts, hidden, double // 2):
        return f"gate_up_proj {tuple(fused['gate_up_proj'].shape)} does not match down_proj {tuple(down)}"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    layout = {flag: getattr(module, flag, default) for flag, default in _LAYOUT.items()}
    if layout != _LAYOUT:
        return f"its layout is {layout}"
    return None


def holds_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds 3-D parameters of its own and is not a convolution (a depthwise
    ``Conv1d`` of a linear-attention, Mamba2 or short-conv mixer holds a 3-D kernel, not experts)."""
    return not isinstance(module, nn.modules.conv._ConvNd) and \
        any(p.dim() == 3 for p in module.parameters(recurse=False))


def fused_experts(block: nn.Module, strict: bool = True, where: str = "block") -> Dict[str, nn.Module]:
    """The modules of ``block`` holding experts as fused 3-D parameters (:func:`holds_fused_experts`),
    by name inside the block. One whose computation pyprune does not reproduce raises ValueError
    (``strict``, naming it under ``where``) or is left out (it stays dense, and the prune report
    says so)."""
    found = {}
    for name, module in block.named_modules():
        if not name or not holds_fused_experts(module):
            continue
        problem = _unsupported(module)
        if problem is None:
            found[name] = module
        elif strict:
            raise ValueError(f"{where}.{name} ({type(module).__name__}) is a fused experts module pyprune cannot "
                             f"prune: {problem}; supported: {_SUPPORTED}")
    return found


def _view_linear(weight: Tensor, requires_grad: bool) -> nn.Linear:
    """An nn.Linear whose weight is ``weight`` itself (a view of a fused parameter), without bias."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    return linear


class RoutedExperts(nn.ModuleList):
    """Experts as one module per expert holding linears ``gate_up_proj`` and ``down_proj`` (any
    module computing ``x @ Wᵀ``: nn.Linear, SparseLinear), run as the fused module runs them
    (transformers' eager experts loop): each expert's linears on exactly the tokens routed to it,
    ``down(act_fn(gate) * up)`` weighted by the expert's routing score and summed per token."""

    def __init__(self, experts, act_fn):
        super().__init__(experts)
        object.__setattr__(self, "act_fn", act_fn)  # not a child: the list holds experts only

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if top_k_index.is_floating_point() or not top_k_weights.is_floating_point():
            raise TypeError("fused experts called with (hidden_states, top_k_index, top_k_weights) of dtypes "
                            f"{hidden_states.dtype}, {top_k_index.dtype}, {top_k_weights.dtype}; pyprune reproduces "
                            "experts called with integer expert indices and float routing weights in that order")
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            routed = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit[:, 0].tolist():
            if index == len(self):
                continue
            position, token = torch.where(routed[index])
            gate, up = self[index].gate_up_proj(hidden_states[token]).chunk(2, dim=-1)
            out = self[index].down_proj(self.act_fn(gate) * up) * top_k_weights[token, position, None]
            final.index_add_(0, token, out.to(final.dtype))
        return final


def experts_of(linears) -> nn.Module:
    """One expert module holding the linears {matrix: module} as its children."""
    expert = nn.Module()
    for matrix, linear in linears.items():
        setattr(expert, matrix, linear)
    return expert


class ExpertLinears(RoutedExperts):
    """A fused experts module as a :class:`RoutedExperts` whose nn.Linear weights are views of the
    fused ones (pruning them prunes the fused parameters)."""

    def __init__(self, fused: nn.Module):
        super().__init__([experts_of({matrix: _view_linear(getattr(fused, matrix).detach()[index],
                                                           getattr(fused, matrix).requires_grad)
                                      for matrix in MATRICES})
                          for index in range(fused.gate_up_proj.shape[0])], fused.act_fn)

    @torch.no_grad()
    def write_back(self, fused: nn.Module) -> None:
        """Copy into ``fused`` every expert weight a method replaced instead of changing it in place."""
        for index, expert in enumerate(self):
            for matrix in MATRICES:
                target, weight = getattr(fused, matrix)[index], getattr(expert, matrix).weight
                if weight.data_ptr() != target.data_ptr():
                    target.copy_(weight)


@contextmanager
def expert_linears(block: nn.Module, strict: bool = True, where: str = "block") -> Iterator[nn.Module]:
    """Within: every fused experts module of ``block`` (:func:`fused_experts`) replaced by its
    :class:`ExpertLinears`, so :func:`pyprune.nn.anatomy.block_linears` lists every expert matrix;
    after: the fused modules back in place, holding the expert weights as the linears left them."""
    swapped = []
    try:
        for name, fused in fused_experts(block, strict, where).items():
            parent_name, _, own = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            view = ExpertLinears(fused)
            setattr(parent, own, view)
            swapped.append((parent, own, fused, view))
        yield block
    finally:
        for parent, own, fused, view in reversed(swapped):
            view.write_back(fused)
            setattr(parent, own, fused)
