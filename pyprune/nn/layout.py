"""The model description every part of pyprune.nn shares: which modules of a causal LM hold what
(a block's family, :mod:`pyprune.nn.families`: its linear layers and norms; the modules that read
or write the hidden stream), the sizes of a block (:func:`block_layout`) and the config fields that describe
them, and the index checks of a channel selection. :mod:`pyprune.nn.compact` (copying) and
:mod:`pyprune.nn.sliced` (views) both act on it.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .anatomy import decoder_blocks
from .families import FAMILIES, FINAL_NORMS, Family, head_rows
from .sparse import SparseLinear

__all__ = [
    "ATTENTION_LINEARS", "MLP_LINEARS", "LINEARS", "ChannelView", "block_family", "check_block", "check_heads_removable",
    "head_counts", "head_dim", "block_layout", "layouts_uniform", "config_fields", "family_fields", "config_accepts",
    "checked_index", "hidden_index", "hidden_stream", "hidden_slices", "rescaled_norm_weight",
]

#: The linears of a LLaMA-style attention and MLP (LoRA's default targets, runtime.recovery); the
#: structure of every family is :mod:`pyprune.nn.families`'.
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: The linear layers of a LLaMA-style block, by their name inside the block.
LINEARS = next(family for family in FAMILIES if family.name == "llama").linears

Indices = Union[Tensor, Sequence[int]]


class ChannelView(nn.Module):
    """Base of the modules that run another module (``base``) on some of its channels without
    copying its weights (:mod:`pyprune.nn.sliced`); a model holding one cannot lose channels."""


def _linear(block: nn.Module, name: str) -> Optional[nn.Module]:
    node = block
    for part in name.split("."):
        node = getattr(node, part, None)
    return node if isinstance(node, (nn.Linear, SparseLinear)) else None


def _has_experts(block: nn.Module) -> bool:
    return any(name.rpartition(".")[2] == "experts" for name, _ in block.named_modules())


def recurrent_mixer(block: nn.Module) -> Optional[str]:
    """The name of ``block``'s sequence mixer that is no attention: the module holding a convolution
    (Gated DeltaNet's ``linear_attn``, Mamba2's ``mamba``, LFM2's short ``conv``); None without one."""
    return next((name.rpartition(".")[0] for name, module in block.named_modules()
                 if isinstance(module, nn.modules.conv._ConvNd)), None)


def block_family(block: nn.Module, name: str = "block") -> Family:
    """The dense family (:data:`pyprune.nn.families.FAMILIES`) whose linears and norms ``block``
    has; ValueError (one line) naming what the nearest family misses otherwise, that an MoE
    block's experts are not heads or channels, or that a hybrid block's recurrent mixer is no attention."""
    mixer = recurrent_mixer(block)
    if mixer is not None:
        raise ValueError(f"{name} ({type(block).__name__}) mixes tokens with {mixer} "
                         f"({type(block.get_submodule(mixer)).__name__}), a convolution and recurrent state, not "
                         "attention heads: structured pruning supports blocks of attention and an MLP only")
    if _has_experts(block):
        raise ValueError(f"{name} ({type(block).__name__}) is a mixture-of-experts block: structured pruning of "
                         f"heads and MLP channels supports dense blocks only (families "
                         f"{', '.join(f.name for f in FAMILIES)})")
    missing = {}
    children = set(dict(block.named_children()))
    for family in FAMILIES:
        missing[family.name] = [n for n in family.linears if _linear(block, n) is None] \
            + [n for n in family.norms if not isinstance(getattr(block, n, None), nn.Module)]
        parts = {family.attention, family.mlp_out.rpartition(".")[0] or family.mlp_out, *family.norms}
        if family.parallel and not missing[family.name] and children != parts:
            missing[family.name] = [f"no module beside {', '.join(sorted(parts))} (has {', '.join(sorted(children - parts))})"]
        if not missing[family.name]:
            return family
    nearest = min(missing, key=lambda f: len(missing[f]))
    raise ValueError(f"{name} ({type(block).__name__}) is no supported dense decoder block: nearest family "
                     f"{nearest} misses {', '.join(missing[nearest])} (supported: {', '.join(missing)})")


def head_dim(attn: nn.Module) -> int:
    """The per-head width of an attention module (``attn.head_dim`` or GPT-NeoX's ``head_size``,
    else from its config)."""
    for field in ("head_dim", "head_size"):
        value = getattr(attn, field, None)
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(attn, "config", None)
    value = getattr(config, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    if config is not None and getattr(config, "num_attention_heads", None):
        return config.hidden_size // config.num_attention_heads
    raise ValueError(f"cannot tell the head size of attention module {type(attn).__name__}")


def head_counts(family: Family, block: nn.Module) -> Tuple[int, int, int]:
    """(query heads, key/value heads, head size) of ``block``'s attention, from its linears' sizes."""
    hd = head_dim(block.get_submodule(family.attention))
    first = _linear(block, family.attention_inputs[0])
    if family.fused == "stacked":
        heads = _linear(block, family.attention_output).in_features // hd
        return heads, (first.out_features - heads * hd) // (2 * hd), hd
    if family.fused == "interleaved":
        return first.out_features // (3 * hd), first.out_features // (3 * hd), hd
    return first.out_features // hd, _linear(block, family.attention_inputs[1]).out_features // hd, hd


def check_block(block: nn.Module, name: str = "block") -> Family:
    """The family of ``block`` after checking that its attention splits into whole heads, its query
    heads evenly over its key/value heads and its MLP linears agree on the channel count; ValueError
    (one line) otherwise."""
    family = block_family(block, name)
    heads, kv_heads, hd = head_counts(family, block)
    shapes = {n: linear_shape(_linear(block, n)) for n in family.linears}
    rows = {n: sum(r.numel() for _, r in parts) for n, parts in head_rows(family, heads, kv_heads, hd).items()}
    if kv_heads < 1 or heads < 1 or any(shapes[n][0] != rows[n] for n in rows) \
            or shapes[family.attention_output][1] != heads * hd:
        attention = family.attention_inputs + (family.attention_output,)
        raise ValueError(f"{name}: attention linears {', '.join(f'{n} {shapes[n]}' for n in attention)} "
                         f"do not split into {family.name} heads of size {hd}")
    if heads % kv_heads:
        raise ValueError(f"{name}: {heads} query heads do not split evenly over {kv_heads} key/value heads")
    channels = shapes[family.mlp_in[0]][0] // family.mlp_parts
    if any(shapes[n][0] != family.mlp_parts * channels for n in family.mlp_in) \
            or shapes[family.mlp_out][1] != channels:
        mlp = family.mlp_in + (family.mlp_out,)
        raise ValueError(f"{name}: MLP linears {', '.join(f'{n} {shapes[n]}' for n in mlp)} "
                         f"disagree on the channel count")
    return family


def check_heads_removable(block: nn.Module, name: str = "block") -> None:
    """ValueError (one line) when a norm inside the attention (OLMo 2's q_norm, k_norm) holds weights
    over its whole projection instead of one head_dim shared by every head: it normalises across
    heads, so removing some would change what it does to the others."""
    family = block_family(block, name)
    hd = head_counts(family, block)[2]
    for norm_name, norm in block.get_submodule(family.attention).named_children():
        weight = getattr(norm, "weight", None)
        if norm_name.endswith("norm") and isinstance(weight, Tensor) and weight.numel() != hd:
            raise ValueError(f"{name}: {family.attention}.{norm_name} has weight {tuple(weight.shape)} over the whole "
                             f"projection, not one head_dim ({hd}) shared by every head: removing heads would change "
                             "what it does to the others (prune MLP channels only: heads=False)")


#: the name io.model_dir and evaluation call it by
def linear_shape(linear: nn.Linear) -> List[int]:
    return [linear.out_features, linear.in_features]


def block_layout(block: nn.Module) -> Dict:
    """The sizes of a dense block: query heads, key/value heads, head size, MLP channels, and the
    ``[out, in]`` shape of every linear layer (by its name inside the block)."""
    family = block_family(block)
    heads, kv_heads, hd = head_counts(family, block)
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": hd,
        "intermediate": _linear(block, family.mlp_out).in_features,
        "shapes": {n: linear_shape(_linear(block, n)) for n in family.linears},
    }


def layouts_uniform(layouts: Sequence[Dict]) -> bool:
    """True when every block has the same sizes (so one model config describes them all)."""
    return all(layout == layouts[0] for layout in layouts[1:])


def checked_index(index: Indices, size: int, what: str) -> Tensor:
    """``index`` as a 1-D long CPU tensor of distinct indices in [0, size), at least one;
    ValueError naming ``what`` otherwise."""
    index = torch.as_tensor(index, dtype=torch.long).flatten().cpu()
    if index.numel() == 0:
        raise ValueError(f"{what}: cannot keep nothing (at least one must stay)")
    if int(index.min()) < 0 or int(index.max()) >= size:
        raise ValueError(f"{what}: indices must lie in [0, {size}); got {index.tolist()}")
    if torch.unique(index).numel() != index.numel():
        raise ValueError(f"{what}: indices must be distinct; got {index.tolist()}")
    return index


def family_fields(family: Family, heads: int, kv_heads: int, head_size: int, intermediate: int,
                  hidden: int) -> Optional[Dict[str, int]]:
    """The config fields that state these block sizes, under the names ``family``'s config uses
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size`` for
    Llama; OPT's ``ffn_dim``), or None when its config cannot state them: OPT and GPT-NeoX derive
    the head size as hidden // heads and have one key/value head per query head."""
    fields = {"num_attention_heads": heads}
    if family.kv_field is not None:
        fields[family.kv_field] = kv_heads
    elif kv_heads != heads:
        return None
    if family.head_dim_field is not None:
        fields[family.head_dim_field] = head_size
    elif hidden != heads * head_size:
        return None
    fields[family.intermediate_field] = intermediate
    return fields


def config_fields(blocks: Sequence[nn.Module]) -> Optional[Dict[str, int]]:
    """The model-config sizes that describe ``blocks`` (:func:`family_fields`), or None when the
    blocks differ in size or their config cannot state them, so that no config of the architecture
    can describe them."""
    layouts = [block_layout(block) for block in blocks]
    if not layouts or not layouts_uniform(layouts):
        return None
    family, first = block_family(blocks[0]), layouts[0]
    return family_fields(family, first["heads"], first["kv_heads"], first["head_dim"], first["intermediate"],
                         first["shapes"][family.attention_output][0])


def config_accepts(config, fields: Optional[Dict[str, int]]) -> bool:
    """Whether ``config`` with ``fields`` set is still a valid config of its architecture (its own
    validation, e.g. transformers 5's LlamaConfig wants ``hidden_size`` divisible by
    ``num_attention_heads``), so that ``from_pretrained`` accepts it. ``config`` is not modified."""
    if fields is None:
        return False
    if config is None:
        return True
    trial = copy.deepcopy(config)
    try:
        for key, value in fields.items():
            setattr(trial, key, value)
        validate = getattr(trial, "validate", None)
        if callable(validate):
            validate()
    except Exception:  # the config class rejects these sizes, whatever its error type
        return False
    return True


def hidden_index(keep: Indices, hidden: int) -> Tensor:
    """``keep`` as a 1-D long tensor of sorted, distinct hidden-channel indices in [0, hidden)."""
    what = "keep_hidden_channels_ keep"
    try:
        index = torch.as_tensor(keep)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a 1-D tensor or sequence of int channel indices; "
                        f"got {type(keep).__name__}") from e
    if index.numel() == 0:
        raise ValueError(f"{what}: cannot keep no hidden channel (at least one must stay)")
    if index.dim() != 1:
        raise ValueError(f"{what} must be 1-D; got shape {tuple(index.shape)}")
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise TypeError(f"{what} must hold integer channel indices (not a mask); got dtype {index.dtype}")
    index = checked_index(index, hidden, what)
    if not bool((index[1:] > index[:-1]).all()):
        raise ValueError(f"{what}: indices must be sorted ascending; got {index.tolist()}")
    return index


