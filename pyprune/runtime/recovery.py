"""Recovery fine-tuning ("RFT") of a pruned model with LoRA, merged back into its weights under their masks.

LLM-Pruner, MoreauPruner and DReSS all recover a pruned model by training low-rank adapters
(LoRA, through Hugging Face ``peft``) on a little text and merging them into the weights.
:func:`lora_finetune` does that for any model pyprune produces, structured ones included (each
layer is wrapped at its own, possibly pruned, size): it wraps the decoder blocks' linear layers
with LoRA adapters, trains them on next-token loss, merges them under each layer's mask (zero
weights stay zero, so an N:M or unstructured prune stays what it is) and
hands back the same model object with the same module objects and parameter names, so
:func:`pyprune.save` and plain ``from_pretrained`` treat it as any dense model.

DReSS (Table 6 / App. D) uses rank 32, LoRA alpha 10 (scale alpha/rank = 0.3125), learning rate
2e-5, batch 64 of 2048-token sequences, every other setting PEFT's default; see
:func:`lora_finetune` for the CPU defaults here and how to get the paper's.
"""
from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import distributed, engine
from .training import train
from .tokens import check_token_ids
from ..nn.layout import ATTENTION_LINEARS, MLP_LINEARS
from ..nn.sliced import check_plain_linears
from ..options import at_least_one, collect, nonempty, nonnegative, option, positive, shard_training

__all__ = ["lora_finetune", "check_settings", "check_group", "LoraSettings", "SETTINGS", "DEFAULT_TARGET_MODULES", "DEFAULTS"]


#: Every linear layer of a LLaMA-style decoder block. The papers do not name their LoRA targets;
#: LLM-Pruner's post_training.py adapts these seven, PEFT's own default for llama is q_proj, v_proj.
DEFAULT_TARGET_MODULES = ATTENTION_LINEARS + MLP_LINEARS


class LoraSettings:
    """The settings of LoRA recovery, declared once (:mod:`pyprune.options`): :func:`lora_finetune`
    checks its arguments with them (:func:`check_settings`), a recipe's ``method: lora`` stage has
    them as its options and ``pyprune recover`` as its flags. Rank and alpha as DReSS (Table 6);
    lr and batch sized for a CPU (the paper: 2e-5 at batch 64)."""

    steps: int = option(None, "optimizer steps; 0: no training", nonnegative)
    rank: int = option(32, "LoRA rank, as DReSS", at_least_one)
    alpha: float = option(10.0, "LoRA alpha, as DReSS; the scale is alpha/rank", positive)
    lr: float = option(1e-4, "AdamW learning rate, constant; DReSS: 2e-5", positive)
    batch_size: int = option(4, "training samples per step (DReSS: 64)", at_least_one)
    target_modules: Optional[Tuple[str, ...]] = option(
        None, "linears of the decoder blocks to adapt; none given: all, " + " ".join(DEFAULT_TARGET_MODULES) +
        "; PEFT's llama default: q_proj v_proj", nonempty)
    shard_training: bool = shard_training()


#: the declared settings of :func:`lora_finetune`, in order
SETTINGS = collect(LoraSettings, ())
#: their defaults by name (``DEFAULTS.rank``; ``steps`` has none: it is always given)
DEFAULTS = SimpleNamespace(**{declared.name: declared.default for declared in SETTINGS})


def check_settings(**given: Any) -> Dict[str, Any]:
    """Every setting of :func:`lora_finetune` (:data:`SETTINGS`): the given one converted and
    checked, or its default; ValueError naming the first bad one (what needs no model: ``pyprune
    recover`` calls it before loading one)."""
    unknown = sorted(set(given) - set(vars(DEFAULTS)))
    if unknown:
        raise ValueError(f"LoRA recovery has no setting {', '.join(unknown)}; its settings: "
                         f"{', '.join(vars(DEFAULTS))}")
    return {declared.name: declared.convert(given.get(declared.name, declared.default), "", where=declared.name)
            for declared in SETTINGS}


def check_group(shard_training: bool) -> None:
    """``shard_training`` only in a process group of several ranks (ValueError naming it otherwise;
    ``pyprune recover`` and ``run`` call it once they joined their group, before loading)."""
    if shard_training and not distributed.active():
        raise ValueError("setting shard_training of LoRA recovery shards its training over the ranks of a "
                         "torch.distributed group: run under torchrun --nproc-per-node N with N >= 2 (or in a "
                         "process group of 2 or more ranks); got one process")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tokens(model: nn.Module, tokens, batch_size: int) -> None:
    check_token_ids(tokens, model, "tokens")
    nsamples, seqlen = tokens.shape
    if seqlen < 2:
        raise ValueError(f"tokens must hold samples of at least 2 tokens (next-token loss); got shape "
                         f"{tuple(tokens.shape)}")
    if batch_size > nsamples:
        raise ValueError(f"batch_size must be <= the number of samples in tokens ({nsamples}); got {batch_size}")


