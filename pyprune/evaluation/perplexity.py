"""Evaluation: perplexity on a token stream (a model's sparsity, size and forward cost are
measured by :mod:`pyprune.nn.measure`)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..nn.anatomy import block_store
from ..runtime import distributed


@torch.no_grad()
def perplexity(model: nn.Module, tokens: Tensor, seqlen: int, *, batch_size: int = 4,
               progress: bool = True, bos_token_id: Optional[int] = None) -> float:
    """exp of the mean next-token NLL over non-overlapping ``seqlen`` windows of a 1-D stream
    (the tail shorter than a window is dropped); log-softmax in fp32. With ``bos_token_id`` (the
    tokenizer's convention, :func:`pyprune.inputs.data.window_bos`) each window is that token and
    ``seqlen - 1`` text tokens, all of which are scored; without it the first token of a window is
    context only. Either way a window scores ``seqlen - 1`` tokens.

    In a process group (:mod:`pyprune.runtime.distributed`) every rank calls it: each scores its
    shard of the batches of windows and the NLL sums (float64 sums of each batch's float32 sum) and
    token counts are added over the ranks, so every rank returns one process's perplexity (up to
    the last bits of the float64 sum)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream; got shape {tuple(tokens.shape)}")
    text = seqlen - 1 if bos_token_id is not None else seqlen
    n_windows = tokens.numel() // text if text > 0 else 0
    if n_windows == 0:
        raise ValueError(f"tokens has {tokens.numel()} tokens, fewer than one window of seqlen={seqlen}")
    if block_store(model) is not None:
        raise ValueError("perplexity needs the whole model in memory, not an offloaded one: save it "
                         "(pyprune.save) and evaluate the saved model")
    windows = tokens[: n_windows * text].reshape(n_windows, text)
    if bos_token_id is not None:
        windows = torch.cat([torch.full((n_windows, 1), int(bos_token_id), dtype=windows.dtype), windows], dim=1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    shard = distributed.shard(windows, batch_size, empty_ok=True)
    try:
        with distributed.failure_shared("perplexity"):
            for start in tqdm(range(0, shard.shape[0], batch_size), desc="perplexity", unit="batch",
                              disable=not progress):
                batch = shard[start:start + batch_size].to(device)
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
                log_probs = F.log_softmax(logits, dim=-1)
                nll -= float(log_probs.gather(-1, batch[:, 1:, None]).sum())
                count += batch[:, 1:].numel()
        nll, count = distributed.all_reduce_(torch.tensor([nll, count], dtype=torch.float64)).tolist()
    finally:
        model.train(was_training)
    return math.exp(nll / count)
