"""Token ids at the edges of the Python API: one rule, checked before a model is touched.

Calibration and training tokens (``pyprune.prune(..., calib)``, :func:`pyprune.runtime.recovery.lora_finetune`)
must be a torch integer tensor ``[nsamples, seqlen]`` of ids in ``[0, vocab_size)`` with ``seqlen``
within the model's ``max_position_embeddings``. Nothing else is converted: text, lists and NumPy
arrays are refused with the call that makes the tensor, so what a method runs on is never a guess.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def position_limit(config) -> Optional[int]:
    """The longest sequence the model's config allows (``max_position_embeddings``), or None when
    the config states none."""
    text_config = getattr(config, "get_text_config", lambda: config)()
    limit = getattr(text_config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def vocab_size(model: nn.Module) -> Optional[int]:
    """The number of token ids ``model`` embeds (its input embedding's rows), or None when it has none."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def check_token_ids(tokens, model: nn.Module, name: str = "calib") -> Tensor:
    """``tokens`` is a torch integer tensor [nsamples, seqlen] of ids ``model`` can embed, at most
    ``max_position_embeddings`` long; a ValueError or TypeError naming ``name`` says what is wrong
    and how to make the tensor. Returns ``tokens``."""
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        raise TypeError(f"{name} must be token ids (a torch integer tensor [nsamples, seqlen]), not text; "
                        "tokenize it first, e.g. pyprune.inputs.data.calibration_samples(tokenizer, source, "
                        "nsamples=..., seqlen=...)")
    if not isinstance(tokens, Tensor):
        hint = ("torch.from_numpy(" + name + ")" if type(tokens).__module__ == "numpy"
                else "torch.tensor(" + name + ")")
        raise TypeError(f"{name} must be a torch integer tensor [nsamples, seqlen] of token ids; got "
                        f"{type(tokens).__module__}.{type(tokens).__qualname__} (convert it with {hint})")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"{name} must hold integer token ids (int64); got dtype {tokens.dtype}")
    if tokens.dim() != 2:
        hint = f" ({name}[None] is one sample)" if tokens.dim() == 1 else ""
        raise ValueError(f"{name} must be [nsamples, seqlen]; got shape {tuple(tokens.shape)}{hint}")
    if tokens.numel() == 0:
        raise ValueError(f"{name} must hold at least one token; got shape {tuple(tokens.shape)}")
    vocab = vocab_size(model)
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise ValueError(f"{name} holds token ids in [{low}, {high}]; the model embeds ids in "
                         f"[0, {vocab if vocab is not None else 'vocab_size'})")
    limit = position_limit(getattr(model, "config", None))
    if limit is not None and tokens.shape[1] > limit:
        raise ValueError(f"{name} has sequences of {tokens.shape[1]} tokens; the model takes at most "
                         f"{limit} (max_position_embeddings)")
    return tokens
