"""LLM-Pruner-style Taylor structured pruning (Ma et al., 2023) of LLaMA-family decoder blocks.

Importance is first order: the gradient of the mean next-token loss over the calibration tokens
(:func:`pyprune.engine.accumulate_gradients`) times the weights, ``|W ⊙ ∇W|``
(:func:`pyprune.ops.taylor_score`), summed over each coupled group of weights:

* an MLP channel: its row of ``gate_proj`` and ``up_proj`` and its column of ``down_proj``;
* a query head: its ``head_dim`` rows of ``q_proj`` and columns of ``o_proj``;
* a key/value head: its rows of ``k_proj`` and ``v_proj``. With grouped-query attention (GQA) a
  key/value head is shared by ``groups = heads / kv_heads`` consecutive query heads, so the coupled
  unit is the *KV group*: the key/value head plus its query heads. Its score is the key/value
  head's score plus its query heads' scores. (Biases, where a model has them, count with their rows.)

Then, in each pruned layer, the lowest-scoring ``ratio`` of the MLP channels is removed
(keep ``round((1 - ratio) · channels)``, at least one; ties keep the lower index) and attention
heads are removed by the GQA rule below; finally the layers are physically compacted
(:mod:`pyprune.nn.compact`), so the model is smaller and runs as is.

GQA rule. ``repeat_kv`` needs every kept key/value head to serve the same number of query heads.

* ``Structured(ratio, uniform=True)``: heads go in whole KV groups: every layer keeps the
  ``round((1 - ratio) · kv_heads)`` (at least one) highest-scoring KV groups with all their query
  heads, and the same number of MLP channels. All layers end up with the same sizes, which a model
  config can state: ``model.config`` is updated and the model saved by :func:`pyprune.save` loads
  with plain ``from_pretrained``. The config class must accept the new sizes: transformers 5's
  ``LlamaConfig`` requires ``hidden_size`` to be a multiple of ``num_attention_heads``, so when it
  rejects the target count of KV groups the nearest count it accepts is used (ties: the larger;
  e.g. 32 heads of LLaMA-7B at ratio 0.2 -> 26 is rejected for hidden 4096 and all 32 stay,
  while ratio 0.5 -> 16 heads). The report's ``structure`` shows what each layer kept.
* default (``uniform=False``): finer grained. Each layer keeps ``T = round((1 - ratio) · heads)``
  query heads (at least one) arranged as ``K`` kept KV groups of ``k`` query heads each
  (``K ≤ kv_heads``, ``k ≤ groups``). Among the arrangements with ``K·k`` nearest ``T`` (ties: the
  larger, i.e. prune less), the one retaining the most importance wins: for a given ``(K, k)``
  each group keeps its ``k`` best query heads and the ``K`` best groups stay. With plain multi-head
  attention this is simply "remove the lowest-scoring heads". Layers may then differ in sizes;
  ``pyprune.load`` restores such models exactly, and the report's ``config_compatible`` says
  whether plain ``from_pretrained`` can too.

Layers. LLM-Pruner leaves the first few and the last layers dense (e.g. layers 4..29 of the 32 in
LLaMA-7B). Here ``first_layer`` / ``last_layer`` (inclusive; negative counts from the end) choose the
pruned range; the defaults prune every layer. Leaving layers dense makes the sizes non-uniform,
so it cannot be combined with ``uniform=True``. ``heads=False`` / ``channels=False`` leave the
attention / the MLP alone.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import engine, ops
from ..nn import compact
from ..patterns import Structured
from ..reference import kept_count
from .base import Method


def _score(linear: nn.Linear, dim: int, groups: int) -> Tensor:
    """|W ⊙ ∇W| of ``linear`` summed into ``groups`` equal consecutive groups along ``dim``
    (0: rows, 1: columns), plus the bias rows when grouping rows. fp32 [groups]."""
    weight = linear.weight
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    score = ops.taylor_score(weight.detach(), grad.detach())
    if dim == 0:
        total = score.reshape(groups, -1).sum(dim=1)
        bias = linear.bias
        if bias is not None and bias.grad is not None:
            total = total + ops.taylor_score(bias.detach(), bias.grad.detach()).reshape(groups, -1).sum(dim=1)
        return total
    return score.reshape(score.shape[0], groups, -1).sum(dim=(0, 2))


def group_scores(block: nn.Module) -> Dict[str, Tensor]:
    """Taylor importance of the coupled groups of a LLaMA-style block from the ``.grad`` of its
    weights (missing gradients count as zero), all fp32:

    * ``heads`` [heads]: each query head's q_proj rows + o_proj columns;
    * ``kv_heads`` [kv_heads]: each key/value head's k_proj + v_proj rows;
    * ``channels`` [intermediate]: each MLP channel's gate_proj + up_proj rows + down_proj column.
    """
    attn, mlp = block.self_attn, block.mlp
    hd = compact.head_dim(attn)
    n_q, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
    n_ch = mlp.gate_proj.out_features
    with torch.no_grad():
        return {
            "heads": _score(attn.q_proj, 0, n_q) + _score(attn.o_proj, 1, n_q),
            "kv_heads": _score(attn.k_proj, 0, n_kv) + _score(attn.v_proj, 0, n_kv),
            "channels": _score(mlp.gate_proj, 0, n_ch) + _score(mlp.up_proj, 0, n_ch)
            + _score(mlp.down_proj, 1, n_ch),
        }


def _top(scores: Tensor, count: int) -> Tensor:
    """Indices of the ``count`` highest scores (ties: lower index first), in that ranking order."""
    return torch.sort(scores.double().cpu(), descending=True, stable=True).indices[:count]


def keep_channels(scores: Tensor, ratio: float) -> Tensor:
    """Kept MLP channels at ``ratio``: the top round((1 - ratio)·n), at least one, ascending."""
    return _top(scores, max(1, kept_count(scores.numel(), ratio))).sort().values


def _arrangement(q_scores: Tensor, kv_scores: Tensor, n_groups: int, per_group: int
                 ) -> Tuple[float, Tensor, Tensor]:
    """Best GQA-valid selection keeping ``n_groups`` KV groups of ``per_group`` query heads:
    (retained importance, kept query heads, kept key/value heads), indices ascending."""
    n_kv = kv_scores.numel()
    groups = q_scores.numel() // n_kv
    q = q_scores.double().cpu().reshape(n_kv, groups)
    best_in_group = torch.sort(q, dim=1, descending=True, stable=True).indices[:, :per_group]
    totals = kv_scores.double().cpu() + q.gather(1, best_in_group).sum(dim=1)
    kv_kept = _top(totals, n_groups).sort().values
    q_kept = (kv_kept[:, None] * groups + best_in_group[kv_kept].sort(dim=1).values).flatten()
    return float(totals[kv_kept].sum()), q_kept, kv_kept


def uniform_kv_groups(n_kv: int, ratio: float, allowed: Callable[[int], bool] = lambda n: True) -> int:
    """KV groups every layer keeps under uniform pruning: round((1 - ratio)·kv_heads), at least one,
    or, when ``allowed`` (the config's validation) rejects that count, the nearest allowed one
    (ties: the larger); all of them when none is."""
    target = max(1, kept_count(n_kv, ratio))
    valid = [n for n in range(n_kv, 0, -1) if allowed(n)]
    return min(valid, key=lambda n: (abs(n - target), -n)) if valid else n_kv


def keep_heads(q_scores: Tensor, kv_scores: Tensor, ratio: float, uniform: bool,
               n_groups: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Kept (query heads, key/value heads) at ``ratio`` by the module's GQA rule; with ``uniform``,
    ``n_groups`` (default :func:`uniform_kv_groups`) whole KV groups."""
    n_q, n_kv = q_scores.numel(), kv_scores.numel()
    groups = n_q // n_kv
    if uniform:
        n_groups = uniform_kv_groups(n_kv, ratio) if n_groups is None else n_groups
        _, q_kept, kv_kept = _arrangement(q_scores, kv_scores, n_groups, groups)
        return q_kept, kv_kept
    target = max(1, kept_count(n_q, ratio))
    shapes = [(n, k) for n in range(n_kv, 0, -1) for k in range(groups, 0, -1)]
    distance = min(abs(n * k - target) for n, k in shapes)
    kept = max(n * k for n, k in shapes if abs(n * k - target) == distance)
    best = None
    for n, k in shapes:
        if n * k != kept:
            continue
        candidate = _arrangement(q_scores, kv_scores, n, k)
        if best is None or candidate[0] > best[0]:
            best = candidate
    return best[1], best[2]


class Taylor(Method):
    """Taylor structured pruning of attention heads and MLP channels (see the module docstring)."""

    name = "taylor"
    patterns = (Structured,)

    def __init__(self, first_layer: int = 0, last_layer: Optional[int] = None,
                 heads: bool = True, channels: bool = True):
        for label, value in (("first_layer", first_layer), ("last_layer", last_layer)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{label} must be an integer layer index; got {value!r}")
        if first_layer is None:
            first_layer = 0
        self.first_layer, self.last_layer = first_layer, last_layer
        self.heads, self.channels = bool(heads), bool(channels)

    def layer_range(self, n_layers: int) -> Tuple[int, int]:
        """The pruned layers as (first, last), inclusive, after resolving negative indices."""
        first = self.first_layer + n_layers if self.first_layer < 0 else self.first_layer
        last = n_layers - 1 if self.last_layer is None else self.last_layer
        last = last + n_layers if last < 0 else last
        if not 0 <= first <= last < n_layers:
            raise ValueError(f"layer range first_layer={self.first_layer}, last_layer={self.last_layer} "
                             f"selects no layers of a model with {n_layers} decoder blocks")
        return first, last

    def check(self, model: nn.Module, pattern) -> None:
        super().check(model, pattern)
        blocks = engine.decoder_blocks(model)
        prefix = engine.block_prefix(model)
        for index, block in enumerate(blocks):
            compact.check_llama_block(block, f"block {prefix}.{index} of {type(model).__name__}")
        first, last = self.layer_range(len(blocks))
        if pattern.uniform and pattern.ratio > 0:
            if (first, last) != (0, len(blocks) - 1):
                raise ValueError(f"uniform (config-compatible) pruning must prune every layer; "
                                 f"first_layer/last_layer select layers {first}..{last} of {len(blocks)}")
            if not compact.layouts_uniform([compact.block_layout(block) for block in blocks]):
                raise ValueError("uniform (config-compatible) pruning needs decoder blocks of equal sizes; "
                                 "this model's blocks already differ")

    def _gradients(self, model: nn.Module, blocks, first: int, last: int, calib: Tensor,
                   batch_size: int, progress: bool) -> None:
        """Fill .grad of the pruned blocks' linear weights (only those: nothing else needs one)."""
        flags = {id(p): (p, p.requires_grad) for p in model.parameters()}
        was_training = model.training
        try:
            for p, _ in flags.values():
                p.requires_grad_(False)
            for block in blocks[first:last + 1]:
                for linear in engine.block_linears(block).values():
                    for p in linear.parameters():
                        p.requires_grad_(True)
            model.eval()
            with torch.enable_grad():
                engine.accumulate_gradients(model, calib, batch_size=batch_size, progress=progress,
                                            desc=self.name)
        finally:
            model.train(was_training)
            for p, flag in flags.values():
                p.requires_grad_(flag)

    def _uniform_kv_groups(self, model: nn.Module, blocks, ratio: float) -> int:
        """KV groups every layer keeps under uniform pruning, snapped to a count the model's
        config class accepts (transformers 5's LlamaConfig wants hidden_size % heads == 0)."""
        layout = compact.block_layout(blocks[0])
        groups = layout["heads"] // layout["kv_heads"]
        channels = max(1, kept_count(layout["intermediate"], ratio)) if self.channels \
            else layout["intermediate"]
        config = getattr(model, "config", None)

        def allowed(n: int) -> bool:
            return compact.config_accepts(config, {
                "num_attention_heads": n * groups, "num_key_value_heads": n,
                "head_dim": layout["head_dim"], "intermediate_size": channels})

        return uniform_kv_groups(layout["kv_heads"], ratio if self.heads else 0.0, allowed)

    def prune(self, model, pattern, calib, *, batch_size=8, progress=True):
        self.check(model, pattern)
        blocks = engine.decoder_blocks(model)
        first, last = self.layer_range(len(blocks))
        ratio, uniform = float(pattern.ratio), bool(pattern.uniform)
        structure: List[Dict] = []
        selections = {}
        try:
            if ratio > 0 and (self.heads or self.channels):
                self._gradients(model, blocks, first, last, calib, batch_size, progress)
                n_groups = self._uniform_kv_groups(model, blocks, ratio) if uniform else None
                for index in range(first, last + 1):
                    scores = group_scores(blocks[index])
                    q_kept, kv_kept = keep_heads(scores["heads"], scores["kv_heads"], ratio, uniform,
                                                 n_groups) \
                        if self.heads else (torch.arange(scores["heads"].numel()),
                                            torch.arange(scores["kv_heads"].numel()))
                    ch_kept = keep_channels(scores["channels"], ratio) if self.channels \
                        else torch.arange(scores["channels"].numel())
                    selections[index] = (q_kept, kv_kept, ch_kept)
        finally:
            model.zero_grad(set_to_none=True)
        for index, (q_kept, kv_kept, ch_kept) in selections.items():
            compact.keep_attention_heads_(blocks[index], q_kept, kv_kept)
            compact.keep_mlp_channels_(blocks[index], ch_kept)
        for index, block in enumerate(blocks):
            layout = compact.block_layout(block)
            entry = {"layer": index, "pruned": index in selections, "heads": layout["heads"],
                     "kv_heads": layout["kv_heads"], "channels": layout["intermediate"]}
            if index in selections:
                entry["kept_heads"] = selections[index][0].tolist()
                entry["kept_kv_heads"] = selections[index][1].tolist()
            structure.append(entry)
        fields = compact.config_fields(blocks)
        config = getattr(model, "config", None)
        if not compact.config_accepts(config, fields):
            fields = None
        if fields is not None and config is not None:
            for key, value in fields.items():
                setattr(config, key, value)
        return {"uniform": uniform, "first_layer": first, "last_layer": last,
                "config_compatible": fields is not None, "structure": structure}