def _targets(model: nn.Module, target_modules: Sequence[str]) -> Dict[str, nn.Linear]:
    """The decoder blocks' nn.Linear layers named by ``target_modules`` (a layer's name inside its
    block, or a suffix of it, as PEFT matches), by qualified name; every name must match one."""
    prefix = engine.block_prefix(model)
    found: Dict[str, nn.Linear] = {}
    unmatched = set(target_modules)
    available = set()
    for index, block in enumerate(engine.decoder_blocks(model)):
        for name, linear in engine.block_linears(block).items():
            available.add(name.rsplit(".", 1)[-1])
            hits = {t for t in target_modules if name == t or name.endswith("." + t)}
            if hits:
                found[f"{prefix}.{index}.{name}"] = linear
                unmatched -= hits
    if unmatched:
        raise ValueError(f"target_modules {sorted(unmatched)} match no nn.Linear of the decoder blocks; "
                         f"their linears: {', '.join(sorted(available))}")
    return found


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module) or next(model.parameters(), None) is None:
        raise ValueError(f"model must be a causal LM (nn.Module with parameters); got {type(model).__name__}")
    if hasattr(model, "peft_config"):
        raise ValueError("model already holds PEFT adapters (it has a peft_config); merge or unload them first")
    engine.decoder_blocks(model)  # a ValueError naming the supported models otherwise
    check_plain_linears(model, "peft's LoRA wraps only nn.Linear")


def lora_finetune(model: nn.Module, tokens: Tensor, *, steps: int, rank: int = DEFAULTS.rank,
                  alpha: float = DEFAULTS.alpha, lr: float = DEFAULTS.lr, batch_size: int = DEFAULTS.batch_size,
                  target_modules: Optional[Sequence[str]] = None,
                  seed: int = 0, progress: bool = True, shard_training: bool = False) -> Dict:
    """Recover a (pruned) causal LM with LoRA, in place, and merge the adapters into its weights.

    ``tokens`` are ``[nsamples, seqlen]`` token ids (as :func:`pyprune.inputs.data.calibration_samples`
    returns). LoRA adapters of ``rank`` and scale ``alpha / rank`` go on ``target_modules`` of
    every decoder block (default :data:`DEFAULT_TARGET_MODULES`, all seven linears q/k/v/o/gate/
    up/down; the DReSS paper does not name its targets and PEFT's default for llama is q_proj and
    v_proj only, so pass ``["q_proj", "v_proj"]`` for that). A name matches a block linear whose
    name inside the block is it or ends with ``.name``. Other LoRA settings are PEFT's defaults
    (dropout 0, no bias training, Kaiming-uniform A and zero B, so training starts at the
    model's own loss); adapters are fp32 also on a 16-bit model (PEFT's autocast).

    Training: ``steps`` AdamW steps (torch defaults, weight decay 0 as transformers' Trainer,
    constant ``lr``) of the mean next-token loss, each on ``batch_size`` samples drawn without
    replacement from a permutation reshuffled every epoch; ``seed`` fixes the adapters'
    initialisation and the order, and the caller's global RNG state is left as it was. The
    model is in train mode while training. With ``shard_training`` (in a process group of 2 or
    more ranks) a copy of the wrapped model trains sharded over the ranks, each decoder block an
    FSDP unit (:func:`pyprune.runtime.training.train`), so each rank holds its rows of the weights,
    adapters and optimiser state.

    Then the adapters are merged, each under its layer's mask: W += (alpha/rank)·BA ⊙ (W != 0) for
    a layer with zero weights (a pruned one keeps its N:M or unstructured mask exactly; the masked
    part of the update is dropped), W += (alpha/rank)·BA as peft's ``merge_and_unload`` for a dense
    one. ``model`` keeps its module objects and
    classes, parameter names, dtype and device; only the targeted layers' weights changed; its
    train/eval mode and ``requires_grad`` flags are restored and no peft attribute remains. If
    training fails (e.g. a non-finite loss) the adapters are dropped unmerged and the model is
    unchanged. ``steps=0`` returns the report without touching the model.

    Defaults are for CPU runs: the paper's batch of 64 × 2048 tokens is 128 times the 4 × 256
    tokens that already take ~17 s per step for SmolLM2-135M on one CPU thread, so
    ``batch_size=4`` (with short samples); and since a CPU run can afford only tens to hundreds
    of such small steps, ``lr=1e-4`` (LLM-Pruner's README recovery command) rather than the
    paper's 2e-5.
    The paper's settings are ``rank=32, alpha=10, lr=2e-5, batch_size=64`` on 2048-token samples
    (rank and alpha are the defaults already).

    Every argument is checked before the model is touched (ValueError naming it): ``steps`` < 0,
    ``rank`` < 1, ``alpha`` or ``lr`` <= 0, ``batch_size`` < 1 or above ``nsamples``, ``tokens``
    not 2-D integer ids in the vocabulary, a ``target_modules`` name that matches nothing, and a
    model with pyprune SparseLinear/SlicedLinear layers (peft can wrap only nn.Linear).

    Returns a report: the settings, ``target_modules`` (the names used), ``lora_layers``,
    ``trainable_parameters`` (rank · (in + out) per wrapped layer), ``masked_layers`` (those with
    zero weights, merged under their mask), ``losses`` (every step),
    ``first_loss``/``last_loss`` (None when ``steps=0``) and ``time_s``.
    """
    target_modules = check_settings(steps=steps, rank=rank, alpha=alpha, lr=lr, batch_size=batch_size,
                                    target_modules=target_modules, shard_training=shard_training)["target_modules"]
    check_group(shard_training)
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer; got {seed!r}")
    _check_model(model)
    _check_tokens(model, tokens, batch_size)
    names = tuple(DEFAULT_TARGET_MODULES if target_modules is None else target_modules)
    targets = _targets(model, names)
    report = {
        "steps": steps, "rank": rank, "alpha": float(alpha), "lr": float(lr), "batch_size": batch_size,
        "seed": seed, "nsamples": int(tokens.shape[0]), "seqlen": int(tokens.shape[1]),
        "target_modules": list(names), "lora_layers": len(targets),
        "trainable_parameters": sum(rank * (m.in_features + m.out_features) for m in targets.values()),
        "masked_layers": sum(not bool(m.weight.all()) for m in targets.values()),
    }
    start = time.perf_counter()
    losses = _finetune(model, tokens, targets, steps=steps, rank=rank, alpha=float(alpha), lr=float(lr),
                       batch_size=batch_size, seed=seed, progress=progress, shard=shard_training) if steps else []
    report.update(losses=losses, first_loss=losses[0] if losses else None,
                  last_loss=losses[-1] if losses else None, time_s=round(time.perf_counter() - start, 3))
    return report


