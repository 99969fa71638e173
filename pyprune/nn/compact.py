"""Physical compaction of LLaMA-family models: remove attention heads and MLP channels from
decoder blocks, and hidden (residual-stream) channels from a whole causal LM.

A LLaMA-style block (Llama, Mistral, Qwen2, SmolLM, ... in transformers) has

* ``self_attn.{q,k,v}_proj``: rows grouped by head (``head_dim`` rows per head); ``o_proj``:
  columns grouped the same way as ``q_proj``'s rows;
* ``mlp.{gate,up}_proj``: one row per intermediate channel; ``mlp.down_proj``: one column per channel.

The attention forward infers the number of heads from the projection sizes (it reshapes to
``(-1, head_dim)``) and repeats each key/value head ``self_attn.num_key_value_groups`` times
(``repeat_kv``), so query head ``h`` reads key/value head ``h // num_key_value_groups``. After
compaction every kept key/value head must therefore serve the same number of kept query heads,
stored consecutively: :func:`keep_attention_heads_` checks that and sets ``num_key_value_groups``
(and ``num_heads`` / ``num_key_value_heads`` where a module has them).

The ``nn.Linear`` modules are replaced by smaller ones holding copies of the kept rows/columns
(same dtype, device, bias, ``requires_grad`` and train/eval mode); nothing else in the block changes.

:func:`keep_hidden_channels_` (DReSS's slice step) removes the same hidden channels from every
tensor of the residual stream: the token embedding, every RMSNorm, the inputs of q/k/v/gate/up_proj,
the outputs of o/down_proj and the input of lm_head. Heads, ``head_dim`` and MLP channels stay.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .sliced import SlicedEmbedding, SlicedLinear, SlicedNorm
from .sparse import SparseLinear

__all__ = [
    "ATTENTION_LINEARS", "MLP_LINEARS", "LINEARS",
    "check_llama_block", "head_dim", "block_layout", "layouts_uniform", "config_fields", "config_accepts",
    "grouped_query_heads",
    "keep_mlp_channels_", "keep_attention_heads_", "resize_block_",
    "BLOCK_NORMS", "HIDDEN_READERS", "HIDDEN_WRITERS", "hidden_stream", "keep_hidden_channels_",
]

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: The linear layers of a LLaMA-style block, by their name inside the block.
LINEARS = tuple(f"self_attn.{n}" for n in ATTENTION_LINEARS) + tuple(f"mlp.{n}" for n in MLP_LINEARS)
#: The RMSNorms of a LLaMA-style block, on the residual stream before attention and before the MLP.
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")
#: The linears of a block that read the residual stream (one input column per hidden channel) ...
HIDDEN_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
#: ... and those that write to it (one output row, and bias entry, per hidden channel).
HIDDEN_WRITERS = ("self_attn.o_proj", "mlp.down_proj")

Indices = Union[Tensor, Sequence[int]]


def _missing(block: nn.Module) -> Optional[str]:
    for name in LINEARS:
        node = block
        for part in name.split("."):
            node = getattr(node, part, None)
        if not isinstance(node, (nn.Linear, SparseLinear)):
            return name
    return None


def head_dim(attn: nn.Module) -> int:
    """The per-head width of an attention module (``attn.head_dim``, else from its config)."""
    value = getattr(attn, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    config = getattr(attn, "config", None)
    value = getattr(config, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    if config is not None and getattr(config, "num_attention_heads", None):
        return config.hidden_size // config.num_attention_heads
    raise ValueError(f"cannot tell the head size of attention module {type(attn).__name__}")


def check_llama_block(block: nn.Module, name: str = "block") -> None:
    """Raise ValueError (one line) unless ``block`` is a LLaMA-style decoder block whose
    projections split into whole heads and whose query heads split evenly over key/value heads."""
    missing = _missing(block)
    if missing is not None:
        raise ValueError(f"{name} ({type(block).__name__}) is not a LLaMA-style decoder block: it has no "
                         f"linear {missing} (needs self_attn.q/k/v/o_proj and mlp.gate/up/down_proj)")
    attn, mlp = block.self_attn, block.mlp
    hd = head_dim(attn)
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    if q.out_features % hd or k.out_features % hd or k.out_features != v.out_features \
            or o.in_features != q.out_features or k.out_features == 0:
        raise ValueError(f"{name}: attention projections q/k/v/o of shapes {_shape(q)}/{_shape(k)}/"
                         f"{_shape(v)}/{_shape(o)} do not split into heads of size {hd}")
    if (q.out_features // hd) % (k.out_features // hd):
        raise ValueError(f"{name}: {q.out_features // hd} query heads do not split evenly over "
                         f"{k.out_features // hd} key/value heads")
    if not (mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features):
        raise ValueError(f"{name}: MLP projections gate/up/down of shapes {_shape(mlp.gate_proj)}/"
                         f"{_shape(mlp.up_proj)}/{_shape(mlp.down_proj)} disagree on the channel count")


def _shape(linear: nn.Linear) -> List[int]:
    return [linear.out_features, linear.in_features]


def block_layout(block: nn.Module) -> Dict:
    """The sizes of a LLaMA-style block: query heads, key/value heads, head size, MLP channels,
    and the ``[out, in]`` shape of every linear layer (by its name inside the block)."""
    attn, mlp = block.self_attn, block.mlp
    hd = head_dim(attn)
    shapes = {f"self_attn.{n}": _shape(getattr(attn, n)) for n in ATTENTION_LINEARS}
    shapes.update({f"mlp.{n}": _shape(getattr(mlp, n)) for n in MLP_LINEARS})
    return {
        "heads": attn.q_proj.out_features // hd,
        "kv_heads": attn.k_proj.out_features // hd,
        "head_dim": hd,
        "intermediate": mlp.gate_proj.out_features,
        "shapes": shapes,
    }


def layouts_uniform(layouts: Sequence[Dict]) -> bool:
    """True when every block has the same sizes (so one model config describes them all)."""
    return all(layout == layouts[0] for layout in layouts[1:])


def _index(index: Indices, size: int, what: str) -> Tensor:
    index = torch.as_tensor(index, dtype=torch.long).flatten().cpu()
    if index.numel() == 0:
        raise ValueError(f"{what}: cannot keep nothing (at least one must stay)")
    if int(index.min()) < 0 or int(index.max()) >= size:
        raise ValueError(f"{what}: indices must lie in [0, {size}); got {index.tolist()}")
    if torch.unique(index).numel() != index.numel():
        raise ValueError(f"{what}: indices must be distinct; got {index.tolist()}")
    return index


def _sliced_linear(old: nn.Linear, rows: Optional[Tensor] = None, cols: Optional[Tensor] = None,
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


def _head_rows(heads: Tensor, hd: int) -> Tensor:
    return (heads[:, None] * hd + torch.arange(hd)[None, :]).flatten()


def _set_head_counts(attn: nn.Module, heads: int, kv_heads: int) -> None:
    attn.num_key_value_groups = heads // kv_heads
    for name, value in (("num_heads", heads), ("num_attention_heads", heads),
                        ("num_key_value_heads", kv_heads), ("num_kv_heads", kv_heads)):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, value)


@torch.no_grad()
def keep_mlp_channels_(block: nn.Module, index: Indices) -> None:
    """Keep only MLP channels ``index`` (rows of gate/up_proj, columns of down_proj), in that order."""
    mlp = block.mlp
    index = _index(index, mlp.gate_proj.out_features, "keep_mlp_channels_")
    mlp.gate_proj = _sliced_linear(mlp.gate_proj, rows=index)
    mlp.up_proj = _sliced_linear(mlp.up_proj, rows=index)
    mlp.down_proj = _sliced_linear(mlp.down_proj, cols=index)
    if isinstance(getattr(mlp, "intermediate_size", None), int):
        mlp.intermediate_size = index.numel()


def grouped_query_heads(q_heads: Indices, kv_heads: Indices, groups: int) -> Tensor:
    """Check a GQA-valid head selection and return the kept query heads in their new order.

    Query head ``h`` reads key/value head ``h // groups``. Valid: every kept query head's key/value
    head is kept, and every kept key/value head keeps the same number of query heads. The new
    order lists, for each kept key/value head in ascending order, its kept query heads ascending,
    which is what ``repeat_kv`` expects."""
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
    """Keep only query heads ``q_heads`` and key/value heads ``kv_heads`` of ``block.self_attn``.

    Removes the heads' rows of q/k/v_proj (and bias entries) and the query heads' columns of
    o_proj; sets ``num_key_value_groups`` to kept query heads / kept key/value heads. The selection
    must be GQA-valid (see :func:`grouped_query_heads`); with plain multi-head attention
    (one query head per key/value head) pass the same indices twice."""
    attn = block.self_attn
    hd = head_dim(attn)
    n_q, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
    q = _index(q_heads, n_q, "keep_attention_heads_ q_heads")
    kv = _index(kv_heads, n_kv, "keep_attention_heads_ kv_heads").sort().values
    q = grouped_query_heads(q, kv, n_q // n_kv)
    q_rows, kv_rows = _head_rows(q, hd), _head_rows(kv, hd)
    attn.q_proj = _sliced_linear(attn.q_proj, rows=q_rows)
    attn.k_proj = _sliced_linear(attn.k_proj, rows=kv_rows)
    attn.v_proj = _sliced_linear(attn.v_proj, rows=kv_rows)
    attn.o_proj = _sliced_linear(attn.o_proj, cols=q_rows)
    _set_head_counts(attn, q.numel(), kv.numel())


@torch.no_grad()
def resize_block_(block: nn.Module, layout: Dict) -> None:
    """Give ``block``'s linear layers the sizes of ``layout`` (a :func:`block_layout` dict) with
    uninitialised weights, ready for ``load_state_dict``; sets the head counts to match."""
    attn, mlp = block.self_attn, block.mlp
    hd = head_dim(attn)
    if int(layout["head_dim"]) != hd:
        raise ValueError(f"saved head size {layout['head_dim']} differs from the model's {hd}")
    heads, kv_heads = int(layout["heads"]), int(layout["kv_heads"])
    channels = int(layout["intermediate"])
    if heads < 1 or kv_heads < 1 or channels < 1 or heads % kv_heads:
        raise ValueError(f"bad saved block sizes: {heads} query heads, {kv_heads} key/value heads, "
                         f"{channels} MLP channels")
    attn.q_proj = _sliced_linear(attn.q_proj, out_features=heads * hd)
    attn.k_proj = _sliced_linear(attn.k_proj, out_features=kv_heads * hd)
    attn.v_proj = _sliced_linear(attn.v_proj, out_features=kv_heads * hd)
    attn.o_proj = _sliced_linear(attn.o_proj, in_features=heads * hd)
    _set_head_counts(attn, heads, kv_heads)
    mlp.gate_proj = _sliced_linear(mlp.gate_proj, out_features=channels)
    mlp.up_proj = _sliced_linear(mlp.up_proj, out_features=channels)
    mlp.down_proj = _sliced_linear(mlp.down_proj, in_features=channels)
    if isinstance(getattr(mlp, "intermediate_size", None), int):
        mlp.intermediate_size = channels
    actual = block_layout(block)["shapes"]
    expected = layout.get("shapes")
    if expected is not None and {k: list(v) for k, v in expected.items()} != actual:
        raise ValueError(f"saved layer shapes {expected} cannot be rebuilt (got {actual})")


def config_fields(blocks: Sequence[nn.Module]) -> Optional[Dict[str, int]]:
    """The model-config sizes that describe ``blocks`` (``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``), or None when the blocks differ
    in size, so that no config of the architecture can describe them."""
    layouts = [block_layout(block) for block in blocks]
    if not layouts or not layouts_uniform(layouts):
        return None
    first = layouts[0]
    return {"num_attention_heads": first["heads"], "num_key_value_heads": first["kv_heads"],
            "head_dim": first["head_dim"], "intermediate_size": first["intermediate"]}


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


def _hidden_index(keep: Indices, hidden: int) -> Tensor:
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
    index = _index(index, hidden, what)
    if not bool((index[1:] > index[:-1]).all()):
        raise ValueError(f"{what}: indices must be sorted ascending; got {index.tolist()}")
    return index


def hidden_stream(model: nn.Module) -> Dict:
    """The modules of ``model`` that carry the hidden dimension (embedding, lm_head, norms, decoder
    blocks), after checking that each has ``model.config.hidden_size`` channels there and that no
    other tensor has that size (ValueError otherwise)."""
    sparse = sorted(name for name, module in model.named_modules()
                    if isinstance(module, (SparseLinear, SlicedLinear, SlicedEmbedding, SlicedNorm)))
    if sparse:
        raise ValueError(f"model holds SparseLinear/SlicedLinear/SlicedEmbedding/SlicedNorm modules "
                         f"{sparse[:3]}, whose stored weights cannot lose hidden channels; slice the dense model first "
                         f"(before pyprune.nn.sparsify_, or after pyprune.nn.unslice_)")
    base, config = getattr(model, "model", None), getattr(model, "config", None)
    embed, norm = getattr(base, "embed_tokens", None), getattr(base, "norm", None)
    layers, lm_head = getattr(base, "layers", None), getattr(model, "lm_head", None)
    if type(embed) is not nn.Embedding or type(lm_head) is not nn.Linear or norm is None \
            or not isinstance(layers, nn.ModuleList) or len(layers) == 0 \
            or not isinstance(getattr(config, "hidden_size", None), int):
        raise ValueError(f"model ({type(model).__name__}) is not a LLaMA-style causal LM: needs "
                         f"model.embed_tokens (nn.Embedding), model.layers, model.norm, lm_head (nn.Linear) "
                         f"and config.hidden_size")
    norms = {"model.norm": norm}
    readers, writers = {}, {}
    for i, block in enumerate(layers):
        check_llama_block(block, f"model.layers.{i}")
        norms.update({f"model.layers.{i}.{n}": getattr(block, n, None) for n in BLOCK_NORMS})
        readers.update({f"model.layers.{i}.{n}": block.get_submodule(n) for n in HIDDEN_READERS})
        writers.update({f"model.layers.{i}.{n}": block.get_submodule(n) for n in HIDDEN_WRITERS})
    hidden = config.hidden_size
    wrong = [f"model.embed_tokens {list(embed.weight.shape)}"] if embed.embedding_dim != hidden else []
    wrong += [f"lm_head {_shape(lm_head)}"] if lm_head.in_features != hidden else []
    wrong += [f"{name} {_shape(m)}" for name, m in readers.items() if m.in_features != hidden]
    wrong += [f"{name} {_shape(m)}" for name, m in writers.items() if m.out_features != hidden]
    for name, module in norms.items():
        params = dict(module.named_parameters(recurse=False)) if module is not None else {}
        if "weight" not in params or set(params) - {"weight", "bias"} \
                or any(tuple(p.shape) != (hidden,) for p in params.values()):
            wrong.append(f"{name} (needs a norm with weight [and bias] of shape [{hidden}]; has "
                         f"{ {k: list(p.shape) for k, p in params.items()} })")
    if wrong:
        raise ValueError(f"model ({type(model).__name__}) is not a LLaMA-style causal LM with hidden size "
                         f"{hidden} (config.hidden_size): {'; '.join(wrong[:4])}")
    sliced = {id(p) for m in [embed, lm_head, *norms.values(), *readers.values(), *writers.values()]
              for p in m.parameters(recurse=False)}
    stray = [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
             if id(t) not in sliced and hidden in t.shape]
    if stray:
        raise ValueError(f"model ({type(model).__name__}) has tensors with a dimension of hidden size {hidden} "
                         f"that keep_hidden_channels_ does not know how to slice: {stray[:4]}")
    return {"embed": embed, "lm_head": lm_head, "norms": norms, "readers": readers, "writers": writers,
            "layers": layers}


def _sliced_embedding(old: nn.Embedding, cols: Tensor) -> nn.Embedding:
    """A new Embedding with ``old``'s columns ``cols`` (same dtype, device, options, requires_grad)."""
    weight = old.weight.detach().index_select(1, cols.to(old.weight.device))
    new = nn.Embedding(old.num_embeddings, weight.shape[1], padding_idx=old.padding_idx, max_norm=old.max_norm,
                       norm_type=old.norm_type, scale_grad_by_freq=old.scale_grad_by_freq, sparse=old.sparse,
                       device="meta")
    new.weight = nn.Parameter(weight, requires_grad=old.weight.requires_grad)
    new.train(old.training)
    return new


