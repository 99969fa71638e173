"""Physical compaction of LLaMA-family decoder blocks: remove attention heads and MLP channels.

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
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .sparse import SparseLinear

__all__ = [
    "ATTENTION_LINEARS", "MLP_LINEARS", "LINEARS",
    "check_llama_block", "head_dim", "block_layout", "layouts_uniform", "config_fields", "config_accepts",
    "grouped_query_heads",
    "keep_mlp_channels_", "keep_attention_heads_", "resize_block_",
]

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: The linear layers of a LLaMA-style block, by their name inside the block.
LINEARS = tuple(f"self_attn.{n}" for n in ATTENTION_LINEARS) + tuple(f"mlp.{n}" for n in MLP_LINEARS)

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