@torch.no_grad()
def _merge_under_masks(model: nn.Module, masks: Dict[str, Tensor]) -> None:
    """Merge every LoRA adapter of the wrapped ``model`` into its layer's weight, W += s·BA ⊙ M,
    where M (``masks``, by qualified name) marks the weight's nonzero entries when it has zeros: a
    pruned layer keeps its mask (N:M or unstructured) exactly, and a dense layer merges as peft's
    ``merge_and_unload`` does."""
    from peft.tuners.lora import LoraLayer
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        weight = module.get_base_layer().weight
        for adapter in module.active_adapters:
            delta = module.get_delta_weight(adapter)
            mask = masks.get(name)
            weight += (delta if mask is None else delta * mask).to(weight.dtype)


def _finetune(model: nn.Module, tokens: Tensor, targets: Dict[str, nn.Linear], *, steps: int, rank: int,
              alpha: float, lr: float, batch_size: int, seed: int, progress: bool, shard: bool) -> List[float]:
    """Wrap ``targets`` with LoRA, train (with ``shard``, sharded over the ranks, each decoder block
    a unit), merge; the model's flags and config restored after."""
    import peft

    requires_grad = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    config = getattr(model, "config", None)
    config_fields = dict(vars(config)) if config is not None else None  # peft resets pretraining_tp
    device = next(model.parameters()).device
    masks = {name: linear.weight != 0 for name, linear in targets.items() if not bool(linear.weight.all())}
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets))
    merged = False
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            # peft 0.21 reads the attribute transformers 5 renamed to is_activation_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, lora)
        try:
            params = [p for p in wrapped.parameters() if p.requires_grad]
            wrapped.train()
            with torch.enable_grad():
                try:
                    losses = train(wrapped, params, tokens, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                                   desc="lora", progress=progress,
                                   shard=engine.decoder_blocks(model) if shard else ())["loss"]
                except FloatingPointError as error:
                    raise FloatingPointError(f"{error}; the adapters are dropped and the model is left "
                                             "unchanged") from None
            _merge_under_masks(model, masks)
            wrapped.unload()
            merged = True
        finally:
            if not merged:
                wrapped.unload()
            for m, mode in modes:
                m.train(mode)
            for p, flag in requires_grad:
                p.requires_grad_(flag)
            if config_fields is not None:
                vars(config).clear()
                vars(config).update(config_fields)
    return losses
