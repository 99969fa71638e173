"""MoE experts stored as fused 3-D parameters (transformers 5: ``experts.gate_up_proj`` and
``experts.down_proj``, in one of the :data:`LAYOUTS`: Mixtral's, gpt-oss's, Llama 4's), presented to the
linear-layer methods as one nn.Linear per expert matrix.

Within :func:`expert_linears` a block's fused experts module is replaced by an :class:`ExpertLinears`
whose linears (``mlp.experts.3.gate_up_proj``, ...) hold views of the fused weights (a transposed
layout's: contiguous copies, written back when it ends), so pruning them prunes the fused parameters,
and whose forward calls each expert's linears on exactly the tokens the
router sends to it: hooks on a linear see that expert's tokens, and the block's outputs are unchanged.
That forward is :class:`RoutedExperts`', shared with :class:`pyprune.nn.sparse.SparseExperts` (the experts
held as one SparseLinear per expert matrix after :func:`pyprune.nn.sparsify_`).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .anatomy import ROUTER_NAMES

#: the fused matrices of an experts module, as transformers names them
MATRICES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertLayout:
    """How a fused experts module stores its expert matrices and how its caller hands it the tokens.
    Each expert computes ``down(gate(gate_up(x)))``: ``gate`` is the module's own ``_apply_gate``
    where it has one (gpt-oss: gate and up interleaved and clamped, ``(up + 1)·g·σ(αg)``), else
    ``act_fn(gate) · up`` on the two halves."""

    name: str
    transposed: bool  #: matrices stored [E, in, out], applied as ``x @ W`` (else [E, out, in], ``x @ Wᵀ``)
    biases: bool      #: with ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H]
    prescaled: bool   #: called on [E·T, H], every token once per expert times its routing score (0: not routed),
    #: instead of (hidden_states, top_k_index, top_k_weights)
    interleaved: bool = False  #: gate_up's gate and up entries alternate (gpt-oss), else gate half then up half

    @property
    def parameters(self) -> Tuple[str, ...]:
        return MATRICES + (tuple(f"{matrix}_bias" for matrix in MATRICES) if self.biases else ())

    def shapes(self, experts: int, hidden: int, intermediate: int) -> Dict[str, Tuple[int, ...]]:
        gate_up, down = (hidden, 2 * intermediate), (intermediate, hidden)
        if not self.transposed:
            gate_up, down = gate_up[::-1], down[::-1]
        return {"gate_up_proj": (experts, *gate_up), "down_proj": (experts, *down),
                "gate_up_proj_bias": (experts, 2 * intermediate), "down_proj_bias": (experts, hidden)}

    def channel_dim(self, name: str) -> Optional[int]:
        """The dimension of fused parameter ``name`` ([E, ...]) that indexes the intermediate channels
        (gate_up's: both halves), None for ``down_proj_bias`` (it indexes the hidden size)."""
        return {"gate_up_proj": 2 if self.transposed else 1, "down_proj": 1 if self.transposed else 2,
                "gate_up_proj_bias": 1}.get(name)

    def channel_positions(self, name: str, channels: Tensor, intermediate: int) -> Tensor:
        """The positions along :meth:`channel_dim` of channels ``channels`` ([E, k]) in parameter
        ``name``: themselves in ``down_proj``; their gate and up entries in ``gate_up_proj`` (and its
        bias), ``(2c, 2c + 1)`` interleaved or ``(c, I + c)`` halves."""
        if name == "down_proj":
            return channels
        if self.interleaved:
            return torch.stack((2 * channels, 2 * channels + 1), dim=-1).flatten(-2)
        return torch.cat((channels, intermediate + channels), dim=-1)

    def channel_totals(self, name: str, values: Tensor, intermediate: int) -> Tensor:
        """``values`` shaped like parameter ``name`` summed into its intermediate channels: [E, I]
        (a channel's gate and up entries together)."""
        experts = values.shape[0]
        totals = values.movedim(self.channel_dim(name), -1).reshape(experts, -1, values.shape[self.channel_dim(name)])
        totals = totals.sum(dim=1)
        if name == "down_proj":
            return totals
        return totals.view(experts, intermediate, 2).sum(-1) if self.interleaved \
            else totals.view(experts, 2, intermediate).sum(1)

    def intermediate(self, fused: nn.Module) -> int:
        """The channels of each expert of ``fused``."""
        return fused.down_proj.shape[self.channel_dim("down_proj")]

    def weight(self, fused: nn.Module, matrix: str, index: int) -> Tensor:
        """Expert ``index``'s ``matrix`` as an [out, in] view of the fused parameter."""
        weight = getattr(fused, matrix).detach()[index]
        return weight.t() if self.transposed else weight

    def stacked(self, weights: Sequence[Tensor]) -> Tensor:
        """The fused parameter's values from every expert's [out, in] weight."""
        return torch.stack([w.t() if self.transposed else w for w in weights])


#: the layouts pyprune reproduces, with transformers' ``use_experts_implementation`` flags where the
#: module has them
LAYOUTS = (
    (ExpertLayout("mixtral", transposed=False, biases=False, prescaled=False),  # Mixtral, Qwen2/3/3.5-MoE
     {"is_transposed": False, "has_bias": False, "is_concatenated": True}),
    (ExpertLayout("gpt_oss", transposed=True, biases=True, prescaled=False, interleaved=True),
     {"is_transposed": True, "has_bias": True, "is_concatenated": False}),
    (ExpertLayout("llama4", transposed=True, biases=False, prescaled=True),
     {"is_transposed": True, "has_bias": False, "is_concatenated": True}),
)
_SUPPORTED = ("Mixtral / Qwen-MoE (gate_up_proj [E, 2I, H], down_proj [E, H, I], called with the top-k indices and "
              "weights), gpt-oss (the same call, [E, H, 2I] and [E, I, H] with biases, its own _apply_gate) and "
              "Llama 4 ([E, H, 2I] and [E, I, H], called on tokens pre-scaled by the router)")


def _inputs(module: nn.Module) -> int:
    """The number of tensors the module's forward takes (3: routed, 1: pre-scaled)."""
    try:
        return len(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return -1


def expert_layout(module: nn.Module) -> Tuple[Optional[ExpertLayout], str]:
    """(the layout of a fused experts module, "") or (None, why pyprune does not reproduce it)."""
    own = dict(module.named_parameters(recurse=False))
    if not set(MATRICES) <= set(own) or own["gate_up_proj"].dim() != 3:
        return None, f"its parameters are {sorted(own)}"
    for flag, value in (("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(module, flag, value) != value:
            return None, f"its {flag} is {getattr(module, flag)}"
    if not (callable(getattr(module, "_apply_gate", None)) or callable(getattr(module, "act_fn", None))):
        return None, "it has neither _apply_gate nor act_fn"
    experts, first, second = own["gate_up_proj"].shape
    for layout, flags in LAYOUTS:
        hidden, double = (first, second) if layout.transposed else (second, first)
        shapes = layout.shapes(experts, hidden, double // 2)
        if set(own) == set(layout.parameters) and double % 2 == 0 \
                and all(tuple(own[name].shape) == shapes[name] for name in own) \
                and all(getattr(module, flag, value) == value for flag, value in flags.items()) \
                and _inputs(module) == (1 if layout.prescaled else 3):
            return layout, ""
    flags = {flag: getattr(module, flag) for flag in LAYOUTS[0][1] if hasattr(module, flag)}
    return None, (f"its parameters {', '.join(f'{n} {tuple(p.shape)}' for n, p in sorted(own.items()))}"
                  f"{f', flags {flags}' if flags else ''} and a forward of {_inputs(module)} inputs match no layout")


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
        layout, problem = expert_layout(module)
        if layout is not None:
            found[name] = module
        elif strict:
            raise ValueError(f"{where}.{name} ({type(module).__name__}) is a fused experts module pyprune cannot "
                             f"prune: {problem}; supported: {_SUPPORTED}")
    return found


def routers(block: nn.Module) -> Dict[str, nn.Module]:
    """The router of every fused experts module of ``block`` (:func:`fused_experts`), by the experts
    module's name: its sibling named ``gate`` or ``router`` (Mixtral's and Qwen-MoE's top-k router,
    gpt-oss's with a bias, Llama 4's nn.Linear), whose weight has one row per expert."""
    found = {}
    for name, experts in fused_experts(block).items():
        parent_name = name.rpartition(".")[0]
        parent = block.get_submodule(parent_name) if parent_name else block
        router = next((getattr(parent, own) for own in ROUTER_NAMES if isinstance(getattr(parent, own, None), nn.Module)),
                      None)
        count = experts.gate_up_proj.shape[0]
        if router is None or getattr(router, "weight", None) is None or router.weight.shape[0] != count:
            raise ValueError(f"{name} ({type(experts).__name__}) has no router beside it: pyprune looks for a module "
                             f"named {' or '.join(ROUTER_NAMES)} whose weight has one row per expert ({count})")
        found[name] = router
    return found


class _BiasedLinear(nn.Linear):
    """An expert matrix with its bias, added after the product as the fused module adds it."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight) + self.bias


def _view_linear(fused: nn.Module, layout: ExpertLayout, matrix: str, index: int) -> nn.Linear:
    """An nn.Linear whose weight (and bias) are views of expert ``index``'s part of the fused parameters;
    a transposed layout's weight is a contiguous copy instead (optimisers and kernels want one), which
    :meth:`ExpertLinears.write_back` copies back."""
    weight, grad = layout.weight(fused, matrix, index).contiguous(), getattr(fused, matrix).requires_grad
    linear = (_BiasedLinear if layout.biases else nn.Linear)(weight.shape[1], weight.shape[0], bias=layout.biases,
                                                             device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=grad)
    if layout.biases:
        linear.bias = nn.Parameter(getattr(fused, f"{matrix}_bias").detach()[index], requires_grad=grad)
    return linear


class RoutedExperts(nn.ModuleList):
    """Experts as one module per expert holding linears ``gate_up_proj`` and ``down_proj`` (any
    module computing ``x @ Wᵀ (+ b)``: nn.Linear, SparseLinear), run as the fused module ``fused``
    runs them (transformers' eager experts loop, in its :class:`ExpertLayout`): each expert's linears
    on exactly the tokens routed to it, ``down(gate(gate_up(x)))``, weighted by the expert's routing
    score and summed per token; for a pre-scaled layout, on the rows of its share of the input that
    the router did not scale to zero, each row's output in its place."""

    def __init__(self, experts, fused: nn.Module, layout: ExpertLayout):
        super().__init__(experts)
        object.__setattr__(self, "layout", layout)  # neither is a child: the list holds experts only
        object.__setattr__(self, "_fused", fused)
        object.__setattr__(self, "_observers", [])

    def gate(self, gate_up: Tensor) -> Tensor:
        """The fused module's ``_apply_gate``, else ``act_fn(gate) · up`` on the halves."""
        apply = getattr(self._fused, "_apply_gate", None)
        if apply is not None:
            return apply(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._fused.act_fn(gate) * up

    def expert(self, index: int, x: Tensor) -> Tensor:
        return self[index].down_proj(self.gate(self[index].gate_up_proj(x)))

    def contributions(self, hidden_states: Tensor, top_k_index: Optional[Tensor] = None,
                      top_k_weights: Optional[Tensor] = None) -> Iterator[Tuple[int, Tensor, Tensor]]:
        """(expert, rows, contribution) for every expert some token is routed to: the rows of the flat
        output ([tokens, H], or [E·T, H] for a pre-scaled layout) it adds to, and its output on them
        as the layer sums it: ``down(gate(gate_up(x)))`` times the routing weight, or for a pre-scaled
        layout on the router-scaled rows of its share of the input."""
        if self.layout.prescaled:
            if top_k_index is not None or top_k_weights is not None:
                raise TypeError(f"{self.layout.name} experts are called on pre-scaled tokens alone")
            rows = hidden_states.view(len(self), -1, hidden_states.shape[-1])
            for index in range(len(self)):
                with torch.no_grad():
                    token = rows[index].any(dim=-1).nonzero()[:, 0]
                if token.numel():
                    yield index, index * rows.shape[1] + token, self.expert(index, rows[index, token])
            return
        if top_k_index is None or top_k_index.is_floating_point() or not top_k_weights.is_floating_point():
            raise TypeError("fused experts called with (hidden_states, top_k_index, top_k_weights) of dtypes "
                            f"{hidden_states.dtype}, {getattr(top_k_index, 'dtype', None)}, "
                            f"{getattr(top_k_weights, 'dtype', None)}; pyprune reproduces experts called with "
                            "integer expert indices and float routing weights in that order")
        with torch.no_grad():
            routed = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit[:, 0].tolist():
            if index == len(self):
                continue
            position, token = torch.where(routed[index])
            yield index, token, self.expert(index, hidden_states[token]) * top_k_weights[token, position, None]

    def forward(self, hidden_states: Tensor, top_k_index: Optional[Tensor] = None,
                top_k_weights: Optional[Tensor] = None) -> Tensor:
        """The fused module's output: every expert's :meth:`contributions` summed into its rows, each
        passed first to the :meth:`observed` callbacks."""
        final = torch.zeros_like(hidden_states).view(-1, hidden_states.shape[-1])
        for index, rows, out in self.contributions(hidden_states, top_k_index, top_k_weights):
            for observer in self._observers:
                observer(index, out)
            final.index_add_(0, rows, out.to(final.dtype))
        return final.view_as(hidden_states)

    @contextmanager
    def observed(self, observer) -> Iterator[None]:
        """Within: ``observer(expert, contribution)`` sees each expert's weighted output on its tokens
        ([routed tokens, H]) in every forward (REAP's saliency, :mod:`pyprune.methods.reap`)."""
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)


def experts_of(linears) -> nn.Module:
    """One expert module holding the linears {matrix: module} as its children."""
    expert = nn.Module()
    for matrix, linear in linears.items():
        setattr(expert, matrix, linear)
    return expert


class ExpertLinears(RoutedExperts):
    """A fused experts module as a :class:`RoutedExperts` whose nn.Linear weights (and biases) are
    views of the fused ones (pruning them prunes the fused parameters), or for a transposed layout
    contiguous copies that :meth:`write_back` puts into the fused parameters."""

    def __init__(self, fused: nn.Module):
        layout, problem = expert_layout(fused)
        if layout is None:
            raise ValueError(f"{type(fused).__name__} is a fused experts module pyprune cannot prune: {problem}")
        super().__init__([experts_of({matrix: _view_linear(fused, layout, matrix, index) for matrix in MATRICES})
                          for index in range(fused.gate_up_proj.shape[0])], fused, layout)

    @torch.no_grad()
    def write_back(self, fused: nn.Module) -> None:
        """Copy into ``fused`` every expert weight (and bias) a method replaced instead of changing it in place."""
        for index, expert in enumerate(self):
            for matrix in MATRICES:
                linear = getattr(expert, matrix)
                targets = [(self.layout.weight(fused, matrix, index), linear.weight)]
                if self.layout.biases:
                    targets.append((getattr(fused, f"{matrix}_bias")[index], linear.bias))
                for target, tensor in targets:
                    if tensor.data_ptr() != target.data_ptr():
                        target.copy_(tensor)


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
