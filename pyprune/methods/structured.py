"""Structured pruning of dense decoder blocks from per-element importance scores: every family
:mod:`pyprune.nn.families` describes (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3's fused qkv and
gate_up, OPT, GPT-NeoX's interleaved query_key_value); an MoE model is refused from its config.

Every structured method here (Taylor / LLM-Pruner, MoreauPruner, MoreauPruner-GS, SmoothGrad)
differs only in how it scores each weight element; this module holds what they share:

1. the scores of each pruned linear layer's weights (and biases) are summed over each coupled
   group of weights (:func:`group_scores`; LLM-Pruner Eq. 4-5 with Agg = sum):

   * an MLP channel: its row of ``gate_proj`` and ``up_proj`` (both halves of a fused gate_up,
     OPT's fc1) and its column of ``down_proj`` (fc2);
   * a query head: its ``head_dim`` rows of ``q_proj`` (or of a fused qkv) and columns of ``o_proj``;
   * a key/value head: its rows of ``k_proj`` and ``v_proj``. With grouped-query attention (GQA) a
     key/value head is shared by ``groups = heads / kv_heads`` consecutive query heads, so the
     coupled unit is the *KV group*: the key/value head plus its query heads. Its score is the
     key/value head's score plus its query heads' scores;

2. in each pruned layer, the lowest-scoring ``ratio`` of the MLP channels is removed (keep
   ``round((1 - ratio) · channels)``, at least one; ties keep the lower index) and attention heads
   are removed by the GQA rule below;
3. the layers are physically compacted (:mod:`pyprune.nn.compact`), so the model is smaller and
   runs as is.

GQA rule. ``repeat_kv`` needs every kept key/value head to serve the same number of query heads.

* ``Structured(ratio, uniform=True)``: heads go in whole KV groups: every layer keeps the
  ``round((1 - ratio) · kv_heads)`` (at least one) highest-scoring KV groups with all their query
  heads, and the same number of MLP channels. All layers end up with the same sizes, which a model
  config can state: ``model.config`` is updated and the model saved by :func:`pyprune.save` loads
  with plain ``from_pretrained`` (OPT's and GPT-NeoX's configs derive the head size from
  hidden // heads, so there uniform pruning keeps every head). The config class must accept the
  new sizes: transformers 5's ``LlamaConfig`` requires ``hidden_size`` to be a multiple of ``num_attention_heads``, so when it
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

Hidden channels (``structure="hidden"``, LLM-Pruner's ``--channel_wise``, the protocol of
MoreauPruner's perturbation table): one group is one hidden (residual-stream) channel d, the same
in every layer, scored by the sum of the element scores of every parameter slice that indexes d
(:func:`hidden_channel_scores` over :func:`pyprune.nn.layout.hidden_slices`: its embedding column,
its input column of every attention/MLP input linear, its output row of every attention/MLP output
linear, its entry of every norm, its LM-head column; a tied LM head is the embedding's tensor and
counts once). The lowest-scoring ``ratio`` of the channels go, ranked over the whole model: keep
round((1 - ratio)·hidden_size), or the nearest count the config class accepts (LlamaConfig: a
multiple of the head count; ties: the larger), removed physically by
:func:`pyprune.nn.keep_hidden_channels_` (DReSS's and SliceGPT's slice: each norm then averages over
the kept channels, as LLM-Pruner's sliced RMSNorm does). RMS-norm families only (a LayerNorm
centres over every channel); every layer, so ``first_layer``/``last_layer``/``heads``/``channels``
keep their defaults. The scores of Gemma's norms are those of the stored w (its scale is 1 + w), as
for any other parameter.

MoE models (Mixtral, Qwen2-MoE, gpt-oss, Llama 4: every layout of :data:`pyprune.nn.experts.LAYOUTS`):
the groups are each expert's intermediate channels (expert e's channel c: its gate and up entries of
the fused ``gate_up_proj`` and its bias, its entry of ``down_proj``; :func:`expert_channel_scores`)
and a shared expert's channels (as a dense MLP's). Each expert keeps its own top
``round((1 - ratio)·I)`` channels, but every expert the same number: the fused 3-D parameters
``[E, 2I, H]`` hold one intermediate size for all experts, and the config states one
(``moe_intermediate_size`` / ``intermediate_size``), so unequal counts would need a module of another
shape than the family's. Every layer is pruned, so the config states the new sizes and plain
``from_pretrained`` reads the model. The router, attention heads (``heads=False`` is required: an MoE
block's attention is not yet pruned) and hidden slicing are left out, each refused in one line.

Layers. LLM-Pruner and MoreauPruner leave the first few and the last layers dense (e.g. layers
4..29 of the 32 in LLaMA-7B). Options ``first_layer`` / ``last_layer`` (inclusive; negative counts
from the end) choose the pruned range; the defaults prune every layer. Leaving layers dense makes
the sizes non-uniform, so it cannot be combined with ``uniform=True``. ``heads=False`` /
``channels=False`` leave the attention / the MLP alone.
"""
from __future__ import annotations