@torch.no_grad()
def keep_hidden_channels_(model: nn.Module, keep: Indices) -> None:
    """Keep only hidden (residual-stream) channels ``keep`` of a LLaMA-family causal LM, the same
    channels in every layer: DReSS's slice step (Eqs. 8-9 of the paper, as physical removal).

    ``keep``: 1-D sorted, distinct indices in [0, config.hidden_size). Sliced: ``embed_tokens``
    and ``lm_head`` columns (re-tied when the model's were tied), every RMSNorm's weight (and bias),
    q/k/v/gate/up_proj input columns, o/down_proj output rows and bias entries. Sets
    ``config.hidden_size`` to ``len(keep)`` and ``config.head_dim`` explicitly to the unchanged head
    size, so the saved config reloads with plain ``from_pretrained``; heads, MLP channels, RoPE and
    the norms' eps do not change.

    The norms then average over the kept channels only. Exactly: the result computes what the
    unsliced model computes after zeroing the removed channels' embedding columns and o/down_proj
    rows (and biases), and scaling every norm's weight by sqrt(d'/d) and its eps by d'/d.

    Raises ValueError/TypeError, with the model untouched, for a bad ``keep`` (empty, not 1-D,
    not integer, duplicate, unsorted or out-of-range indices, or a count the config class rejects:
    transformers' LlamaConfig needs hidden_size divisible by num_attention_heads), a model that is
    not LLaMA-style, holds SparseLinear/SlicedLinear layers, or whose ``tie_word_embeddings``
    disagrees with whether lm_head shares the embedding's weight.
    """
    stream = hidden_stream(model)
    config, embed, lm_head = model.config, stream["embed"], stream["lm_head"]
    index = _hidden_index(keep, config.hidden_size)
    tied = lm_head.weight is embed.weight
    if tied != bool(getattr(config, "tie_word_embeddings", False)):
        raise ValueError(f"model: config.tie_word_embeddings is {getattr(config, 'tie_word_embeddings', None)} "
                         f"but lm_head.weight {'is' if tied else 'is not'} embed_tokens.weight; cannot tell "
                         f"whether the sliced model should tie them")
    head_dims = {head_dim(block.self_attn) for block in stream["layers"]}
    if len(head_dims) != 1:
        raise ValueError(f"model: attention head sizes differ between layers ({sorted(head_dims)})")
    fields = {"hidden_size": index.numel(), "head_dim": head_dims.pop()}
    if not config_accepts(config, fields):
        raise ValueError(f"keep_hidden_channels_ keep: {index.numel()} channels make a hidden_size that "
                         f"{type(config).__name__} rejects with num_attention_heads="
                         f"{getattr(config, 'num_attention_heads', None)} (LlamaConfig needs hidden_size "
                         f"divisible by it); keep a multiple of it")

    base = model.model
    base.embed_tokens = _sliced_embedding(embed, index)
    for norm in stream["norms"].values():
        for name, param in list(norm.named_parameters(recurse=False)):
            setattr(norm, name, nn.Parameter(param.detach().index_select(0, index.to(param.device)),
                                             requires_grad=param.requires_grad))
    for block in stream["layers"]:
        for names, side in ((HIDDEN_READERS, "cols"), (HIDDEN_WRITERS, "rows")):
            for name in names:
                parent_name, _, child = name.rpartition(".")
                parent = block.get_submodule(parent_name)
                setattr(parent, child, _sliced_linear(getattr(parent, child), **{side: index}))
        for module in (block, block.mlp):
            if isinstance(getattr(module, "hidden_size", None), int):
                module.hidden_size = index.numel()
    model.lm_head = _sliced_linear(lm_head, cols=index)
    if tied:
        model.lm_head.weight = base.embed_tokens.weight
    for key, value in fields.items():
        setattr(config, key, value)