def rescaled_norm_weight(weight: Tensor, scale: float, offset: float) -> Tensor:
    """The weight of a norm that multiplies by ``offset + weight`` (Gemma: 1 + w) after its
    multiplier is scaled by ``scale``: (offset + weight)·scale − offset."""
    return weight * scale if offset == 0 else (weight + offset) * scale - offset


@torch.no_grad()
def _centres(norm: nn.Module) -> bool:
    """Whether ``norm`` subtracts the mean over its channels (nn.LayerNorm, Cohere's): adding one value to
    every channel leaves its output as it was, which an RMS norm's is not."""
    weight = getattr(norm, "weight", None)
    if isinstance(norm, nn.LayerNorm) or not isinstance(weight, Tensor) or weight.device.type == "meta":
        return isinstance(norm, nn.LayerNorm)
    x = torch.randn(2, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    return torch.allclose(norm(x), norm(x + 3.0), rtol=1e-2, atol=1e-2)


def hidden_stream(model: nn.Module) -> Dict:
    """The modules of ``model`` that carry the hidden dimension, by qualified name: the embedding
    (``embed``, ``embed_name``; a scaled one such as Gemma's keeps its scale), the LM head, the RMS
    norms (``norms``; ``norm_offset``: 1 for Gemma's 1 + w, else 0), the linears that read and
    write the stream (``readers``, ``writers``) and the decoder blocks, after checking that each
    has ``model.config.hidden_size`` channels there and that no other tensor has that size
    (ValueError otherwise). LayerNorm families (OPT, GPT-NeoX) are refused: a LayerNorm centres
    over every channel, so no slice of it computes what the model with channels removed computes."""
    sparse = sorted(name for name, module in model.named_modules()
                    if isinstance(module, (SparseLinear, ChannelView)))
    if sparse:
        raise ValueError(f"model holds SparseLinear/SlicedLinear/SlicedEmbedding/SlicedNorm modules "
                         f"{sparse[:3]}, whose stored weights cannot lose hidden channels; slice the dense model first "
                         f"(before pyprune.nn.sparsify_, or after pyprune.nn.unslice_)")
    config = getattr(model, "config", None)
    layers = decoder_blocks(model)
    names = {id(module): name for name, module in model.named_modules()}
    prefix = names[id(layers)]
    families = [check_block(block, f"{prefix}.{i}") for i, block in enumerate(layers)]  # a block's refusal first
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = next((getattr(decoder, n) for n in FINAL_NORMS if isinstance(getattr(decoder, n, None), nn.Module)), None)
    if not isinstance(embed, nn.Embedding) or type(lm_head) is not nn.Linear or norm is None \
            or not isinstance(getattr(config, "hidden_size", None), int):
        raise ValueError(f"model ({type(model).__name__}) is not a causal LM whose hidden stream pyprune can "
                         f"slice: needs an nn.Embedding input embedding, an nn.Linear output embedding, a final "
                         f"norm ({' or '.join(FINAL_NORMS)} under get_decoder()) and config.hidden_size")
    norms = {names[id(norm)]: norm}
    readers, writers = {}, {}
    for i, (block, family) in enumerate(zip(layers, families)):
        norms.update({f"{prefix}.{i}.{n}": getattr(block, n) for n in family.norms})
        readers.update({f"{prefix}.{i}.{n}": block.get_submodule(n) for n in family.hidden_readers})
        writers.update({f"{prefix}.{i}.{n}": block.get_submodule(n) for n in family.hidden_writers})
    layer_norms = sorted(name for name, module in norms.items() if _centres(module))
    if layer_norms:
        raise ValueError(f"model ({type(model).__name__}) normalises its hidden stream with LayerNorm "
                         f"({layer_norms[0]}, ...), which centres over every hidden channel: slicing hidden "
                         f"channels needs RMS norms (Llama, Mistral, Qwen, Gemma, Phi-3 families)")
    hidden = config.hidden_size
    wrong = [f"{names[id(embed)]} {list(embed.weight.shape)}"] if embed.embedding_dim != hidden else []
    wrong += [f"{names[id(lm_head)]} {linear_shape(lm_head)}"] if lm_head.in_features != hidden else []
    wrong += [f"{name} {linear_shape(m)}" for name, m in readers.items() if m.in_features != hidden]
    wrong += [f"{name} {linear_shape(m)}" for name, m in writers.items() if m.out_features != hidden]
    for name, module in norms.items():
        params = dict(module.named_parameters(recurse=False)) if module is not None else {}
        if "weight" not in params or set(params) - {"weight", "bias"} \
                or any(tuple(p.shape) != (hidden,) for p in params.values()):
            wrong.append(f"{name} (needs a norm with weight [and bias] of shape [{hidden}]; has "
                         f"{ {k: list(p.shape) for k, p in params.items()} })")
    if wrong:
        raise ValueError(f"model ({type(model).__name__}) is not a causal LM with hidden size "
                         f"{hidden} (config.hidden_size): {'; '.join(wrong[:4])}")
    sliced = {id(p) for m in [embed, lm_head, *norms.values(), *readers.values(), *writers.values()]
              for p in m.parameters(recurse=False)}
    sliced |= {id(p) for block, family in zip(layers, families)  # q/k norms act on projections, not the stream
               for n, m in block.get_submodule(family.attention).named_children() if n.endswith("norm")
               for p in m.parameters(recurse=False)}
    stray = [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
             if id(t) not in sliced and hidden in t.shape]
    if stray:
        raise ValueError(f"model ({type(model).__name__}) has tensors with a dimension of hidden size {hidden} "
                         f"that keep_hidden_channels_ does not know how to slice: {stray[:4]}")
    return {"embed": embed, "embed_name": names[id(embed)], "lm_head": lm_head, "lm_head_name": names[id(lm_head)],
            "norms": norms, "final_norm": names[id(norm)], "norm_offset": families[0].norm_offset,
            "readers": readers, "writers": writers,
            "layers": layers}


def hidden_slices(model: nn.Module, biases: bool = True) -> List[Tuple[str, nn.Parameter, int, float]]:
    """(name, parameter, dim of the hidden channels, offset) of every parameter that holds hidden
    channel d at index d of that dim, as :func:`hidden_stream` lists the modules: embedding and
    LM-head columns (a tied LM head shares the embedding's tensor and appears once), reader input
    columns, writer output rows, norm entries; with ``biases`` also the writers' and norms' biases
    (named ``<module>.bias``; weights go by their module's name). ``offset`` is what the model adds
    to a norm's weight (Gemma's 1 + w: 1), else 0."""
    stream = hidden_stream(model)
    offset = float(stream["norm_offset"])
    slices = [(stream["embed_name"], stream["embed"].weight, 1, 0.0)]
    slices += [(name, linear.weight, 1, 0.0) for name, linear in stream["readers"].items()]
    for name, linear in stream["writers"].items():
        slices.append((name, linear.weight, 0, 0.0))
        if biases and linear.bias is not None:
            slices.append((f"{name}.bias", linear.bias, 0, 0.0))
    for name, norm in stream["norms"].items():
        slices.append((name, norm.weight, 0, offset))
        if biases and getattr(norm, "bias", None) is not None:
            slices.append((f"{name}.bias", norm.bias, 0, 0.0))
    if stream["lm_head"].weight is not stream["embed"].weight:
        slices.append((stream["lm_head_name"], stream["lm_head"].weight, 1, 0.0))
    return slices
