"""What a model is, measured: the sparsity of its prunable linear layers (and whether they fit N:M
patterns), its parameter count, and its size and forward cost (FLOPs per token): before and after
pruning, for the methods' reports and the evaluation alike."""
from __future__ import annotations

from typing import Dict, Iterable

from torch import nn

from ..patterns import NM
from .anatomy import block_linears, block_prefix, decoder_blocks, resident_blocks, unpruned_parameters
from .experts import expert_linears
from .layout import block_layout, check_block
from .sliced import SlicedLinear
from .sparse import SparseLinear


def sparsity_report(model: nn.Module, nm: Iterable[tuple] = ((2, 4), (4, 8))) -> Dict:
    """Measured sparsity of every prunable linear layer in the decoder blocks (an MoE's fused experts
    as one layer per expert matrix, ``...mlp.experts.3.gate_up_proj``) and overall, whether each
    layer satisfies the given N:M patterns, and the block parameters no linear-layer method prunes
    (``left_dense``: routers, hybrid mixers' convolutions and state, fused experts of a layout
    pyprune does not reproduce; :func:`~pyprune.nn.anatomy.unpruned_parameters`), with their
    parameter count, which the sparsity does not cover."""
    prefix = block_prefix(model)
    layers, zeros, total, left_dense = [], 0, 0, {}
    for index, block in resident_blocks(model):
        with expert_linears(block, strict=False):  # fused MoE experts measured one expert matrix at a time
            left_dense.update({f"{prefix}.{index}.{name}": size
                               for name, size in unpruned_parameters(block).items()})
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