import contextlib
from abc import abstractmethod
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..runtime import engine
from ..ops.conventions import kept_count
from ..nn import compact
from ..nn.experts import expert_layout, fused_experts
from ..nn.families import (EXPERT_CHANNEL_FIELDS, GATED_MLPS, SHARED_EXPERT_CHANNEL_FIELDS, channel_rows,
                           experts_in_config, head_rows)
from ..nn.layout import (block_family, block_layout, check_block, check_heads_removable, config_accepts, config_fields,
                         family_fields, head_counts, hidden_slices, hidden_stream, layouts_uniform, recurrent_mixer)
from ..patterns import Structured
from .base import Method
from .options import option

ElementScores = Callable[[nn.Parameter], Optional[Tensor]]
#: what a structured method removes: each layer's heads and MLP channels, or the hidden channels
STRUCTURES = ("groups", "hidden")
#: the key of :attr:`StructuredMethod.layer_scores` holding the hidden-channel scores (every layer's)
STREAM = -1


def _score(linear: nn.Linear, rows: Optional[Tensor], groups: int, element_scores: ElementScores) -> Tensor:
    """The per-element scores of ``linear`` summed into ``groups`` groups: of its ``rows`` ([groups,
    width] row indices, with their bias entries) or, with ``rows`` None, of ``groups`` equal
    consecutive column blocks. fp32 [groups]; a parameter without scores counts as zero."""
    score = element_scores(linear.weight)
    if score is None:
        score = torch.zeros(linear.weight.shape, dtype=torch.float32, device=linear.weight.device)
    score = score.float()
    if rows is None:
        return score.reshape(score.shape[0], groups, -1).sum(dim=(0, 2))
    rows = rows.flatten().to(score.device)
    total = score.index_select(0, rows).reshape(groups, -1).sum(dim=1)
    bias = element_scores(linear.bias) if linear.bias is not None else None
    if bias is not None:
        total = total + bias.float().index_select(0, rows).reshape(groups, -1).sum(dim=1)
    return total


def group_scores(block: nn.Module, element_scores: ElementScores) -> Dict[str, Tensor]:
    """Importance of the coupled groups of a dense block (LLM-Pruner Eq. 4-5 with Agg = sum,
    MoreauPruner Eq. 4-5): ``element_scores(param)`` gives each weight's (and bias's) fp32
    per-element importance, or None for zero; all results fp32:

    * ``heads`` [heads]: each query head's rows of the attention input (q_proj, or its part of a
      fused qkv) + its columns of the attention output (o_proj);
    * ``kv_heads`` [kv_heads]: each key/value head's key and value rows;
    * ``channels`` [intermediate]: each MLP channel's input rows (gate_proj + up_proj, both parts of
      a fused gate_up, fc1) + its column of the MLP output (down_proj, fc2).
    """
    family = check_block(block)
    n_q, n_kv, hd = head_counts(family, block)
    mlp_out = block.get_submodule(family.mlp_out)
    n_ch = mlp_out.in_features
    counts = {"q": n_q, "kv": n_kv}
    with torch.no_grad():
        totals: Dict[str, Tensor] = {}
        for name, parts in head_rows(family, n_q, n_kv, hd).items():
            for role, rows in parts:
                score = _score(block.get_submodule(name), rows, counts[role], element_scores)
                totals[role] = totals[role] + score if role in totals else score
        channels = None
        for name, parts in channel_rows(family, n_ch).items():
            for rows in parts:
                score = _score(block.get_submodule(name), rows[:, None], n_ch, element_scores)
                channels = score if channels is None else channels + score
        out = block.get_submodule(family.attention_output)
        return {"heads": totals["q"] + _score(out, None, n_q, element_scores), "kv_heads": totals["kv"],
                "channels": channels + _score(mlp_out, None, n_ch, element_scores)}


