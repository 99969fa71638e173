"""What every pruning method shares: its name, its declared options, the patterns it produces,
and how it runs."""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch
from torch import Tensor, nn

from ..nn import anatomy
from ..nn.experts import expert_linears, fused_experts
from ..nn.sliced import check_plain_linears
from ..io import memory
from ..runtime import distributed, engine, tokens
from ..patterns import NM, Pattern, Structured, Unstructured, written_as
from . import owl
from .options import Option, collect, nonnegative, option, positive, resolve

#: Every method class by name, filled as its module is imported (:meth:`Method.__init_subclass__`).
REGISTRY: Dict[str, Type["Method"]] = {}


class RunWarning(UserWarning):
    """A run that will do less than its options ask for (e.g. SAFE with fewer steps a block than its
    dual interval), said once before it starts."""


class Method(ABC):
    """A pruning method. ``prune`` changes the model in place and returns report details.

    Its options are declared once, as annotated class attributes (``lr: float = option(...)``,
    :mod:`pyprune.methods.options`), collected in order into ``options``; ``Method(**values)``
    converts and checks them (:func:`pyprune.methods.options.resolve`, then :meth:`check_options`)
    into ``settings``, which the report records and ``self.lr`` reads. A subclass that sets
    ``name`` registers itself: a new method is one module in this package.
    """

    name: str = ""
    #: the CLI subcommands this method serves (``pyprune prune``, ``continual``, ``robustness``)
    commands: Tuple[str, ...] = ("prune",)
    patterns: Tuple[Type, ...] = ()
    needs_calibration: bool = True
    default_scope = "row"
    #: the declared options in order (:func:`pyprune.methods.options.collect`)
    options: Tuple[Option, ...] = ()
    #: default calibration (nsamples, seqlen) of the CLI
    calibration: Tuple[int, int] = (64, 512)
    #: the method object accumulates across ``prune`` calls (COPAL; Wanda and SparseGPT after
    #: ``accumulate_across_calls``): a continual run keeps one per order instead of re-pruning from
    #: the dense model
    keeps_state: bool = False
    #: the method computes gradients (so it cannot run under ``torch.inference_mode()``)
    uses_gradients: bool = False
    #: why this method cannot prune an offloaded model (:mod:`pyprune.io.offload`); None when it can
    offload_refusal: Optional[str] = "it computes gradients through the whole model at once"
    #: the method runs data-parallel in a torch.distributed process group (:mod:`pyprune.runtime.distributed`),
    #: reducing its statistics over the ranks so that they give the one-process result
    data_parallel: bool = False
    #: its structured pattern applies to MoE models as a whole (SLEB's blocks, REAP's experts); the other
    #: structured methods prune heads and channels of dense blocks and refuse an MoE block
    structured_moe: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.options = collect(cls, cls.options)
        if not cls.__dict__.get("name"):
            return
        known = REGISTRY.get(cls.name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"method name {cls.name!r} is taken by {known.__module__}.{known.__qualname__}")
        REGISTRY[cls.name] = cls

    def __init__(self, **values: Any):
        self.settings: Dict[str, Any] = resolve(self.options, values, self.name)
        self.check_options(self.settings)

    def check_options(self, settings: Dict[str, Any]) -> None:
        """Constraints between options (each option alone is checked by its declaration)."""

    def check_continual(self) -> None:
        """Reject options that the continual runner (one method object per order, kept in memory)
        cannot honour; nothing by default."""

    def check_config(self, config, pattern: Pattern) -> None:
        """Reject a pattern the model's config rules out, or saved state of other settings, before
        the model's weights are loaded; nothing by default."""

    def resolve(self, pattern: Pattern) -> Pattern:
        """Unstructured patterns without a scope get this method's default scope."""
        if isinstance(pattern, Unstructured) and pattern.scope is None:
            return Unstructured(pattern.sparsity, self.default_scope)
        return pattern

    def check_pattern(self, pattern: Pattern,
                      write: Optional[Callable[[Tuple[Type, ...], Pattern], str]] = None) -> None:
        """Reject a pattern this method cannot produce: a ValueError naming the ones it supports and
        how to write one, ``write(self.patterns, pattern)`` (default: the ``pyprune.prune`` call)."""
        if not isinstance(pattern, self.patterns):
            allowed = ", ".join(p.__name__ for p in self.patterns)
            raise ValueError(f"method {self.name!r} supports patterns {allowed}; got {pattern}: write "
                             + (write or self._prune_call)(self.patterns, pattern))

    def _prune_call(self, kinds: Tuple[Type, ...], like: Pattern) -> str:
        """The ``pyprune.prune`` call with a pattern of ``kinds`` (the amount of ``like``)."""
        spelled = " or ".join(written_as(kind, like) for kind in kinds)
        imported = ", ".join(p.__name__ for p in kinds if p is Structured)
        return (f"pyprune.prune(model, {self.name!r}, {spelled}, ...)"
                + (f" with from pyprune.patterns import {imported}" if imported else ""))

    def check_loaded(self, model: nn.Module, pattern: Pattern) -> None:
        """The checks that need the model's weights in memory (e.g. a saved state's model
        fingerprint), after :meth:`check`; nothing by default."""

    def check(self, model: nn.Module, pattern: Pattern) -> None:
        """Reject a pattern this method cannot produce, or one the model's layers cannot take,
        before anything is modified. Changes nothing, on the model or on this object. Reads the
        model's structure alone, so the CLI runs it on the model built from its config (weights on
        ``meta``) before loading; what needs the weights goes in :meth:`check_loaded`."""
        self.check_pattern(pattern)
        check_plain_linears(model, f"method {self.name!r} prunes nn.Linear weights")
        if engine.block_store(model) is not None and self.offload_refusal is not None:
            raise ValueError(f"method {self.name!r} cannot prune an offloaded model: {self.offload_refusal}; "
                             "offload works with block-wise methods (magnitude, wanda, sparsegpt, safe, safe+, "
                             "masked-recon)")
        prefix = engine.block_prefix(model)
        for index, block in enumerate(engine.decoder_blocks(model)):
            experts = fused_experts(block, where=f"{prefix}.{index}")  # refuses a layout pyprune cannot prune
            if experts and not isinstance(pattern, (Unstructured, NM)) and not self.structured_moe:
                raise ValueError(f"method {self.name!r} cannot prune an MoE model ({prefix}.{index}."
                                 f"{next(iter(experts))}): its structured pruning acts on dense blocks; "
                                 "MoE models take unstructured or N:M patterns, or structured ones of taylor, moreau "
                                 "and smoothgrad (expert channels), sleb (blocks) and reap (whole experts)")
            if isinstance(pattern, NM):
                with expert_linears(block, where=f"{prefix}.{index}"):
                    for name, linear in engine.block_linears(block).items():
                        pattern.check_layer(f"{prefix}.{index}.{name}", linear.in_features)

    def check_calibration(self, model: nn.Module, calib) -> None:
        """Reject missing calibration tokens of a method that needs them, and calibration that is not
        token ids of ``model`` (:func:`pyprune.runtime.tokens.check_token_ids`)."""
        if calib is None:
            if self.needs_calibration:
                raise ValueError(f"method {self.name!r} needs calibration tokens calib of shape [nsamples, seqlen]")
            return
        tokens.check_token_ids(calib, model, "calib")
        self.check_samples(calib.shape[0])

    def check_samples(self, nsamples: int) -> None:
        """Warn (:class:`RunWarning`) when ``nsamples`` calibration samples are too few for the run
        the options ask for (the CLI asks before the model loads); nothing by default."""

    def data_parallel_refusal(self) -> Optional[str]:
        """Why this method, with these settings, cannot run data-parallel (None when it can: it
        reduces its statistics over the ranks, :attr:`data_parallel`)."""
        return None if self.data_parallel else "it does not run data-parallel yet"

    def check_distributed(self) -> None:
        """In a process group of several ranks, refuse a method that does not reduce its statistics
        over them (each rank would prune from its own shard of the calibration)."""
        refusal = self.data_parallel_refusal() if distributed.active() else None
        if refusal is not None:
            raise ValueError(f"method {self.name!r} cannot run in a torch.distributed group of "
                             f"{distributed.world_size()} ranks: {refusal}; run it in one process")

    def check_grad_mode(self) -> None:
        """A method that computes gradients turns them on itself (it runs under ``torch.no_grad()``
        too), but no code can leave ``torch.inference_mode()``: refused there, saying so."""
        if self.uses_gradients and torch.is_inference_mode_enabled():
            raise RuntimeError(f"method {self.name!r} computes gradients, which torch.inference_mode() forbids; "
                               "call pyprune.prune outside it (torch.no_grad() is fine)")

    def prune(self, model: nn.Module, pattern: Pattern, calib: Optional[Tensor] = None, *,
              batch_size: int = 8, progress: bool = True) -> Dict:
        """Prune ``model`` in place; return details for the report. Checks everything first
        (:meth:`check`, :meth:`check_calibration`, the memory it needs:
        :func:`pyprune.io.memory.check_prune`), then runs :meth:`_prune` on the resolved pattern."""
        self.check_grad_mode()
        self.check_distributed()
        anatomy.check_materialised(model, f"pruning with {self.name}")
        self.check(model, pattern)
        self.check_loaded(model, pattern)
        self.check_calibration(model, calib)
        nsamples, seqlen = calib.shape if calib is not None else (0, 0)
        memory.check_prune(model, self, nsamples, seqlen, batch_size, f"pruning with {self.name}",
                           resident=memory.resident_bytes(model), offload_hint="load_model(..., offload_dir=DIR)")
        return self._prune(model, self.resolve(pattern), calib, batch_size=batch_size, progress=progress)

    def working_bytes(self, block: nn.Module) -> int:
        """Estimated memory this method needs for ``block`` beyond its weights and the calibration
        activations (:func:`pyprune.io.memory.prune_need`): an fp32 score and a mask of its largest
        linear layer (an MoE's expert matrices among them)."""
        with expert_linears(block, strict=False):
            return 5 * max(linear.weight.numel() for linear in engine.block_linears(block).values())

    @abstractmethod
    def _prune(self, model: nn.Module, pattern: Pattern, calib: Optional[Tensor], *,
               batch_size: int, progress: bool) -> Dict:
        """The method itself, on a checked model, a resolved pattern and checked calibration."""


