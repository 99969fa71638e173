"""pyprune.nn: turning pruned dense weights into smaller or faster layers.

* :mod:`pyprune.nn.compact` — physically remove attention heads and MLP channels from
  LLaMA-family decoder blocks (structured pruning's output), and describe/rebuild their sizes.
"""
from .compact import (block_layout, check_llama_block, config_accepts, config_fields,
                      grouped_query_heads, keep_attention_heads_, keep_mlp_channels_,
                      layouts_uniform, resize_block_)

__all__ = ["block_layout", "check_llama_block", "config_accepts", "config_fields",
           "grouped_query_heads", "keep_attention_heads_", "keep_mlp_channels_",
           "layouts_uniform", "resize_block_"]
