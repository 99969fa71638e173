"""Physical compaction of dense decoder models: remove attention heads and MLP channels from
decoder blocks, and hidden (residual-stream) channels from a whole causal LM (the model
description it acts on is :mod:`pyprune.nn.layout`, each block's family :mod:`pyprune.nn.families`).

A LLaMA-style block (Llama, Mistral, Qwen2/3, Gemma, SmolLM, ... in transformers) has

* ``self_attn.{q,k,v}_proj``: rows grouped by head (``head_dim`` rows per head); ``o_proj``:
  columns grouped the same way as ``q_proj``'s rows;
* ``mlp.{gate,up}_proj``: one row per intermediate channel; ``mlp.down_proj``: one column per channel.

Other families hold the same rows elsewhere (Phi-3's fused qkv_proj [q | k | v] and gate_up_proj
[gate | up], OPT's out_proj and fc1/fc2, GPT-NeoX's query_key_value [q k v] per head):
:func:`pyprune.nn.families.head_rows` and :func:`~pyprune.nn.families.channel_rows` say where.

The attention forward infers the number of heads from the projection sizes (it reshapes to
``(-1, head_dim)``) and repeats each key/value head ``self_attn.num_key_value_groups`` times
(``repeat_kv``), so query head ``h`` reads key/value head ``h // num_key_value_groups``. After
compaction every kept key/value head must therefore serve the same number of kept query heads,
stored consecutively: :func:`keep_attention_heads_` checks that and sets ``num_key_value_groups``
(and ``num_heads`` / ``num_key_value_heads`` where a module has them; Phi-3's attention, which
reads them from its config, gets a config of its own).

The ``nn.Linear`` modules are replaced by smaller ones holding copies of the kept rows/columns
(same dtype, device, bias, ``requires_grad`` and train/eval mode); nothing else in the block changes.

:func:`keep_hidden_channels_` (DReSS's slice step) removes the same hidden channels from every
tensor of the residual stream: the token embedding, every RMSNorm, the inputs of the attention and
MLP input linears, the outputs of their output linears and the input of lm_head (with
``slice_head=False``, SliceGPT's default, the LM head, the final norm and the last MLP output stay
whole). Heads, ``head_dim`` and MLP channels stay.

:func:`keep_blocks_` (SLEB) removes whole decoder blocks and renumbers the rest in the config.

:func:`keep_expert_channels_` removes intermediate channels of every expert of a fused experts module
(each expert its own channels, the same number: the fused parameters hold one intermediate size), and
:func:`keep_gated_mlp_channels_` those of a gate/up/down MLP named by its linears (a shared expert, a
hybrid block's MLP).

:func:`keep_experts_` (REAP) removes whole experts of MoE blocks: their slices of the fused expert
parameters and their rows of the router, so that the router's top-k (and the renormalisation of the
top-k weights where the family has one) chooses among the kept experts only.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .anatomy import decoder_blocks
from .experts import expert_layout, fused_experts, routers
from .families import EXPERT_FIELDS, Family, channel_rows, head_rows
from .layout import (Indices, block_family, block_layout, check_block, check_heads_removable, checked_index,
                     config_accepts, head_counts, head_dim, hidden_index, hidden_stream, rescaled_norm_weight)
from .rotation import sublayers
from .sparse import SparseLinear

__all__ = ["grouped_query_heads", "keep_mlp_channels_", "keep_attention_heads_", "resize_block_",
           "keep_hidden_channels_", "hidden_width_check", "keep_blocks_",
           "keep_experts_", "keep_expert_channels_", "keep_gated_mlp_channels_"]


def _copied_linear(old: nn.Linear, rows: Optional[Tensor] = None, cols: Optional[Tensor] = None,
                   out_features: Optional[int] = None, in_features: Optional[int] = None) -> nn.Linear:
    """A new Linear with ``old``'s rows ``rows`` and columns ``cols`` (None: all), or, with explicit
    sizes and no indices, uninitialised weights of that shape."""
    if isinstance(old, SparseLinear):
        raise TypeError("cannot remove channels from a SparseLinear (its N:M groups would break); "
                        "compact the model before pyprune.nn.sparsify_")
    weight = old.weight.detach()
    bias = None if old.bias is None else old.bias.detach()
    if out_features is not None or in_features is not None:
        out_features = old.out_features if out_features is None else out_features
        in_features = old.in_features if in_features is None else in_features
        new_weight = torch.empty(out_features, in_features, dtype=weight.dtype, device=weight.device)
        new_bias = None if bias is None else torch.empty(out_features, dtype=bias.dtype, device=bias.device)
    else:
        new_weight = weight
        new_bias = bias
        if rows is not None:
            rows = rows.to(weight.device)
            new_weight = new_weight.index_select(0, rows)
            new_bias = None if bias is None else bias.index_select(0, rows)
        if cols is not None:
            new_weight = new_weight.index_select(1, cols.to(weight.device))
        new_weight = new_weight.clone()
        new_bias = None if new_bias is None else new_bias.clone()
    new = nn.Linear(new_weight.shape[1], new_weight.shape[0], bias=new_bias is not None, device="meta")
    new.weight = nn.Parameter(new_weight.contiguous(), requires_grad=old.weight.requires_grad)
    if new_bias is not None:
        new.bias = nn.Parameter(new_bias.contiguous(), requires_grad=old.bias.requires_grad)
    new.train(old.training)
    return new


def _replace(block: nn.Module, name: str, linear: nn.Linear) -> None:
    parent, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, child, linear)


def _kept_rows(parts, kept: Dict[str, Tensor]) -> Tensor:
    """The rows of the kept heads/channels among ``parts`` ((role, [n, width]) pairs), part after part."""
    return torch.cat([index[kept[role]].flatten() for role, index in parts])


def _set_head_counts(family: Family, attn: nn.Module, heads: int, kv_heads: int) -> None:
    """Tell ``attn`` its new head counts; a family whose forward reads them from the config
    (Phi-3) gets a config of its own stating them."""
    attn.num_key_value_groups = heads // kv_heads
    for name, value in (("num_heads", heads), ("num_attention_heads", heads),
                        ("num_key_value_heads", kv_heads), ("num_kv_heads", kv_heads)):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, value)
    if family.heads_from_config and (attn.config.num_attention_heads, attn.config.num_key_value_heads) \
            != (heads, kv_heads):
        attn.config = copy.copy(attn.config)
        attn.config.num_attention_heads, attn.config.num_key_value_heads = heads, kv_heads


@torch.no_grad()
def keep_mlp_channels_(block: nn.Module, index: Indices) -> None:
    """Keep only MLP channels ``index`` (rows of the input linears, e.g. gate/up_proj, each part of
    a fused gate_up, OPT's fc1; columns of the output linear), in that order."""
    family = check_block(block)
    channels = block.get_submodule(family.mlp_out).in_features
    index = checked_index(index, channels, "keep_mlp_channels_")
    for name, parts in channel_rows(family, channels).items():
        rows = _kept_rows([("ch", part[:, None]) for part in parts], {"ch": index})
        _replace(block, name, _copied_linear(block.get_submodule(name), rows=rows))
    _replace(block, family.mlp_out, _copied_linear(block.get_submodule(family.mlp_out), cols=index))
    mlp = block.get_submodule(family.mlp_out.rpartition(".")[0])
    if isinstance(getattr(mlp, "intermediate_size", None), int):
        mlp.intermediate_size = index.numel()


def grouped_query_heads(q_heads: Indices, kv_heads: Indices, groups: int) -> Tensor:
    """Check a GQA-valid head selection and return the kept query heads in their new order.

    Query head ``h`` reads key/value head ``h // groups``. Valid: every kept query head's key/value
    head is kept, and every kept key/value head keeps the same number of query heads. The new
    order lists, for each kept key/value head in ascending order, its kept query heads ascending,
    which is what ``repeat_kv`` expects (that is, ascending)."""
    q = torch.as_tensor(q_heads, dtype=torch.long).flatten().cpu()
    kv = torch.as_tensor(kv_heads, dtype=torch.long).flatten().cpu().sort().values
    owners = q // groups
    missing = sorted(set(owners.tolist()) - set(kv.tolist()))
    if missing:
        raise ValueError(f"keep_attention_heads_: kept query heads use key/value heads {missing}, "
                         f"which are not kept")
    counts = [int((owners == j).sum()) for j in kv.tolist()]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise ValueError(f"keep_attention_heads_: every kept key/value head must serve the same (nonzero) "
                         f"number of kept query heads; got {dict(zip(kv.tolist(), counts))}")
    return torch.cat([q[owners == j].sort().values for j in kv.tolist()])


@torch.no_grad()
def keep_attention_heads_(block: nn.Module, q_heads: Indices, kv_heads: Indices) -> None:
    """Keep only query heads ``q_heads`` and key/value heads ``kv_heads`` of the block's attention.

    Removes the heads' rows of the attention's input linears (q/k/v_proj, or their rows in a fused
    qkv: Phi-3's [q | k | v], GPT-NeoX's [q k v] per head; bias entries too) and the query heads'
    columns of its output linear; sets ``num_key_value_groups`` to kept query heads / kept
    key/value heads. The selection must be GQA-valid (see :func:`grouped_query_heads`); with plain
    multi-head attention (one query head per key/value head) pass the same indices twice."""
    family = check_block(block)
    n_q, n_kv, hd = head_counts(family, block)
    q = checked_index(q_heads, n_q, "keep_attention_heads_ q_heads")
    kv = checked_index(kv_heads, n_kv, "keep_attention_heads_ kv_heads").sort().values
    if q.numel() < n_q or kv.numel() < n_kv:
        check_heads_removable(block)
    q = grouped_query_heads(q, kv, n_q // n_kv)
    for name, parts in head_rows(family, n_q, n_kv, hd).items():
        # q and kv are ascending, so the kept rows in the linear's own order are these rows sorted
        rows = _kept_rows(parts, {"q": q, "kv": kv}).sort().values
        _replace(block, name, _copied_linear(block.get_submodule(name), rows=rows))
    out = block.get_submodule(family.attention_output)
    _replace(block, family.attention_output, _copied_linear(out, cols=(q[:, None] * hd + torch.arange(hd)).flatten()))
    _set_head_counts(family, block.get_submodule(family.attention), q.numel(), kv.numel())


@torch.no_grad()
def resize_block_(block: nn.Module, layout: Dict) -> None:
    """Give ``block``'s linear layers the sizes of ``layout`` (a :func:`block_layout` dict) with
    uninitialised weights, ready for ``load_state_dict``; sets the head counts to match."""
    family = check_block(block)
    hd = head_counts(family, block)[2]
    if int(layout["head_dim"]) != hd:
        raise ValueError(f"saved head size {layout['head_dim']} differs from the model's {hd}")
    heads, kv_heads = int(layout["heads"]), int(layout["kv_heads"])
    channels = int(layout["intermediate"])
    if heads < 1 or kv_heads < 1 or channels < 1 or heads % kv_heads \
            or (family.fused == "interleaved" and heads != kv_heads):
        raise ValueError(f"bad saved {family.name} block sizes: {heads} query heads, {kv_heads} key/value heads, "
                         f"{channels} MLP channels")
    for name, parts in head_rows(family, heads, kv_heads, hd).items():
        rows = sum(index.numel() for _, index in parts)
        _replace(block, name, _copied_linear(block.get_submodule(name), out_features=rows))
    _replace(block, family.attention_output,
             _copied_linear(block.get_submodule(family.attention_output), in_features=heads * hd))
    _set_head_counts(family, block.get_submodule(family.attention), heads, kv_heads)
    for name in family.mlp_in:
        _replace(block, name, _copied_linear(block.get_submodule(name), out_features=family.mlp_parts * channels))
    _replace(block, family.mlp_out, _copied_linear(block.get_submodule(family.mlp_out), in_features=channels))
    mlp = block.get_submodule(family.mlp_out.rpartition(".")[0])
    if isinstance(getattr(mlp, "intermediate_size", None), int):
        mlp.intermediate_size = channels
    actual = block_layout(block)["shapes"]
    expected = layout.get("shapes")
    if expected is not None and {k: list(v) for k, v in expected.items()} != actual:
        raise ValueError(f"saved layer shapes {expected} cannot be rebuilt (got {actual})")


def _hidden_fields(stream: Dict, count: int) -> Dict[str, int]:
    """The config fields of the model of :func:`~pyprune.nn.layout.hidden_stream` ``stream`` with
    ``count`` hidden channels: hidden_size and the (unchanged) head size."""
    head_dims = {head_dim(block.self_attn) for block in stream["layers"]}
    if len(head_dims) != 1:
        raise ValueError(f"model: attention head sizes differ between layers ({sorted(head_dims)})")
    return {"hidden_size": count, "head_dim": head_dims.pop()}


def hidden_width_check(model: nn.Module) -> Callable[[int], bool]:
    """Whether :func:`keep_hidden_channels_` can keep a count of hidden channels of ``model``, as a
    function of the count: its config class accepts that hidden_size with the head size unchanged
    (LlamaConfig: a multiple of num_attention_heads). The hidden stream is found once, here, so a
    caller may try every width."""
    stream = hidden_stream(model)
    return lambda count: config_accepts(model.config, _hidden_fields(stream, count))


@torch.no_grad()
def keep_hidden_channels_(model: nn.Module, keep: Indices, *, slice_head: bool = True) -> None:
    """Keep only hidden (residual-stream) channels ``keep`` of a causal LM of an RMS-norm family
    (:func:`pyprune.nn.layout.hidden_stream`), the same channels in every layer: DReSS's slice
    step (Eqs. 8-9 of the paper, as physical removal).

    ``keep``: 1-D sorted, distinct indices in [0, config.hidden_size). Sliced: ``embed_tokens``
    and ``lm_head`` columns (re-tied when the model's were tied), every RMSNorm's weight (and bias),
    q/k/v/gate/up_proj input columns, o/down_proj output rows and bias entries. Sets
    ``config.hidden_size`` to ``len(keep)`` and ``config.head_dim`` explicitly to the unchanged head
    size, so the saved config reloads with plain ``from_pretrained``; heads, MLP channels, RoPE and
    the norms' eps do not change.

    The norms then average over the kept channels only. Exactly: the result computes what the
    unsliced model computes after zeroing the removed channels' embedding columns and o/down_proj
    rows (and biases), and scaling every norm's multiplier (its weight; Gemma's 1 + w) by
    sqrt(d'/d) and its eps by d'/d.

    A scaled embedding (Gemma: the model multiplies it by ``embed_scale`` = sqrt(hidden_size),
    rebuilt from the config when the model is loaded) keeps its effect, sqrt(d) of the original
    width: its weight is multiplied by sqrt(d/d') and its scale set to sqrt(d'), so the saved model
    reloads the same; when the LM head shares that weight, the final norm's multiplier is divided
    by sqrt(d/d') so that the logits stay.

    ``slice_head=False`` leaves the model's output path whole: the LM head, the final norm and the
    last block's MLP output (the writer whose sum the final norm reads) keep all their channels, for
    a model whose last residual a rotation widens back to them (SliceGPT's default,
    :func:`pyprune.nn.rotation.add_residual_rotations_`); alone it leaves a model whose last
    residual sum does not fit. It needs an LM head untied from the embedding and a Llama-style last
    block (:func:`pyprune.nn.rotation.sublayers`).

    Raises ValueError/TypeError, with the model untouched, for a bad ``keep`` (empty, not 1-D,
    not integer, duplicate, unsorted or out-of-range indices, or a count the config class rejects:
    transformers' LlamaConfig needs hidden_size divisible by num_attention_heads), a model that is
    not of an RMS-norm family (LayerNorm: OPT, GPT-NeoX), holds SparseLinear/SlicedLinear layers,
    whose ``tie_word_embeddings`` disagrees with whether lm_head shares the embedding's weight, or
    whose embedding scale is not sqrt(hidden_size).
    """
    stream = hidden_stream(model)
    config, embed, lm_head = model.config, stream["embed"], stream["lm_head"]
    index = hidden_index(keep, config.hidden_size)
    tied = lm_head.weight is embed.weight
    whole = set() if slice_head else _output_path(stream, tied)
    if tied != bool(getattr(config, "tie_word_embeddings", False)):
        raise ValueError(f"model: config.tie_word_embeddings is {getattr(config, 'tie_word_embeddings', None)} "
                         f"but lm_head.weight {'is' if tied else 'is not'} embed_tokens.weight; cannot tell "
                         f"whether the sliced model should tie them")
    fields = _hidden_fields(stream, index.numel())
    if not config_accepts(config, fields):
        raise ValueError(f"keep_hidden_channels_ keep: {index.numel()} channels make a hidden_size that "
                         f"{type(config).__name__} rejects with num_attention_heads="
                         f"{getattr(config, 'num_attention_heads', None)} (LlamaConfig needs hidden_size "
                         f"divisible by it); keep a multiple of it")
    embed_scale = getattr(embed, "embed_scale", None)
    if embed_scale is not None and not math.isclose(float(embed_scale), config.hidden_size ** 0.5, rel_tol=1e-6):
        raise ValueError(f"model: {stream['embed_name']}.embed_scale is {float(embed_scale)}, not "
                         f"sqrt(hidden_size) = {config.hidden_size ** 0.5}; cannot tell how a reload would scale it")

    embed.weight = nn.Parameter(embed.weight.detach().index_select(1, index.to(embed.weight.device)),
                                requires_grad=embed.weight.requires_grad)
    embed.embedding_dim = index.numel()
    if embed_scale is not None:
        ratio = math.sqrt(config.hidden_size / index.numel())
        embed.weight.mul_(ratio)
        embed.embed_scale.fill_(index.numel() ** 0.5)
        if hasattr(embed, "scalar_embed_scale"):
            embed.scalar_embed_scale = index.numel() ** 0.5
        if tied:
            final = stream["norms"][stream["final_norm"]]
            final.weight.copy_(rescaled_norm_weight(final.weight, 1 / ratio, stream["norm_offset"]))
    for norm in (norm for name, norm in stream["norms"].items() if name not in whole):
        for name, param in list(norm.named_parameters(recurse=False)):
            setattr(norm, name, nn.Parameter(param.detach().index_select(0, index.to(param.device)),
                                             requires_grad=param.requires_grad))
    for names, side in ((stream["readers"], "cols"), (stream["writers"], "rows")):
        for name, linear in names.items():
            if name not in whole:
                _replace(model, name, _copied_linear(linear, **{side: index}))
    for block in stream["layers"]:
        for module in (block, getattr(block, "mlp", None)):
            if isinstance(getattr(module, "hidden_size", None), int):
                module.hidden_size = index.numel()
    if stream["lm_head_name"] not in whole:
        _replace(model, stream["lm_head_name"], _copied_linear(lm_head, cols=index))
    if tied:
        model.get_output_embeddings().weight = embed.weight
    for key, value in fields.items():
        setattr(config, key, value)


def _output_path(stream: Dict, tied: bool) -> set:
    """The names, in ``stream`` (:func:`~pyprune.nn.layout.hidden_stream`), of what
    ``slice_head=False`` keeps whole: the LM head, the final norm and the last block's MLP output."""
    if tied:
        raise ValueError("keep_hidden_channels_ slice_head=False: the LM head shares the embedding's weight, "
                         "which loses channels; untie them first")
    last = stream["layers"][-1]
    sublayers(last, "the last block")  # a Llama-style block: its MLP output is the residual's last writer
    mlp_out = last.get_submodule(block_family(last).mlp_out)
    writer = next(name for name, linear in stream["writers"].items() if linear is mlp_out)
    return {stream["lm_head_name"], stream["final_norm"], writer}


#: config fields listing the indices of some blocks (not one entry per block): Llama 4's MoE blocks
BLOCK_INDEX_LISTS = ("moe_layers",)


def _kept_block_config(config, keep: list, count: int) -> Dict:
    """The config fields that change when only blocks ``keep`` (sorted, of ``count``) stay: the
    block count, every per-block list (``layer_types``, ...: any list of one entry per block whose
    name names layers), Qwen2's ``max_window_layers`` (the blocks before it use full attention) and
    Qwen-MoE's dense blocks (``mlp_only_layers``, ``decoder_sparse_step``: made an explicit list) and the
    lists of block indices (:data:`BLOCK_INDEX_LISTS`, Llama 4's ``moe_layers``: renumbered)."""
    fields: Dict = {"num_hidden_layers": len(keep)}
    for name, value in vars(config).items():
        if name in BLOCK_INDEX_LISTS and isinstance(value, (list, tuple)):
            fields[name] = [new for new, old in enumerate(keep) if old in value]
        elif "layer" in name and isinstance(value, (list, tuple)) and len(value) == count and name != "mlp_only_layers":
            fields[name] = [value[i] for i in keep]
    if isinstance(getattr(config, "max_window_layers", None), int):
        fields["max_window_layers"] = sum(1 for i in keep if i < config.max_window_layers)
    if hasattr(config, "mlp_only_layers"):
        step = getattr(config, "decoder_sparse_step", 1) or 1
        experts = getattr(config, "num_experts", 0) or 0
        dense = [i in config.mlp_only_layers or not (experts > 0 and (i + 1) % step == 0) for i in range(count)]
        fields["mlp_only_layers"] = [new for new, old in enumerate(keep) if dense[old] and experts > 0]
        if hasattr(config, "decoder_sparse_step"):
            fields["decoder_sparse_step"] = 1
    return fields


@torch.no_grad()
def keep_blocks_(model: nn.Module, keep: Indices) -> None:
    """Keep only decoder blocks ``keep`` (distinct indices, at least one), in their order: the
    others are deleted, every ``layer_idx`` attribute inside a kept block (attention's KV-cache slot)
    is renumbered, and the config (its text config) gets the new block count and per-block fields
    (:func:`_kept_block_config`), so that plain ``from_pretrained`` rebuilds the same model and
    generation caches one slot per kept block. SLEB's removal step."""
    blocks = decoder_blocks(model)
    count = len(blocks)
    kept = sorted(checked_index(keep, count, "keep_blocks_ keep").tolist())
    config = model.config.get_text_config()
    for name, value in _kept_block_config(config, kept, count).items():
        setattr(config, name, value)
    for index in sorted(set(range(count)) - set(kept), reverse=True):
        del blocks[index]
    for new_index, block in enumerate(blocks):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_index


def _kept_parameter_(module: nn.Module, name: str, kept: Tensor) -> None:
    """``module.name`` replaced by its slices ``kept`` along the first dimension (a new Parameter)."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(old.detach().index_select(0, kept.to(old.device)).clone(),
                                       requires_grad=old.requires_grad))


@torch.no_grad()
def keep_experts_(model: nn.Module, keep: Dict) -> None:
    """Keep only the experts ``keep[(block index, experts module name inside the block)]`` (distinct
    indices, at least the router's top-k) of those fused experts modules: each expert parameter (and
    bias) and the router's weight (and bias) keep those slices along their first dimension, in order,
    and every ``num_experts`` the experts module, its router or their parent holds (a router
    nn.Linear's ``out_features`` too) and the config's expert count (:data:`EXPERT_FIELDS`) become the
    kept count, so that plain ``from_pretrained`` rebuilds the same model. One config states one
    count: ValueError, before anything changes, when the model's experts modules would then differ."""
    blocks = decoder_blocks(model)
    plan, counts = [], {}
    for index, block in enumerate(blocks):
        for name, experts in fused_experts(block).items():
            counts[(index, name)] = experts.gate_up_proj.shape[0]
    for key, indices in keep.items():
        if key not in counts:
            raise ValueError(f"keep_experts_ keep: {key} names no fused experts module; those of this model are "
                             f"{sorted(counts)}")
        index, name = key
        block = blocks[index]
        router = routers(block)[name]
        kept = checked_index(indices, counts[key], f"keep_experts_ keep[{key}]")
        top_k = getattr(router, "top_k", None)
        if isinstance(top_k, int) and kept.numel() < top_k:
            raise ValueError(f"keep_experts_ keep[{key}]: {kept.numel()} experts cannot serve the router's top-{top_k}")
        plan.append((block, name, router, kept, counts[key]))
        counts[key] = kept.numel()
    if len(set(counts.values())) > 1:
        raise ValueError(f"keep_experts_ keep: every experts module must keep the same number of experts (one config "
                         f"field states it); the counts would be {sorted(set(counts.values()))}")
    for block, name, router, kept, count in plan:
        experts = block.get_submodule(name)
        parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
        for own in [n for n, _ in experts.named_parameters(recurse=False)]:
            _kept_parameter_(experts, own, kept)
        for own in [n for n, _ in router.named_parameters(recurse=False)]:
            _kept_parameter_(router, own, kept)
        for module in (experts, router, parent):
            if getattr(module, "num_experts", None) == count:
                module.num_experts = kept.numel()
        if isinstance(router, nn.Linear):
            router.out_features = kept.numel()
    config = getattr(model, "config", None)
    if config is not None and plan:
        text = config.get_text_config()
        for field in EXPERT_FIELDS:
            if getattr(text, field, None) == plan[0][4]:
                setattr(text, field, plan[0][3].numel())


@torch.no_grad()
def keep_expert_channels_(fused: nn.Module, channels: Tensor) -> None:
    """Keep, of each expert e of the fused experts module ``fused``, only its intermediate channels
    ``channels[e]`` ([E, k] distinct indices per expert, in that order): its gate and up entries of
    ``gate_up_proj`` (and its bias) and its entries of ``down_proj`` along the channel dimension of
    the module's :class:`~pyprune.nn.experts.ExpertLayout`; the module's intermediate size attribute
    (``intermediate_dim``, ``intermediate_size``, ``expert_dim``) follows."""
    layout, problem = expert_layout(fused)
    if layout is None:
        raise ValueError(f"keep_expert_channels_: {type(fused).__name__} is no fused experts module pyprune can "
                         f"prune: {problem}")
    intermediate, experts = layout.intermediate(fused), fused.gate_up_proj.shape[0]
    channels = torch.as_tensor(channels, dtype=torch.long)
    if channels.dim() != 2 or channels.shape[0] != experts:
        raise ValueError(f"keep_expert_channels_ channels: needs one row of kept channels per expert, shape "
                         f"[{experts}, k]; got {tuple(channels.shape)}")
    channels = torch.stack([checked_index(row, intermediate, f"keep_expert_channels_ channels[{e}]")
                            for e, row in enumerate(channels)])
    for name in layout.parameters:
        dim = layout.channel_dim(name)
        if dim is None:
            continue
        old = getattr(fused, name)
        positions = layout.channel_positions(name, channels, intermediate).to(old.device)
        shape = [1] * old.dim()
        shape[0], shape[dim] = experts, positions.shape[1]
        size = list(old.shape)
        size[dim] = positions.shape[1]
        kept = old.detach().gather(dim, positions.view(shape).expand(size)).clone()
        setattr(fused, name, nn.Parameter(kept, requires_grad=old.requires_grad))
    for field in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if getattr(fused, field, None) == intermediate:
            setattr(fused, field, channels.shape[1])


@torch.no_grad()
def keep_gated_mlp_channels_(module: nn.Module, index: Indices,
                             names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Keep only channels ``index`` of the gated MLP whose gate, up and down linears are ``names`` inside
    ``module`` (a shared expert; a hybrid block's MLP): rows of gate and up, columns of down; an
    ``intermediate_size`` attribute of the MLP follows."""
    gate, up, down = names
    channels = module.get_submodule(down).in_features
    index = checked_index(index, channels, "keep_gated_mlp_channels_")
    for name in (gate, up):
        _replace(module, name, _copied_linear(module.get_submodule(name), rows=index))
    _replace(module, down, _copied_linear(module.get_submodule(down), cols=index))
    parent = down.rpartition(".")[0]
    mlp = module.get_submodule(parent) if parent else module
    if getattr(mlp, "intermediate_size", None) == channels:
        mlp.intermediate_size = index.numel()