class LayerSparsityMethod(Method):
    """An unstructured method whose sparsity can vary by decoder block: with the option ``owl``,
    OWL's allocation (:mod:`pyprune.methods.owl`) from the dense model's outlier ratios on the
    calibration tokens (calibration then needed by every such method, magnitude included), the
    target sparsity the blocks' mean. :meth:`block_pattern` gives a block's pattern; the report's
    ``owl`` records each block's outlier ratio and sparsity."""

    owl: bool = option(False, "OWL: non-uniform sparsity per decoder block from its outlier ratio, averaging "
                       "to the target (unstructured patterns)")
    owl_m: float = option(5.0, "OWL: a weight is an outlier when its Wanda score exceeds M x its block's mean "
                          "(paper: 5)", positive)
    owl_lambda: float = option(0.08, "OWL: the block sparsities span 2 x lambda around the target (paper: 0.08)",
                               nonnegative)

    def __init__(self, **values: Any):
        super().__init__(**values)
        if self.owl:
            self.needs_calibration = True  # the outlier ratios come from the calibration activations
        self._block_sparsities: Optional[list] = None

    def check(self, model: nn.Module, pattern: Pattern) -> None:
        if self.owl and not isinstance(pattern, Unstructured):
            raise ValueError(f"option owl of method {self.name!r} allocates unstructured sparsity per block; "
                             f"pattern {pattern} cannot vary by block (give a sparsity in [0, 1))")
        if self.owl:
            owl.check_spread(pattern.sparsity, self.owl_lambda, len(engine.decoder_blocks(model)))
        super().check(model, pattern)

    def block_pattern(self, pattern: Pattern, index: int) -> Pattern:
        """Block ``index``'s pattern: OWL's sparsity for it in ``pattern``'s scope, or ``pattern``."""
        if self._block_sparsities is None:
            return pattern
        return Unstructured(self._block_sparsities[index], pattern.scope)

    def prune(self, model: nn.Module, pattern: Pattern, calib: Optional[Tensor] = None, *,
              batch_size: int = 8, progress: bool = True) -> Dict:
        """:meth:`Method.prune`; with ``owl``, the block sparsities are allocated first."""
        if not self.owl:
            return super().prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        self.check_grad_mode()
        self.check_distributed()
        self.check(model, pattern)
        self.check_loaded(model, pattern)
        self.check_calibration(model, calib)
        ratios = owl.block_outlier_ratios(model, calib, self.owl_m, batch_size=batch_size, progress=progress)
        self._block_sparsities = owl.allocate(ratios, pattern.sparsity, self.owl_lambda)
        try:
            details = super().prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        finally:
            sparsities, self._block_sparsities = self._block_sparsities, None
        details["owl"] = {"outlier_ratio": [round(r, 6) for r in ratios],
                          "block_sparsity": [round(s, 6) for s in sparsities]}
        return details


