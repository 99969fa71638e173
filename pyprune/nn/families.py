"""One description per dense decoder family of what structured pruning needs from a block: which
linears form the attention heads (separate q/k/v, or one fused projection and how its rows split),
which form the MLP channels (gate/up, fused gate_up, OPT's fc1, GPT-NeoX's dense_h_to_4h) and
which linear writes each back to the hidden stream, the norms on the hidden stream, and the config
fields that state the sizes. :mod:`pyprune.nn.layout` matches a block to its family by the modules
it has (a SmolLM block is a Llama one), so nothing else in pyprune names a projection.

Rows of the attention inputs are described per head: :func:`head_rows` gives, for each input
linear, the row indices of each query head and each key/value head (``[heads, width]``), which
scoring sums and compaction keeps; the output linear's columns are ``head_dim`` per query head in
every family. MLP input linears hold ``parts`` consecutive blocks of one row per channel (2 for a
fused gate_up, chunked in halves by the model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Family", "FAMILIES", "head_rows", "channel_rows", "experts_in_config", "EXPERT_FIELDS", "EXPERT_CHANNEL_FIELDS",
           "SHARED_EXPERT_CHANNEL_FIELDS", "GATED_MLPS", "FINAL_NORMS"]

#: where a decoder (``get_decoder()``) keeps the norm after its last block
FINAL_NORMS = ("norm", "final_layer_norm")


@dataclass(frozen=True)
class Family:
    """A dense decoder family's block anatomy (names relative to the block)."""

    name: str
    attention: str                      #: the attention module
    qkv: Tuple[str, ...]                #: its input linears (inside ``attention``)
    fused: str                          #: "" (q/k/v apart), "stacked" ([q | k | v]) or "interleaved" ([q k v] per head)
    out: str                            #: its output linear (inside ``attention``), head_dim columns per query head
    mlp_in: Tuple[str, ...]             #: the MLP's input linears, one row per channel in each of ``mlp_parts`` blocks
    mlp_out: str                        #: the MLP's output linear, one column per channel
    norms: Tuple[str, ...]              #: the norms of the block on the hidden stream
    mlp_parts: int = 1                  #: 2: a fused gate_up holding the gate rows, then the up rows
    kv_field: Optional[str] = "num_key_value_heads"   #: config field of the key/value heads (None: one per query head)
    head_dim_field: Optional[str] = "head_dim"        #: config field of the head size (None: hidden // heads)
    intermediate_field: str = "intermediate_size"     #: config field of the MLP channels
    heads_from_config: bool = False     #: the attention's forward reads the head counts from its config (Phi-3)
    norm_offset: float = 0.0            #: its RMSNorms multiply by offset + weight (Gemma: 1 + w)
    post_norm: bool = False             #: its norms act on the attention and MLP outputs only (OLMo 2, EXAONE 4)
    parallel: bool = False              #: attention and MLP both read the one norm's output (Cohere)

    @property
    def attention_inputs(self) -> Tuple[str, ...]:
        return tuple(f"{self.attention}.{n}" for n in self.qkv)

    @property
    def attention_output(self) -> str:
        return f"{self.attention}.{self.out}"

    @property
    def linears(self) -> Tuple[str, ...]:
        """Every linear of the block, by its name inside the block."""
        return self.attention_inputs + (self.attention_output,) + self.mlp_in + (self.mlp_out,)

    @property
    def hidden_readers(self) -> Tuple[str, ...]:
        """The linears that read the hidden stream (one input column per hidden channel)."""
        return self.attention_inputs + self.mlp_in

    @property
    def hidden_writers(self) -> Tuple[str, ...]:
        """The linears that write to it (one output row, and bias entry, per hidden channel)."""
        return self.attention_output, self.mlp_out


_LLAMA_MLP = dict(mlp_in=("mlp.gate_proj", "mlp.up_proj"), mlp_out="mlp.down_proj")
_QKV = ("q_proj", "k_proj", "v_proj")

