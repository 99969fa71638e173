"""SlicedLinear: evaluate a linear layer on kept channels only, without copying its weight.

Structured methods score a channel mask and want the model's loss under it before committing to
it (and to :mod:`pyprune.nn.compact`, which physically copies the kept rows/columns). A
SlicedLinear wraps the original layer (``base``, whose weight it shares) and index tensors and runs
:func:`pyprune.ops.sliced_linear`: its input holds the kept input channels, its output the kept
output channels. :func:`slice_mlp_channels_` applies that to a block's MLP,
:func:`slice_hidden_channels_` to a whole model's hidden dimension (DReSS: the model as it will be
after slicing, before slicing it; with :class:`SlicedEmbedding` and :class:`SlicedNorm`), and
:func:`unslice_` puts the original modules back; :func:`check_plain_linears` refuses a model
holding such layers (or SparseLinear ones) where nn.Linear is needed (pruning, LoRA).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from ..ops import _validate as check
from ..ops.linear import _sliced_linear
from .families import channel_rows
from .layout import ChannelView, check_block, hidden_index, hidden_stream, rescaled_norm_weight
from .sparse import SparseLinear


class SlicedLinear(ChannelView):
    """``base`` restricted to ``out_index`` rows and ``in_index`` columns (None keeps all)."""

    def __init__(self, base: nn.Linear, in_index: Optional[Tensor] = None,
                 out_index: Optional[Tensor] = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear; got {type(base).__name__}")
        device = base.weight.device
        in_index = check.index("in_index", in_index, base.in_features, "base's input features")
        out_index = check.index("out_index", out_index, base.out_features, "base's output features")
        self.base = base
        self.register_buffer("in_index", None if in_index is None else in_index.to(device).long(),
                             persistent=False)
        self.register_buffer("out_index", None if out_index is None else out_index.to(device).long(),
                             persistent=False)

    @property
    def in_features(self) -> int:
        return self.base.in_features if self.in_index is None else self.in_index.numel()

    @property
    def out_features(self) -> int:
        return self.base.out_features if self.out_index is None else self.out_index.numel()

    def forward(self, x: Tensor) -> Tensor:
        # The indices were checked once, here in __init__; the op's per-call index checks (unique,
        # min/max) would stall a GPU on every forward, so only x is checked.
        if x.shape[-1] != self.in_features or x.dtype != self.base.weight.dtype:
            raise ValueError(f"x must be [..., {self.in_features}] of dtype {self.base.weight.dtype}; "
                             f"got [..., {x.shape[-1]}] {x.dtype}")
        return _sliced_linear(x, self.base.weight, self.base.bias, self.in_index, self.out_index, False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def slice_mlp_channels_(block: nn.Module, keep: Tensor) -> None:
    """Run the MLP of ``block`` (any dense family: the rows of its input linears, each part of a
    fused gate_up, and the columns of its output linear) on the channels ``keep`` (indices or a
    bool mask) only, in place; the weights are shared, not copied. The same selection as
    :func:`pyprune.nn.keep_mlp_channels_`, undone by :func:`unslice_`."""
    sliced = [name for name, module in block.named_modules() if isinstance(module, SlicedLinear)]
    if sliced:
        raise TypeError(f"block holds SlicedLinear {sliced[0]} (already sliced? call unslice_ first)")
    family = check_block(block)
    keep = torch.as_tensor(keep)
    if keep.dtype == torch.bool:
        keep = keep.nonzero().flatten()
    out = block.get_submodule(family.mlp_out)
    for name, parts in channel_rows(family, out.in_features).items():
        _replace(block, name, SlicedLinear(block.get_submodule(name), out_index=torch.cat([p[keep] for p in parts])))
    _replace(block, family.mlp_out, SlicedLinear(out, in_index=keep))


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


class SlicedEmbedding(ChannelView):
    """``base``'s embeddings restricted to the hidden channels ``index`` (weight shared)."""

    def __init__(self, base: nn.Embedding, index: Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("index", index.to(base.weight.device).long(), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.base(ids).index_select(-1, self.index)


class SlicedNorm(ChannelView):
    """``base`` (an RMS norm over the hidden channels) run on the channels ``index`` only: its own
    forward with its weight (and bias) entries at ``index``, its multiplier (``offset`` + weight;
    Gemma's is 1 + w) times ``scale``, so its statistics are taken over those channels, as after
    :func:`pyprune.nn.keep_hidden_channels_` and a rescale of the norm by ``scale``."""

    def __init__(self, base: nn.Module, index: Tensor, scale: float = 1.0, offset: float = 0.0):
        super().__init__()
        self.base, self.scale, self.offset = base, float(scale), float(offset)
        self.register_buffer("index", index.to(base.weight.device).long(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        kept = {name: p.index_select(0, self.index) for name, p in self.base.named_parameters(recurse=False)}
        if self.scale != 1.0:
            kept["weight"] = rescaled_norm_weight(kept["weight"], self.scale, self.offset)
        return torch.func.functional_call(self.base, kept, (x,))


def slice_hidden_channels_(model: nn.Module, keep, norm_scale: Optional[Dict[str, float]] = None) -> None:
    """Run a causal LM of an RMS-norm family (:func:`pyprune.nn.layout.hidden_stream`) on the
    hidden (residual-stream) channels ``keep`` only, in place and without copying a weight: the
    embedding, every norm, every linear reading the stream (input columns) or writing it (output
    rows) and the LM head are wrapped. It computes what
    :func:`pyprune.nn.keep_hidden_channels_` would make (``keep`` is checked the same way), so a
    method can evaluate (or train through) the sliced model while the full weights stay; undone by
    :func:`unslice_`. ``norm_scale`` (norm name -> factor, e.g. DReSS's ``norm_scale`` report) scales
    those norms' weights as a rescale after slicing would."""
    stream = hidden_stream(model)
    index = hidden_index(keep, model.config.hidden_size).to(stream["embed"].weight.device)
    wrapped = {stream["embed_name"]: SlicedEmbedding(stream["embed"], index),
               stream["lm_head_name"]: SlicedLinear(stream["lm_head"], in_index=index)}
    norm_scale = dict(norm_scale or {})
    unknown = sorted(set(norm_scale) - set(stream["norms"]))
    if unknown:
        raise ValueError(f"norm_scale names no norm of the hidden stream: {', '.join(unknown)}")
    wrapped.update({name: SlicedNorm(norm, index, norm_scale.get(name, 1.0), stream["norm_offset"])
                    for name, norm in stream["norms"].items()})
    wrapped.update({name: SlicedLinear(m, in_index=index) for name, m in stream["readers"].items()})
    wrapped.update({name: SlicedLinear(m, out_index=index) for name, m in stream["writers"].items()})
    for name, module in wrapped.items():
        _replace(model, name, module)


_WRAPPERS = (SlicedLinear, SlicedEmbedding, SlicedNorm)


def unslice_(model: nn.Module) -> int:
    """Replace every SlicedLinear, SlicedEmbedding and SlicedNorm inside ``model`` by its
    original module; returns how many."""
    restored = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _WRAPPERS):
                setattr(module, child_name, child.base)
                restored += 1
    return restored


def check_plain_linears(model: nn.Module, why: str) -> None:
    """ValueError when ``model`` holds SparseLinear or SlicedLinear layers, which the caller needs
    as nn.Linear (``why``, e.g. "peft's LoRA wraps only nn.Linear"); the message says how to turn
    them back."""
    special = [name for name, module in model.named_modules() if isinstance(module, (SparseLinear, SlicedLinear))]
    if special:
        raise ValueError(f"model has SparseLinear/SlicedLinear layers ({', '.join(special[:3])}"
                         f"{', ...' if len(special) > 3 else ''}): {why}; turn them back into nn.Linear first "
                         "(pyprune.nn.densify_(model), pyprune.nn.unslice_(model))")