class BlockwiseMethod(Method):
    """A method that prunes the decoder blocks one at a time (:func:`pyprune.runtime.engine.run_blockwise`):
    it can prune an offloaded model, and resume from its finished blocks (its ``checkpoint`` option,
    which a subclass declares last: ``checkpoint: Optional[str] = block_checkpoint()``)."""

    offload_refusal: Optional[str] = None
    checkpoint: Optional[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name") and "checkpoint" not in {declared.name for declared in cls.options}:
            raise TypeError(f"block-wise method {cls.name!r} must declare checkpoint: Optional[str] = "
                            "block_checkpoint()")

    def check_config(self, config, pattern: Pattern) -> None:
        """A block checkpoint of other settings is refused from its index, before the model loads."""
        checkpoint = self.block_checkpoint(None, self.resolve(pattern), None)
        if checkpoint is not None:
            checkpoint.finished(parts=("method", "settings", "pattern", "scope"))

    def block_checkpoint(self, model: Optional[nn.Module], pattern: Pattern,
                         calib: Optional[Tensor]) -> Optional[engine.BlockCheckpoint]:
        """Where block-wise pruning saves its finished blocks (None without ``checkpoint``), keyed by
        this run's settings, pattern, model and calibration tokens (None before they exist); the
        options that say where and how the run goes, not what it computes (``checkpoint``,
        ``shard_training``), are left out, so a run resumes with or without sharding."""
        if self.checkpoint is None:
            return None
        settings = {k: v for k, v in self.settings.items() if k not in ("checkpoint", "shard_training")}
        return engine.BlockCheckpoint.of_run(self.checkpoint, self.name, settings, pattern, model, calib,
                                             dense_propagation=getattr(self, "propagate", None) == "dense")


class LayerwiseMaskMethod(LayerSparsityMethod, BlockwiseMethod):
    """Unstructured / N:M methods that prune each linear layer of each block from statistics
    of that layer's calibration inputs (the layer-wise engine). An MoE expert matrix sees the tokens
    routed to its expert; one that no calibration token reaches is pruned by magnitude instead, and
    the report's ``magnitude_fallback`` counts and names them."""

    patterns = (Unstructured, NM)

    @abstractmethod
    def new_stats(self, name: str, linear: nn.Linear):
        """Per-layer statistics object for the linear layer ``name`` (qualified, e.g.
        'model.layers.3.mlp.up_proj'), updated by ``update`` for every calibration batch."""

    @abstractmethod
    def update(self, stats, x: Tensor, y: Tensor) -> None:
        """Add one batch of the layer's inputs ``x`` and outputs ``y`` to ``stats``."""

    @abstractmethod
    def prune_layer(self, linear: nn.Linear, stats, pattern: Pattern) -> None:
        """Prune ``linear`` in place from its statistics."""

    #: the layer solve is costly (SparseGPT's OBS sweep, ALPS's ADMM): in a process group each rank
    #: solves its share of a block's layers (:func:`pyprune.runtime.distributed.owners`) and broadcasts
    #: their weights; otherwise every rank prunes every layer from the same reduced statistics
    distribute_solves = False

    def reduce_stats(self, stats, dst: Optional[int]):
        """A layer's statistics summed over the ranks, on every rank (``dst`` None) or on rank ``dst``
        alone (None on the others); they are a sum, a float64 tensor by default (see
        :mod:`pyprune.runtime.distributed` on exactness). In one process, ``stats``."""
        return distributed.all_reduce_(stats) if dst is None else distributed.reduce_(stats, dst)

    def prepare_block(self, ctx: engine.BlockContext) -> None:
        """Called before a block's inputs are captured (e.g. to restore weights a method keeps).
        With cumulative statistics: every layer back to its dense weights."""
        if self._kept_stats is not None:
            restore_dense_weights(ctx, self._dense_weights)

    #: next block's inputs from the block's outputs before pruning ("dense") or after ("pruned")
    propagate = "pruned"

    #: the statistics are sums over calibration tokens, so they can also sum over datasets
    #: (:meth:`accumulate_across_calls`)
    can_accumulate = False
    _kept_stats: Optional[Dict[str, Any]] = None
    #: calibration tokens each layer's kept statistics cover (by qualified name), with ``_kept_stats``
    _kept_tokens: Optional[Dict[str, int]] = None

    def accumulate_across_calls(self) -> "LayerwiseMaskMethod":
        """Keep this object's per-layer statistics and the dense weights between ``prune`` calls
        (the continual runner's cumulative initialisation, the control of COPAL's accumulation):
        each call adds its calibration data to the statistics of the earlier calls and prunes the
        dense weights from the sum, so a weight pruned earlier can come back. Returns ``self``."""
        if not self.can_accumulate:
            raise ValueError(f"method {self.name!r} cannot accumulate its statistics across calls")
        if self.checkpoint is not None:
            raise ValueError(f"method {self.name!r}: a checkpoint restores finished blocks without their statistics, "
                             "so it cannot accumulate them across calls")
        self.keeps_state = True
        self.offload_refusal = "it keeps every layer's dense weights across calls (accumulate_across_calls)"
        self._kept_stats, self._dense_weights, self._kept_tokens = {}, {}, {}
        return self

    def _layer_stats(self, name: str, linear: nn.Linear):
        """:meth:`new_stats`, or the ones this object kept for ``name`` from earlier calls."""
        if self._kept_stats is None:
            return self.layer_statistics(name, linear)
        if name not in self._kept_stats:
            self._kept_stats[name] = self.layer_statistics(name, linear)
        return self._kept_stats[name]

    # What the engine calls on a layer's statistics: by default the method's own new_stats, update,
    # reduce_stats and prune_layer; a composable step (DSnoT's mask refinement, :mod:`.dsnot`) wraps them.
    def layer_statistics(self, name: str, linear: nn.Linear):
        return self.new_stats(name, linear)

    def observe(self, stats, x: Tensor, y: Tensor) -> None:
        self.update(stats, x, y)

    def reduce_layer(self, stats, dst: Optional[int]):
        return self.reduce_stats(stats, dst)

    def prune_from(self, linear: nn.Linear, stats, pattern: Pattern) -> None:
        self.prune_layer(linear, stats, pattern)

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        def process(ctx: engine.BlockContext) -> Dict:
            self.prepare_block(ctx)
            block_pattern = self.block_pattern(pattern, ctx.index)
            linears = ctx.linears()
            stats = {name: self._layer_stats(f"{ctx.name}.{name}", linear) for name, linear in linears.items()}
            kept = self._kept_tokens or {}
            tokens = {name: kept.get(f"{ctx.name}.{name}", 0) for name in linears}

            def observe(name, linear, x, y):
                tokens[name] += x.numel() // x.shape[-1]
                self.observe(stats[name], x, y)

            outputs = ctx.capture(observe)
            self.prune_block_layers(linears, stats, tokens, block_pattern)
            unreached = [name for name in linears if tokens[name] == 0]
            if self._kept_tokens is not None:
                self._kept_tokens.update({f"{ctx.name}.{name}": count for name, count in tokens.items()})
            if self.propagate == "dense":
                ctx.next_inputs = outputs
            return {"magnitude_fallback": [f"{ctx.name}.{name}" for name in unreached]}

        blocks = engine.run_blockwise(model, calib, process, batch_size=batch_size, progress=progress,
                                      desc=self.name, checkpoint=self.block_checkpoint(model, pattern, calib))
        fallback = [name for block in blocks for name in (block or {}).get("magnitude_fallback", [])]
        return {"scope": getattr(pattern, "scope", None),
                "magnitude_fallback": {"layers": len(fallback), "names": fallback}}


    def prune_block_layers(self, linears: Dict[str, nn.Linear], stats: Dict[str, Any], tokens: Dict[str, int],
                           pattern: Pattern) -> None:
        """Prune a block's layers from their statistics, reduced over the ranks first (``tokens``, the
        tokens each layer saw, too: in place); a layer no token reached (an MoE expert) by magnitude.
        With :attr:`distribute_solves` every statistic is reduced onto its layer's owner, each rank
        solves its own layers, then every solved weight is broadcast from its owner."""
        counts = distributed.all_reduce_(torch.tensor([tokens[name] for name in linears], dtype=torch.int64))
        tokens.update(zip(linears, counts.tolist()))
        owners = dict(zip(linears, distributed.owners([self.solve_cost(linear) for linear in linears.values()])))
        reduced = {}
        for name in linears:
            if tokens[name]:
                local = stats.pop(name)
                if self._kept_stats is not None and distributed.active():
                    local = copy.deepcopy(local)  # the kept statistics stay this rank's own sums
                reduced[name] = self.reduce_layer(local, owners[name] if self.distribute_solves else None)
        for name, linear in linears.items():
            if not tokens[name]:  # no statistics anywhere, so by magnitude
                apply_mask(linear, pattern.weight_mask(linear.weight))
            elif reduced[name] is not None:
                self.prune_from(linear, reduced.pop(name), pattern)
        if self.distribute_solves and distributed.active():
            for name, linear in linears.items():
                if tokens[name]:
                    distributed.broadcast_(linear.weight.data, owners[name])

    @staticmethod
    def solve_cost(linear: nn.Linear) -> float:
        """A layer solve's relative cost for :attr:`distribute_solves`: in²·(in + out), the
        factorisation of its [in, in] statistic and a sweep of its weights against it."""
        return float(linear.in_features ** 2 * (linear.in_features + linear.out_features))


@torch.no_grad()
def restore_dense_weights(ctx: engine.BlockContext, dense: Dict[str, Tensor]) -> None:
    """Put every linear layer of the block back to its weights in ``dense`` (by qualified name),
    or record them there on the first visit: a continual method always prunes the dense model."""
    for name, linear in ctx.linears().items():
        qualified = f"{ctx.name}.{name}"
        if qualified not in dense:
            dense[qualified] = linear.weight.detach().clone()
        elif dense[qualified].shape != linear.weight.shape:
            raise ValueError(f"{qualified}: the kept dense weights have shape {tuple(dense[qualified].shape)}, "
                             f"the model's {tuple(linear.weight.shape)}; use a new method object for another model")
        else:
            dense[qualified] = dense[qualified].to(linear.weight.device)
            linear.weight.copy_(dense[qualified])


@torch.no_grad()
def apply_mask(linear: nn.Linear, keep: Tensor) -> None:
    """Zero the pruned weights of ``linear`` in place."""
    linear.weight.mul_(keep.to(linear.weight.dtype))