def expert_channel_scores(fused: nn.Module, element_scores: ElementScores) -> Tensor:
    """Importance of each expert's intermediate channels in the fused experts module ``fused``
    (fp32 [E, I]): Σ of the element scores of its gate and up entries of ``gate_up_proj`` (and its
    bias) and its entries of ``down_proj`` (a parameter without scores counts as zero)."""
    layout = expert_layout(fused)[0]
    intermediate = layout.intermediate(fused)
    total = torch.zeros(fused.gate_up_proj.shape[0], intermediate, dtype=torch.float32)
    with torch.no_grad():
        for name in layout.parameters:
            score = element_scores(getattr(fused, name)) if layout.channel_dim(name) is not None else None
            if score is not None:
                total += layout.channel_totals(name, score.float().cpu(), intermediate)
    return total


def shared_expert(block: nn.Module, experts_name: str) -> Optional[nn.Module]:
    """The shared expert beside fused experts ``experts_name`` of ``block`` (Qwen2-MoE's, Llama 4's): a
    sibling ``shared_expert`` with gate_proj, up_proj and down_proj linears; None without one."""
    parent = experts_name.rpartition(".")[0]
    mlp = getattr(block.get_submodule(parent) if parent else block, "shared_expert", None)
    ok = mlp is not None and all(isinstance(getattr(mlp, n, None), nn.Linear)
                                 for n in ("gate_proj", "up_proj", "down_proj"))
    return mlp if ok else None


