"""Checkpoint tensor names as the model names its parameters: transformers 5 saves some families in
their original checkpoint format (an MoE's fused experts as one tensor per expert,
``...block_sparse_moe.experts.0.w1.weight``) and converts them when it loads; :func:`model_names`
applies the same conversions, for :func:`pyprune.load` and for the blocks an offloaded model reads."""
from __future__ import annotations

import copy
from typing import Dict

import torch
from torch import nn

__all__ = ["model_names"]


def model_names(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The checkpoint ``state`` under the model's own parameter names, by the conversions transformers
    declares for the model's class; names already the model's pass unchanged."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4 saves the model's own names
        return state
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {source: converter for converter in converters for source in converter.source_patterns}
    own = model.state_dict()
    converted, merged = {}, {}
    for key, tensor in state.items():
        name, source = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if source is None:
            converted[name] = tensor
        else:  # one converter per target gathers its source tensors (e.g. every expert's w1 and w3)
            merged.setdefault(name, copy.deepcopy(converter_of[source])).add_tensor(name, key, source, tensor)
    for first, converter in merged.items():
        for name, value in converter.convert(first, model=model, config=model.config).items():
            converted[name] = value[0] if isinstance(value, list) else value
    return converted
