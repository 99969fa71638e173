"""pyprune.nn: turning pruned dense weights into smaller or faster layers.

* :mod:`pyprune.nn.families` — one block anatomy per dense family (Llama-style, Gemma, Phi-3,
  OPT, GPT-NeoX): which linears form heads and MLP channels, the norms on the hidden stream.
* :mod:`pyprune.nn.layout` — the model description the others share: a block's family, its sizes
  and config fields, the modules of the hidden stream.
* :mod:`pyprune.nn.compact` — physically remove attention heads and MLP channels from
  dense decoder blocks (structured pruning's output) and hidden channels from a whole
  model (DReSS), and rebuild saved sizes.
* :mod:`pyprune.nn.sparse` — :class:`SparseLinear`, a drop-in nn.Linear holding an N:M weight in
  the compressed form, :func:`sparsify_` to swap it into a pruned model (where it pays, with
  ``faster_at``), :func:`densify_slower_` to turn back the layers that do not and :func:`densify_`
  to turn back all (to prune or fine-tune a sparse checkpoint).
* :mod:`pyprune.nn.sliced` — :class:`SlicedLinear`, a layer evaluated on kept channels only, and
  the same for a whole model's hidden channels (:func:`slice_hidden_channels_`).
* :mod:`pyprune.nn.measure` — a model's sparsity report (N:M fit per layer), parameter count and
  forward cost, before and after pruning.
* :mod:`pyprune.nn.dispatch` — the measured table and per-user cache that pick SparseLinear's implementation;
  :mod:`pyprune.nn.tuning` — measures a case on first use.
"""
from .compact import (grouped_query_heads, keep_attention_heads_, keep_hidden_channels_, keep_mlp_channels_,
                      resize_block_)
from .layout import block_layout, check_block, config_accepts, config_fields, layouts_uniform
from .sliced import (SlicedEmbedding, SlicedLinear, SlicedNorm, slice_hidden_channels_, slice_mlp_channels_,
                     unslice_)
from .sparse import SparseLinear, densify_, densify_slower_, detect_pattern, sparsify_

__all__ = ["block_layout", "check_block", "config_accepts", "config_fields",
           "grouped_query_heads", "keep_attention_heads_", "keep_hidden_channels_", "keep_mlp_channels_",
           "layouts_uniform", "resize_block_",
           "SparseLinear", "sparsify_", "densify_", "densify_slower_", "detect_pattern",
           "SlicedLinear", "SlicedEmbedding", "SlicedNorm", "slice_hidden_channels_", "slice_mlp_channels_",
           "unslice_"]