def gated_mlp_scores(module: nn.Module, element_scores: ElementScores,
                     names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Tensor:
    """Importance of the channels of the gated MLP whose gate, up and down linears are ``names`` inside
    ``module`` (fp32 [I]): each channel's gate and up rows and its down column, as a dense MLP channel's."""
    gate, up, down = (module.get_submodule(name) for name in names)
    channels = down.in_features
    rows = torch.arange(channels)[:, None]
    with torch.no_grad():
        return (_score(gate, rows, channels, element_scores) + _score(up, rows, channels, element_scores)
                + _score(down, None, channels, element_scores)).cpu()


def gated_mlp(block: nn.Module) -> Optional[Tuple[str, str, str]]:
    """The (gate, up, down) names of ``block``'s gated MLP among :data:`pyprune.nn.families.GATED_MLPS`,
    None without one."""
    return next((names for names in GATED_MLPS
                 if all(isinstance(_submodule(block, name), nn.Linear) for name in names)), None)


def _submodule(module: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def hidden_channel_scores(model: nn.Module, element_scores: ElementScores) -> Tensor:
    """Importance of each hidden channel d of ``model`` (fp32 [hidden_size]; LLM-Pruner's
    channel-wise group, Agg = sum): Σ over every parameter of :func:`pyprune.nn.layout.hidden_slices`
    of ``element_scores(param)`` summed over its slice at d (a parameter without scores counts as
    zero)."""
    total = torch.zeros(model.config.hidden_size, dtype=torch.float32)
    with torch.no_grad():
        for _, param, dim, _ in hidden_slices(model):
            score = element_scores(param)
            if score is None:
                continue
            score = score.float().cpu()
            total += score.movedim(dim, 0).reshape(score.shape[dim], -1).sum(dim=1)
    return total


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


def allowed_kept_count(total: int, ratio: float, allowed: Callable[[int], bool] = lambda n: True) -> int:
    """Of ``total`` groups, the count kept at ``ratio``: round((1 - ratio)·total), at least one, or,
    when ``allowed`` (the config's validation) rejects that count, the nearest allowed one (ties:
    the larger); all of them when none is."""
    target = max(1, kept_count(total, ratio))
    valid = [n for n in range(total, 0, -1) if allowed(n)]
    return min(valid, key=lambda n: (abs(n - target), -n)) if valid else total


def uniform_kv_groups(n_kv: int, ratio: float, allowed: Callable[[int], bool] = lambda n: True) -> int:
    """KV groups every layer keeps under uniform pruning (:func:`allowed_kept_count`)."""
    return allowed_kept_count(n_kv, ratio, allowed)


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



@contextlib.contextmanager
def gradients_for(model: nn.Module, params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Inside the block only ``params`` require gradients and the model is in eval mode (no
    dropout); both are restored after, and every ``.grad`` is cleared."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        model.eval()
        with torch.enable_grad():
            yield
    finally:
        model.train(was_training)
        for p, flag in flags:
            p.requires_grad_(flag)
        model.zero_grad(set_to_none=True)


class StructuredMethod(Method):
    """Structured pruning of heads and MLP channels, or of hidden channels (see the module
    docstring). A subclass gives :meth:`element_scores`: fp32 per-element importance of the pruned
    parameters. After a prune, ``layer_scores`` holds each pruned layer's :func:`group_scores`, or,
    with ``structure="hidden"``, ``{STREAM: {"hidden": hidden_channel_scores}}``, and
    :meth:`scoring_details` what the scoring reported. None of them depends on the ratio, which
    only cuts them: :meth:`use_scores` prunes at another ratio from the scores of an earlier prune."""

    patterns = (Structured,)
    structured_moe = True  # an MoE model's expert channels (see the module docstring)
    uses_gradients = True
    data_parallel = True  # its calibration enters only through calibration_gradients, summed over the ranks
    commands = ("prune", "robustness")
    calibration = (10, 128)  # LLM-Pruner's and MoreauPruner's batch: 10 samples of 128 tokens
    first_layer: int = option(0, "structured: first pruned decoder layer (negative: from the end)")
    last_layer: Optional[int] = option(None, "structured: last pruned decoder layer, inclusive (default: the "
                                       "last; negative: from the end)")
    heads: bool = option(True, "structured: prune attention heads")
    channels: bool = option(True, "structured: prune MLP channels")
    structure: str = option("groups", "structured: remove each layer's attention heads and MLP channels (groups) "
                            "or hidden channels, the same in every layer, embedding, norms and LM head included "
                            "(hidden: LLM-Pruner's channel-wise protocol)", choices=STRUCTURES)
    loss_scaling: bool = option(False, "structured: dynamic loss scaling of the gradient passes (scale, "
                                "back off on inf, as torch.amp.GradScaler), for fp16 models")

    #: (layer scores, scoring details) this method prunes from instead of scoring (:meth:`use_scores`)
    given_scores: Optional[Tuple[Dict[int, Dict[str, Tensor]], Dict]] = None

    @abstractmethod
    def element_scores(self, model: nn.Module, params: List[nn.Parameter], calib: Tensor, *,
                       batch_size: int, progress: bool) -> Dict[int, Tensor]:
        """Per-element fp32 importance of each of ``params`` (the pruned layers' weights and
        biases, or every hidden-stream parameter), keyed by ``id(param)``, computed with the model
        as it is (restore it after)."""

    def use_scores(self, layer_scores: Dict[int, Dict[str, Tensor]], details: Optional[Dict] = None
                   ) -> "StructuredMethod":
        """Make every later prune of this method select and compact from ``layer_scores`` instead of
        scoring: the :attr:`layer_scores` of an earlier prune of the same model, with the same
        settings and calibration, at any ratio (the scores do not depend on it). ``details`` (that
        prune's :meth:`scoring_details`) go into the report in place of this run's. A prune refuses
        scores whose layers or group counts are not the model's. Returns the method."""
        self.given_scores = ({index: dict(kinds) for index, kinds in layer_scores.items()}, dict(details or {}))
        return self

    def scoring_details(self) -> Dict:
        """What the last prune's scoring reports beside the pruned structure: the loss scale of its
        gradient passes (option ``loss_scaling``)."""
        if self.scaler is None:
            return {}
        return {"loss_scale": {"final": self.scaler.scale, "backoffs": self.scaler.backoffs}}

    def _scored(self, model: nn.Module, params: List[nn.Parameter], calib: Tensor, batch_size: int, progress: bool,
                grouping: Callable[[ElementScores], Dict[int, Dict[str, Tensor]]]) -> Dict[int, Dict[str, Tensor]]:
        """:attr:`layer_scores`: ``grouping`` (each layer's groups, their element scores summed) of the
        :meth:`element_scores` of ``params``, or the given scores (:meth:`use_scores`), checked
        against the groups ``grouping`` makes of this model."""
        if self.given_scores is None:
            scores = self.element_scores(model, params, calib, batch_size=batch_size, progress=progress)
            self.layer_scores = grouping(lambda p: scores.get(id(p)))
        else:
            self.layer_scores = _fitting(self.name, self.given_scores[0], grouping(lambda p: None))
        return self.layer_scores

    def calibration_gradients(self, model: nn.Module, params: Sequence[nn.Parameter], calib: Tensor, *,
                              batch_size: int, progress: bool = False) -> List[Tensor]:
        """∇ of the mean calibration loss for each of ``params`` (:func:`pyprune.runtime.engine.loss_gradients`;
        with the ``loss_scaling`` option through this prune's :class:`~pyprune.runtime.engine.LossScaler`)."""
        return engine.loss_gradients(model, params, calib, batch_size=batch_size, scaler=self.scaler,
                                     progress=progress, desc=self.name)

    def layer_range(self, n_layers: int) -> Tuple[int, int]:
        """The pruned layers as (first, last), inclusive, after resolving negative indices."""
        first = self.first_layer + n_layers if self.first_layer < 0 else self.first_layer
        last = n_layers - 1 if self.last_layer is None else self.last_layer
        last = last + n_layers if last < 0 else last
        if not 0 <= first <= last < n_layers:
            raise ValueError(f"layer range first_layer={self.first_layer}, last_layer={self.last_layer} "
                             f"selects no layers of a model with {n_layers} decoder blocks")
        return first, last

    def channels_only_refusal(self, model_kind: str, channels: str) -> Optional[str]:
        """Why these options cannot prune ``model_kind`` (an MoE model; a hybrid model), whose
        ``channels`` (expert channels; MLP channels) alone are pruned, in every layer; None when they can."""
        if self.structure == "hidden":
            return (f"option structure='hidden' of method {self.name!r} cannot slice {model_kind}'s hidden channels "
                    "yet; use structure='groups' with heads=False")
        if self.heads:
            return (f"method {self.name!r} prunes {model_kind}'s {channels} only: pass heads=False "
                    "(--heads false; its attention heads are not pruned yet)")
        if (self.first_layer, self.last_layer) not in ((0, None), (0, -1)):
            return (f"method {self.name!r} prunes the {channels} of every layer of {model_kind} (one config "
                    f"field states their count); first_layer={self.first_layer}, last_layer={self.last_layer} "
                    "select fewer")
        return None

    def moe_refusal(self) -> Optional[str]:
        """Why these options cannot prune an MoE model (its expert channels only, in every layer), or None."""
        return self.channels_only_refusal("an MoE model", "expert channels")

    def check_config(self, config, pattern) -> None:
        """An MoE model is refused from its config when the options ask for more than its expert
        channels (:meth:`moe_refusal`)."""
        super().check_config(config, pattern)
        experts = experts_in_config(config)
        refusal = self.moe_refusal() if experts else None
        if refusal:
            raise ValueError(f"{refusal}; {type(config).__name__} has mixture-of-experts blocks ({experts} experts)")

    def check_options(self, settings):
        if settings["structure"] == "hidden":
            changed = [f"{name}={settings[name]}" for name, default in
                       (("first_layer", 0), ("last_layer", None), ("heads", True), ("channels", True))
                       if settings[name] != default]
            if changed:
                raise ValueError(f"option structure='hidden' of method {self.name!r} removes hidden channels in "
                                 f"every layer; {', '.join(changed)} apply to structure='groups' only")

    def check(self, model: nn.Module, pattern) -> None:
        super().check(model, pattern)
        blocks = engine.decoder_blocks(model)
        prefix = engine.block_prefix(model)
        mixers = [(index, recurrent_mixer(block)) for index, block in enumerate(blocks) if recurrent_mixer(block)]
        refusal = self.channels_only_refusal("a hybrid model", "MLP channels") if mixers else None
        if refusal:  # named by the first mixer, MoE or not
            index, mixer = mixers[0]
            raise ValueError(f"block {prefix}.{index} of {type(model).__name__} mixes tokens with {mixer} "
                             f"({type(blocks[index].get_submodule(mixer)).__name__}), a convolution and recurrent "
                             f"state kept dense: {refusal}")
        self.check_config(getattr(model, "config", None), pattern)
        if any(fused_experts(block) for block in blocks):
            return self._check_moe(model, blocks, prefix)
        if mixers:
            return self._check_hybrid(model, blocks, prefix)
        for index, block in enumerate(blocks):
            check_block(block, f"block {prefix}.{index} of {type(model).__name__}")
            if self.structure == "groups" and self.heads:
                check_heads_removable(block, f"block {prefix}.{index} of {type(model).__name__}")
        if self.structure == "hidden":
            try:
                hidden_stream(model)
            except ValueError as error:
                raise ValueError(f"option structure='hidden' of method {self.name!r} cannot slice this model's "
                                 f"hidden channels: {error}") from error
            return
        first, last = self.layer_range(len(blocks))
        if pattern.uniform and pattern.ratio > 0:
            if (first, last) != (0, len(blocks) - 1):
                raise ValueError(f"uniform (config-compatible) pruning must prune every layer; "
                                 f"first_layer/last_layer select layers {first}..{last} of {len(blocks)}")
            if not layouts_uniform([block_layout(block) for block in blocks]):
                raise ValueError("uniform (config-compatible) pruning needs decoder blocks of equal sizes; "
                                 "this model's blocks already differ")

    def _check_moe(self, model: nn.Module, blocks, prefix: str) -> None:
        """An MoE model: options :meth:`moe_refusal` accepts, every block an MoE block without a
        recurrent mixer (its refusal names the mixer), config fields that state the expert sizes."""
        refusal = self.moe_refusal()
        if refusal:
            raise ValueError(f"{refusal}; {type(model).__name__} has mixture-of-experts blocks")
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None else None
        for index, block in enumerate(blocks):
            where = f"block {prefix}.{index} of {type(model).__name__}"
            experts = fused_experts(block, where=f"{prefix}.{index}")
            if not experts:
                raise ValueError(f"{where} is a dense block beside mixture-of-experts blocks: structured pruning of "
                                 "such a mix is not supported yet")
            for name, fused in experts.items():
                shared = shared_expert(block, name)
                sizes = {expert_layout(fused)[0].intermediate(fused): EXPERT_CHANNEL_FIELDS}
                if shared is not None:
                    sizes.setdefault(shared.down_proj.in_features, SHARED_EXPERT_CHANNEL_FIELDS)
                for size, fields in sizes.items():
                    if text is not None and _size_field(text, fields, size) is None:
                        raise ValueError(f"{where}.{name}: no config field ({', '.join(fields)}) states its "
                                         f"{size} channels, so a pruned model could not be read back")

    def _check_hybrid(self, model: nn.Module, blocks, prefix: str) -> None:
        """A hybrid model (a recurrent mixer in some blocks): every block has a gated MLP
        (:data:`pyprune.nn.families.GATED_MLPS`) whose channel count the config's ``intermediate_size``
        states (LFM2's ``block_auto_adjust_ff_dim`` derives another: refused)."""
        text = model.config.get_text_config() if getattr(model, "config", None) is not None else None
        for index, block in enumerate(blocks):
            where = f"block {prefix}.{index} of {type(model).__name__}"
            names = gated_mlp(block)
            if names is None:
                raise ValueError(f"{where} has no gated MLP pyprune knows (gate, up, down linears: "
                                 f"{'; '.join(', '.join(n) for n in GATED_MLPS)})")
            size = block.get_submodule(names[2]).in_features
            if text is not None and _size_field(text, ("intermediate_size",), size) is None:
                raise ValueError(f"{where}: its MLP's {size} channels are not the config's intermediate_size "
                                 f"({getattr(text, 'intermediate_size', None)}), so a pruned model could not be read back")

    def _uniform_kv_groups(self, model: nn.Module, blocks, ratio: float) -> int:
        """KV groups every layer keeps under uniform pruning, snapped to a count the model's
        config class accepts (transformers 5's LlamaConfig wants hidden_size % heads == 0)."""
        layout, family = block_layout(blocks[0]), block_family(blocks[0])
        groups = layout["heads"] // layout["kv_heads"]
        hidden = layout["shapes"][family.attention_output][0]
        channels = max(1, kept_count(layout["intermediate"], ratio)) if self.channels \
            else layout["intermediate"]
        config = getattr(model, "config", None)

        def allowed(n: int) -> bool:
            return config_accepts(config, family_fields(family, n * groups, n, layout["head_dim"], channels, hidden))

        return uniform_kv_groups(layout["kv_heads"], ratio if self.heads else 0.0, allowed)

    def _select(self, model, blocks, first, last, ratio, uniform, calib, batch_size, progress):
        """Kept (query heads, KV heads, channels) of each pruned layer, from the element scores."""
        params = [p for block in blocks[first:last + 1]
                  for linear in engine.block_linears(block).values() for p in linear.parameters()]
        scored = self._scored(model, params, calib, batch_size, progress,
                              lambda element: {index: group_scores(blocks[index], element)
                                               for index in range(first, last + 1)})
        n_groups = self._uniform_kv_groups(model, blocks, ratio) if uniform else None
        selections = {}
        for index, grouped in scored.items():
            n_q, n_kv, n_ch = (grouped[k].numel() for k in ("heads", "kv_heads", "channels"))
            q_kept, kv_kept = keep_heads(grouped["heads"], grouped["kv_heads"], ratio, uniform, n_groups) \
                if self.heads else (torch.arange(n_q), torch.arange(n_kv))
            ch_kept = keep_channels(grouped["channels"], ratio) if self.channels else torch.arange(n_ch)
            selections[index] = (q_kept, kv_kept, ch_kept, n_q, n_ch)
        return selections

    def _prune_hidden(self, model, ratio, calib, batch_size, progress) -> Dict:
        """Structure "hidden": score, select and slice the hidden channels (module docstring)."""
        hidden = model.config.hidden_size
        details = {"hidden_size": [hidden, hidden], "pruned_hidden_channels": []}
        if ratio > 0:
            params = [param for _, param, _, _ in hidden_slices(model)]
            scored = self._scored(model, params, calib, batch_size, progress,
                                  lambda element: {STREAM: {"hidden": hidden_channel_scores(model, element)}})
            channel_scores = scored[STREAM]["hidden"]
            count = allowed_kept_count(hidden, ratio, compact.hidden_width_check(model))
            keep = _top(channel_scores, count).sort().values
            compact.keep_hidden_channels_(model, keep)
            details = {"hidden_size": [hidden, count], "pruned_hidden_channels": _complement(keep, hidden)}
        return {**details, "config_compatible": True}

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        self.layer_scores = {}
        self.scaler = engine.LossScaler() if self.loss_scaling and self.given_scores is None else None
        if self.structure == "hidden":
            details = self._prune_hidden(model, float(pattern.ratio), calib, batch_size, progress)
            details["structure"] = [{"layer": index, "pruned": len(details["pruned_hidden_channels"]) > 0,
                                     **{key: block_layout(block)[key] for key in ("heads", "kv_heads")},
                                     "channels": block_layout(block)["intermediate"]}
                                    for index, block in enumerate(engine.decoder_blocks(model))]
        elif any(fused_experts(block) for block in engine.decoder_blocks(model)):
            details = self._prune_expert_channels(model, float(pattern.ratio), calib, batch_size, progress)
        elif any(recurrent_mixer(block) for block in engine.decoder_blocks(model)):
            details = self._prune_hybrid_channels(model, float(pattern.ratio), calib, batch_size, progress)
        else:
            details = self._prune_groups(model, pattern, calib, batch_size=batch_size, progress=progress)
        details.update(self.scoring_details() if self.given_scores is None else self.given_scores[1])
        return details

    def _prune_expert_channels(self, model, ratio, calib, batch_size, progress) -> Dict:
        """An MoE model: score every expert's and shared expert's channels, keep each expert's best
        (the same count in every expert), compact the fused parameters, state the sizes in the config."""
        blocks = engine.decoder_blocks(model)
        modules = [(index, name, fused, shared_expert(block, name)) for index, block in enumerate(blocks)
                   for name, fused in fused_experts(block).items()]
        structure: List[Dict] = []
        if ratio > 0 and self.channels:
            params = [p for _, _, fused, shared in modules
                      for p in [*fused.parameters(recurse=False), *(shared.parameters() if shared else ())]]

            def grouping(element: ElementScores) -> Dict[int, Dict[str, Tensor]]:
                grouped: Dict[int, Dict[str, Tensor]] = {}
                for index, name, fused, shared in modules:
                    grouped.setdefault(index, {})[name] = expert_channel_scores(fused, element)
                    if shared is not None:
                        grouped[index][f"{name}:shared"] = gated_mlp_scores(shared, element)
                return grouped

            scored = self._scored(model, params, calib, batch_size, progress, grouping)
            plan = []
            for index, name, fused, shared in modules:
                experts = scored[index][name]
                kept = torch.stack([keep_channels(row, ratio) for row in experts])
                entry = {"layer": index, "module": name, "experts": experts.shape[0], "channels": kept.shape[1],
                         "pruned_channels": [_complement(row, experts.shape[1]) for row in kept]}
                shared_kept = None
                if shared is not None:
                    shared_scores = scored[index][f"{name}:shared"]
                    shared_kept = keep_channels(shared_scores, ratio)
                    entry.update(shared_channels=shared_kept.numel(),
                                 pruned_shared_channels=_complement(shared_kept, shared_scores.numel()))
                plan.append((fused, kept, shared, shared_kept))
                structure.append(entry)
            fields = self._expert_fields(model, modules, plan)
            for fused, kept, shared, shared_kept in plan:
                compact.keep_expert_channels_(fused, kept)
                if shared is not None:
                    compact.keep_gated_mlp_channels_(shared, shared_kept)
            text = model.config.get_text_config()
            for key, value in fields.items():
                setattr(text, key, value)
        return {"first_layer": 0, "last_layer": len(blocks) - 1, "config_compatible": True,
                "structure": structure}

    def _prune_hybrid_channels(self, model, ratio, calib, batch_size, progress) -> Dict:
        """A hybrid model: score and keep every block's MLP channels, the same count in every block
        (recurrent mixers and attention stay dense), and state it in the config."""
        blocks = engine.decoder_blocks(model)
        mlps = [(block, gated_mlp(block)) for block in blocks]
        structure: List[Dict] = []
        if ratio > 0 and self.channels:
            params = [p for block, names in mlps for name in names for p in block.get_submodule(name).parameters()]
            scored = self._scored(model, params, calib, batch_size, progress,
                                  lambda element: {index: {"channels": gated_mlp_scores(block, element, names)}
                                                   for index, (block, names) in enumerate(mlps)})
            plan = []
            for index, (block, names) in enumerate(mlps):
                channel_scores = scored[index]["channels"]
                kept = keep_channels(channel_scores, ratio)
                plan.append((block, names, kept))
                structure.append({"layer": index, "mlp": names[2].rpartition(".")[0], "channels": kept.numel(),
                                  "pruned_channels": _complement(kept, channel_scores.numel())})
            for block, names, kept in plan:
                compact.keep_gated_mlp_channels_(block, kept, names)
            model.config.get_text_config().intermediate_size = plan[0][2].numel()
        return {"first_layer": 0, "last_layer": len(blocks) - 1, "config_compatible": True,
                "structure": structure}

    def _expert_fields(self, model, modules, plan) -> Dict[str, int]:
        """The config fields stating the kept expert (and shared expert) channel counts; ValueError,
        before anything changes, when one field would have to state two counts."""
        text = model.config.get_text_config()
        fields: Dict[str, int] = {}
        for (_, name, fused, shared), (_, kept, _, shared_kept) in zip(modules, plan):
            sizes = [(expert_layout(fused)[0].intermediate(fused), EXPERT_CHANNEL_FIELDS, kept.shape[1])]
            if shared is not None:
                sizes.append((shared.down_proj.in_features, SHARED_EXPERT_CHANNEL_FIELDS, shared_kept.numel()))
            for size, names, count in sizes:
                field = _size_field(text, names, size)
                if fields.setdefault(field, count) != count:
                    raise ValueError(f"method {self.name!r}: config field {field} would have to state {fields[field]} "
                                     f"and {count} channels ({name}); prune experts and shared expert to one size")
        return fields

    def _prune_groups(self, model, pattern, calib, *, batch_size, progress):
        blocks = engine.decoder_blocks(model)
        first, last = self.layer_range(len(blocks))
        ratio, uniform = float(pattern.ratio), bool(pattern.uniform)
        selections = {}
        if ratio > 0 and (self.heads or self.channels):
            selections = self._select(model, blocks, first, last, ratio, uniform, calib, batch_size, progress)
        for index, (q_kept, kv_kept, ch_kept, _, _) in selections.items():
            compact.keep_attention_heads_(blocks[index], q_kept, kv_kept)
            compact.keep_mlp_channels_(blocks[index], ch_kept)
        structure: List[Dict] = []
        for index, block in enumerate(blocks):
            layout = block_layout(block)
            entry = {"layer": index, "pruned": index in selections, "heads": layout["heads"],
                     "kv_heads": layout["kv_heads"], "channels": layout["intermediate"]}
            if index in selections:
                q_kept, kv_kept, ch_kept, n_q, n_ch = selections[index]
                entry["kept_heads"] = q_kept.tolist()
                entry["kept_kv_heads"] = kv_kept.tolist()
                entry["pruned_heads"] = _complement(q_kept, n_q)
                entry["pruned_channels"] = _complement(ch_kept, n_ch)
            structure.append(entry)
        fields = config_fields(blocks)
        config = getattr(model, "config", None)
        if not config_accepts(config, fields):
            fields = None
        if fields is not None and config is not None:
            for key, value in fields.items():
                setattr(config, key, value)
        return {"uniform": uniform, "first_layer": first, "last_layer": last,
                "config_compatible": fields is not None, "structure": structure}


def _size_field(config, names: Sequence[str], size: int) -> Optional[str]:
    """The first of the config fields ``names`` the config has, when it states ``size``; else None."""
    field = next((name for name in names if isinstance(getattr(config, name, None), int)), None)
    return field if field is not None and getattr(config, field) == size else None


def _fitting(method: str, given: Dict[int, Dict[str, Tensor]], groups: Dict[int, Dict[str, Tensor]]
             ) -> Dict[int, Dict[str, Tensor]]:
    """``given`` layer scores when they score the model's ``groups`` (the same layers, kinds and
    shapes); ValueError naming the first that differs otherwise."""
    shapes = {(index, kind): tuple(t.shape) for index, kinds in groups.items() for kind, t in kinds.items()}
    have = {(index, kind): tuple(t.shape) for index, kinds in given.items() for kind, t in kinds.items()}
    for key in sorted(shapes.keys() | have.keys(), key=str):
        if shapes.get(key) != have.get(key):
            raise ValueError(f"method {method!r}: the given scores do not fit this model: layer {key[0]} {key[1]} "
                             f"has shape {have.get(key)} there and {shapes.get(key)} here")
    return {index: {kind: given[index][kind] for kind in kinds} for index, kinds in groups.items()}


def _complement(kept: Tensor, total: int) -> List[int]:
    keep = torch.zeros(total, dtype=torch.bool)
    keep[kept] = True
    return torch.nonzero(~keep).flatten().tolist()
