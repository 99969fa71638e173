"""Evaluation: perplexity on a token stream, a sparsity report of a model's linear layers, and its
size and forward cost (parameters, FLOPs per token)."""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..nn.anatomy import (block_linears, block_prefix, block_store, decoder_blocks, resident_blocks,
                          unpruned_matrices)
from ..nn.experts import expert_linears
from ..nn.layout import block_layout, check_block
from ..nn.sliced import SlicedLinear
from ..nn.sparse import SparseLinear
from ..patterns import NM


@torch.no_grad()
def perplexity(model: nn.Module, tokens: Tensor, seqlen: int, *, batch_size: int = 4,
               progress: bool = True, bos_token_id: Optional[int] = None) -> float:
    """exp of the mean next-token NLL over non-overlapping ``seqlen`` windows of a 1-D stream
    (the tail shorter than a window is dropped); log-softmax in fp32. With ``bos_token_id`` (the
    tokenizer's convention, :func:`pyprune.inputs.data.window_bos`) each window is that token and
    ``seqlen - 1`` text tokens, all of which are scored; without it the first token of a window is
    context only. Either way a window scores ``seqlen - 1`` tokens."""
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
    try:
        for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", unit="batch",
                          disable=not progress):
            batch = windows[start:start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            log_probs = F.log_softmax(logits, dim=-1)
            nll -= float(log_probs.gather(-1, batch[:, 1:, None]).sum())
            count += batch[:, 1:].numel()
    finally:
        model.train(was_training)
    return math.exp(nll / count)


def sparsity_report(model: nn.Module, nm: Iterable[tuple] = ((2, 4), (4, 8))) -> Dict:
    """Measured sparsity of every prunable linear layer in the decoder blocks (an MoE's fused experts
    as one layer per expert matrix, ``...mlp.experts.3.gate_up_proj``) and overall, whether each
    layer satisfies the given N:M patterns, and the block matrices no linear-layer method prunes
    (``left_dense``: routers, and fused experts of a layout pyprune does not reproduce, with their
    parameter count), which the sparsity does not cover."""
    prefix = block_prefix(model)
    layers, zeros, total, left_dense = [], 0, 0, {}
    for index, block in resident_blocks(model):
        with expert_linears(block, strict=False):  # fused MoE experts measured one expert matrix at a time
            left_dense.update({f"{prefix}.{index}.{name}": size for name, size in unpruned_matrices(block).items()})
            for name, module in block_linears(block).items():
                nonzero = module.weight.detach() != 0
                layer_zeros = int(nonzero.numel() - nonzero.sum())
                zeros += layer_zeros
                total += nonzero.numel()
                layers.append({
                    "name": f"{prefix}.{index}.{name}",
                    "shape": list(module.weight.shape),
                    "sparsity": layer_zeros / nonzero.numel(),
                    "nm_valid": {f"{n}:{m}": NM(n, m).fits(nonzero) for n, m in nm},
                })
    return {"sparsity": zeros / total if total else 0.0, "parameters": total, "layers": layers,
            "left_dense": {"tensors": sorted(left_dense), "parameters": sum(left_dense.values())},
            "nm_valid": {f"{n}:{m}": all(layer["nm_valid"][f"{n}:{m}"] for layer in layers) for n, m in nm}}


def parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def model_cost(model: nn.Module, seqlen: int) -> Dict[str, int]:
    """Parameters and forward FLOPs per token of a LLaMA-style causal LM, e.g. before and after
    pruning.

    ``flops_per_token = linear_flops + attention_flops``, where

    * ``linear_flops = 2 · Σ weight elements of every nn.Linear`` (lm_head included, also when tied
      to the embedding): one multiply and one add per weight;
    * ``attention_flops = Σ_layers 4 · heads · head_dim · seqlen``: a token attending to ``seqlen``
      keys computes, per query head, ``seqlen`` scores q·k and a sum of ``seqlen`` value vectors,
      2 · head_dim FLOPs each (the cost of the last token of a ``seqlen`` window; a causal
      window averages (seqlen + 1) / 2 keys per token).

    Biases, norms, activations, RoPE, softmax and the embedding lookup are not counted.
    ``parameters`` is :func:`parameter_count` (a tied embedding counts once)."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int):
        raise TypeError(f"seqlen must be an int (the number of keys a token attends to); got {seqlen!r}")
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1 (the number of keys a token attends to); got {seqlen}")
    not_dense = [name for name, m in model.named_modules() if isinstance(m, (SparseLinear, SlicedLinear))]
    if not_dense:
        raise ValueError(f"model_cost counts dense nn.Linear layers only; model has SparseLinear/SlicedLinear "
                         f"layers {not_dense[:3]}")
    linear_flops = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention_flops = 0
    for index, block in enumerate(decoder_blocks(model)):
        check_block(block, f"block {index}")
        layout = block_layout(block)
        attention_flops += 4 * layout["heads"] * layout["head_dim"] * seqlen
    return {"parameters": parameter_count(model), "linear_flops_per_token": linear_flops,
            "attention_flops_per_token": attention_flops, "flops_per_token": linear_flops + attention_flops}