#: The supported dense families, most specific first (a block is matched to the first whose
#: modules it all has; a parallel one must have nothing else): Gemma 2/3 (four norms around attention
#: and MLP; Gemma 3's q/k-norms act per head_dim and stay), OLMo 2 / EXAONE 4 (a norm after attention
#: and after the MLP only), Llama / Mistral / Qwen2 / Qwen3 / SmolLM, Cohere (attention and MLP in
#: parallel on one norm), Phi-3, GLM-4 (q/k/v apart, a fused gate_up, Gemma's four norms in the same
#: roles), OPT, GPT-NeoX.
FAMILIES = (
    Family("gemma", "self_attn", _QKV, "", "o_proj", **_LLAMA_MLP,
           norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"), norm_offset=1.0),
    Family("olmo2", "self_attn", _QKV, "", "o_proj", **_LLAMA_MLP,
           norms=("post_attention_layernorm", "post_feedforward_layernorm"), post_norm=True),
    Family("llama", "self_attn", _QKV, "", "o_proj", **_LLAMA_MLP,
           norms=("input_layernorm", "post_attention_layernorm")),
    Family("cohere", "self_attn", _QKV, "", "o_proj", **_LLAMA_MLP, norms=("input_layernorm",), parallel=True),
    Family("phi3", "self_attn", ("qkv_proj",), "stacked", "o_proj", mlp_in=("mlp.gate_up_proj",),
           mlp_out="mlp.down_proj", norms=("input_layernorm", "post_attention_layernorm"), mlp_parts=2,
           heads_from_config=True),
    Family("glm4", "self_attn", _QKV, "", "o_proj", mlp_in=("mlp.gate_up_proj",), mlp_out="mlp.down_proj",
           norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
           mlp_parts=2),
    Family("opt", "self_attn", _QKV, "", "out_proj", mlp_in=("fc1",), mlp_out="fc2",
           norms=("self_attn_layer_norm", "final_layer_norm"), kv_field=None, head_dim_field=None,
           intermediate_field="ffn_dim"),
    Family("gpt_neox", "attention", ("query_key_value",), "interleaved", "dense",
           mlp_in=("mlp.dense_h_to_4h",), mlp_out="mlp.dense_4h_to_h",
           norms=("input_layernorm", "post_attention_layernorm"), kv_field=None, head_dim_field=None),
)


def _heads(count: int, width: int, start: int = 0, stride: Optional[int] = None) -> Tensor:
    """Row indices [count, width]: head i at rows start + i·stride + [0, width)."""
    stride = width if stride is None else stride
    return start + torch.arange(count)[:, None] * stride + torch.arange(width)[None, :]


def head_rows(family: Family, heads: int, kv_heads: int, head_dim: int) -> Dict[str, List[Tuple[str, Tensor]]]:
    """For each attention input linear (name inside the block), its rows as (role, [n, head_dim])
    pairs, role "q" (n = heads) or "kv" (n = kv_heads), in the order the model lays them out."""
    hd = head_dim
    if family.fused == "stacked":
        q, kv = heads * hd, kv_heads * hd
        return {family.attention_inputs[0]: [("q", _heads(heads, hd)), ("kv", _heads(kv_heads, hd, q)),
                                              ("kv", _heads(kv_heads, hd, q + kv))]}
    if family.fused == "interleaved":
        return {family.attention_inputs[0]: [("q", _heads(heads, hd, 0, 3 * hd)),
                                              ("kv", _heads(kv_heads, hd, hd, 3 * hd)),
                                              ("kv", _heads(kv_heads, hd, 2 * hd, 3 * hd))]}
    q_name, k_name, v_name = family.attention_inputs
    return {q_name: [("q", _heads(heads, hd))], k_name: [("kv", _heads(kv_heads, hd))],
            v_name: [("kv", _heads(kv_heads, hd))]}


def channel_rows(family: Family, channels: int) -> Dict[str, List[Tensor]]:
    """For each MLP input linear, its rows as [channels] index blocks (one per fused part)."""
    return {name: [part * channels + torch.arange(channels) for part in range(family.mlp_parts)]
            for name in family.mlp_in}


#: the config fields that count an MoE block's experts (Mixtral's, gpt-oss's and Llama 4's; Qwen-MoE's)
EXPERT_FIELDS = ("num_local_experts", "num_experts")


#: the config fields stating an MoE model's per-expert and shared-expert intermediate sizes (the first one
#: the config has: Qwen-MoE's own fields, else Mixtral's, gpt-oss's and Llama 4's ``intermediate_size``)
EXPERT_CHANNEL_FIELDS = ("moe_intermediate_size", "intermediate_size")
SHARED_EXPERT_CHANNEL_FIELDS = ("shared_expert_intermediate_size", "intermediate_size")


#: the gated MLPs of hybrid blocks, as (gate, up, down) linears inside the block: Qwen3.5's, Falcon-H1's,
#: LFM2's (``w2(silu(w1 x) · w3 x)``); their channels are stated by the config's ``intermediate_size``
GATED_MLPS = (("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
              ("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"),
              ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2"))


def experts_in_config(config) -> int:
    """The experts a config's MoE blocks route between (Mixtral's ``num_local_experts``, Qwen-MoE's
    ``num_experts``), 0 for a dense model: what a method refuses before the weights are loaded."""
    counts = [getattr(config, field, None) for field in EXPERT_FIELDS]
    return max([n for n in counts if isinstance(n, int)], default=0)
