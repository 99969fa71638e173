"""SliceGPT (Ashkboos et al., 2024): rotate the residual stream by its principal components, delete
the directions of least variance.

1. Fold every RMSNorm's scale into the linears that read its output (§3.3: the norm becomes a plain
   normalisation, which commutes with an orthogonal Q: RMSNorm(XQ) = RMSNorm(X)Q); the final
   norm's goes into the LM head, which is untied from the embedding when they were shared.
2. Block by block on the calibration windows (the engine's order; each PCA sees the signal the
   already-sliced blocks before it produce, as in the authors' sequential code): the PCA of the
   residual-stream signal, Q = the eigenvectors of Σ XᵀX sorted by eigenvalue (Eq. 7), at three
   points of each block: its input (Q_l), the MLP norm's input (Q_mid) and its output (Q_{l+1}).
   Readers are rotated W ← W Q, writers W ← Qᵀ W (Eq. 8), the embedding by Q_0, the LM head by
   Q_L, and each residual crosses bases through its own shortcut Q_l[:, :k]ᵀ Q_mid[:, :k] around the
   attention and Q_mid[:, :k]ᵀ Q_{l+1}[:, :k] around the MLP (Eq. 9;
   :class:`pyprune.nn.rotation.ResidualRotations`).
3. Slice (Eq. 10): keep the first k rotated directions everywhere
   (:func:`pyprune.nn.keep_hidden_channels_`), k = d·(1 − ratio) rounded down to a multiple of
   ``multiple`` and of the head count (576 → 432 on SmolLM2-135M at 25%). The norms, now over k
   entries, multiply by sqrt(d/k) so that they still divide by the RMS over d, as the authors'
   RMSN does (the norm's eps then counts d/k times less: exact up to eps).

``slice_head`` (the authors' ``do_slice_head``, default False as theirs): when False the LM head,
the final norm and the last block's output keep all d directions: the last block's MLP output is
rotated by Q_L but not sliced, its shortcut is Q_mid[:, :k]ᵀ Q_L ([k, d], mapping the sliced
residual to d), and the head is rotated by Q_L at full width. When True they are sliced to k too.

One difference from the authors' code, stated in the report: no damping is added to Σ XᵀX (it
shifts the eigenvalues and leaves the eigenvectors).

Families: those whose attention and MLP outputs are added to the residual directly (Llama/SmolLM2,
Mistral, Qwen2/3, Phi-3). Gemma (four norms, (1 + w) scales, a scaled embedding) is refused.
The sliced model is saved with its rotations; :func:`pyprune.load` rebuilds it and plain
``from_pretrained`` refuses it.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn

from ..nn.measure import model_cost
from ..nn.anatomy import decoder_blocks
from ..nn.compact import keep_hidden_channels_
from ..nn.layout import block_family, config_accepts, hidden_stream
from ..nn.rotation import add_residual_rotations_, sublayers
from ..patterns import Structured
from ..runtime import distributed, engine
from .base import Method
from .options import at_least_one, option

_EIGEN_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def principal_directions(gram: Tensor) -> Tuple[Tensor, Tensor]:
    """(eigenvalues, eigenvectors as columns) of the symmetric ``gram`` = Σ XᵀX, by decreasing
    eigenvalue (Eq. 7): the first k columns span the k directions of most variance."""
    values, vectors = torch.linalg.eigh(gram)
    order = values.argsort(descending=True)
    return values[order], vectors[:, order]


def _gram(x: Tensor, dtype: torch.dtype) -> Tensor:
    flat = x.reshape(-1, x.shape[-1]).to(dtype)
    return flat.T @ flat


@torch.no_grad()
def _fold_norm(norm: nn.Module, readers: List[nn.Linear]) -> None:
    """W ← W diag(g) for every reader of ``norm``, then g ← 1."""
    scale = norm.weight.detach().double()
    for linear in readers:
        linear.weight.copy_((linear.weight.double() * scale).to(linear.weight.dtype))
    norm.weight.fill_(1.0)


@torch.no_grad()
def _rotate_in(linear: nn.Linear, q: Tensor) -> None:
    """A reader of the stream in the basis Q: W ← W Q."""
    linear.weight.copy_((linear.weight.double() @ q).to(linear.weight.dtype))


@torch.no_grad()
def _rotate_out(linear: nn.Linear, q: Tensor) -> None:
    """A writer of the stream in the basis Q: W ← Qᵀ W, b ← Qᵀ b."""
    linear.weight.copy_((q.T @ linear.weight.double()).to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((q.T @ linear.bias.double()).to(linear.bias.dtype))


def _kept_share(values: Tensor, k: int) -> float:
    return float(values[:k].sum() / values.sum())


class SliceGPT(Method):
    name = "slicegpt"
    patterns = (Structured,)
    calibration = (1024, 2048)  # the authors' code: 1024 WikiText-2 windows of 2048 tokens
    offload_refusal = "it rotates the embedding and every block in one pass"
    data_parallel = True  # the Gram matrices are summed over the ranks (equal up to their rounding)

    multiple: int = option(8, "SliceGPT: keep a multiple of this many directions (the authors' round_interval 8), "
                           "besides a multiple of the head count", at_least_one)
    eigen_dtype: str = option("float64", "SliceGPT: dtype of Σ XᵀX and its eigen-decomposition (paper: float64)",
                              choices=tuple(_EIGEN_DTYPES))
    slice_head: bool = option(False, "SliceGPT: slice the LM head and the last block's output to k too (the "
                              "authors' do_slice_head; false, their default: they keep the full hidden size)")

    def kept_width(self, config, ratio: float) -> int:
        """k = d·(1 − ratio) rounded down to a multiple of ``multiple`` and of the head count
        (the authors round down to their round_interval); ValueError when that keeps none or all."""
        d = config.hidden_size
        step = math.lcm(int(config.num_attention_heads), self.multiple)
        k = int((1.0 - ratio) * d) // step * step
        if not 0 < k < d:
            raise ValueError(f"ratio {ratio} of hidden size {d} keeps {k} directions once rounded down to a multiple "
                             f"of {step} (the head count {config.num_attention_heads} and multiple {self.multiple}); "
                             f"slicegpt needs 0 < k < {d}")
        return k

    def check_config(self, config, pattern) -> None:
        if not hasattr(config, "rms_norm_eps"):
            raise ValueError(f"method 'slicegpt' rotates RMS-norm models (Llama, Mistral, Qwen, Phi-3); "
                             f"{type(config).__name__} has no rms_norm_eps")
        k = self.kept_width(config, pattern.ratio)
        if not config_accepts(config, {"hidden_size": k}):
            raise ValueError(f"method 'slicegpt': {type(config).__name__} rejects hidden_size {k}")

    def check(self, model, pattern):
        super().check(model, pattern)
        hidden_stream(model)  # every hidden-stream tensor known, LayerNorm refused
        for index, block in enumerate(decoder_blocks(model)):
            sublayers(block, f"block {index}")  # Gemma's four norms and (1 + w) scales refused
        self.check_config(model.config, pattern)

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        k = self.kept_width(model.config, pattern.ratio)
        before = model_cost(model, calib.shape[1])
        details = self.rotate_and_slice_(model, calib, k, batch_size=batch_size, progress=progress)
        return {**details, "cost_before": before, "cost_after": model_cost(model, calib.shape[1])}

    @torch.no_grad()
    def rotate_and_slice_(self, model: nn.Module, calib: Tensor, k: int, *, batch_size: int = 8,
                          progress: bool = True) -> Dict:
        """Steps 1-3 on ``model`` in place, keeping ``k`` directions (k = hidden size: rotation
        only, the logits unchanged up to rounding); returns the report details."""
        stream = hidden_stream(model)
        d = model.config.hidden_size
        head = k if self.slice_head else d  # the width the last block leaves and the LM head reads
        eigen_dtype = _EIGEN_DTYPES[self.eigen_dtype]
        embed, lm_head = stream["embed"], stream["lm_head"]
        if lm_head.weight is embed.weight:  # Q_0 and Q_L differ: the head gets its own copy
            lm_head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
            model.config.tie_word_embeddings = False
        blocks = decoder_blocks(model)
        last = len(blocks) - 1
        families = [block_family(block) for block in blocks]
        for block, family in zip(blocks, families):
            attention_norm, mlp_norm = (block.get_submodule(n) for n in family.norms)
            _fold_norm(attention_norm, [block.get_submodule(n) for n in family.attention_inputs])
            _fold_norm(mlp_norm, [block.get_submodule(n) for n in family.mlp_in])
        _fold_norm(stream["norms"][stream["final_norm"]], [lm_head])

        basis: List[Tensor] = []  # Q of the current block's input
        shortcuts: Tuple[List[Tensor], List[Tensor]] = ([], [])
        kept: List[Dict[str, float]] = []

        def pca(signals) -> Tuple[Tensor, Tensor]:
            gram = distributed.all_reduce_(sum(_gram(x, eigen_dtype) for x in signals))  # over the ranks' shards
            values, vectors = principal_directions(gram)
            return values, vectors.double()

        def process(ctx: engine.BlockContext) -> Dict:
            family = families[ctx.index]
            dtype = next(ctx.block.parameters()).dtype
            if ctx.index == 0:
                values, q = pca([ctx.inputs])
                basis.append(q)
                embed.weight.copy_((embed.weight.double() @ q).to(embed.weight.dtype))
                ctx.inputs = (ctx.inputs.double() @ q[:, :k]).to(dtype)
                kept.append({"embedding": _kept_share(values, k)})
            q_in = basis[-1]
            # the sliced inputs, back in the original basis: the unrotated block computes on them
            x_full = (ctx.inputs.double() @ q_in[:, :k].T).to(dtype)
            attention, mlp = sublayers(ctx.block)
            mlp_norm = ctx.block.get_submodule(family.norms[1])
            middle: List[Tensor] = []
            handle = mlp_norm.register_forward_pre_hook(lambda module, args: middle.append(args[0].detach()))
            try:
                ctx.forward(x_full)
            finally:
                handle.remove()
            values_mid, q_mid = pca(middle)
            outputs = []
            for h in middle:  # the MLP on the sliced middle signal, its residual sliced too
                h = ((h.double() @ q_mid[:, :k]) @ q_mid[:, :k].T).to(dtype)
                outputs.append(h + mlp(mlp_norm(h)))
            del middle
            values_out, q_out = pca(outputs)
            k_out = head if ctx.index == last else k
            ctx.next_inputs = torch.cat([(y.double() @ q_out[:, :k_out]).to(dtype) for y in outputs])
            del outputs
            for name in family.attention_inputs:
                _rotate_in(ctx.block.get_submodule(name), q_in)
            _rotate_out(ctx.block.get_submodule(family.attention_output), q_mid)
            for name in family.mlp_in:
                _rotate_in(ctx.block.get_submodule(name), q_mid)
            _rotate_out(ctx.block.get_submodule(family.mlp_out), q_out)
            shortcuts[0].append(q_in[:, :k].T @ q_mid[:, :k])
            shortcuts[1].append(q_mid[:, :k].T @ q_out[:, :k_out])
            basis.append(q_out)
            kept.append({"attention_output": _kept_share(values_mid, k),
                         "block_output": _kept_share(values_out, k_out)})
            return {}

        engine.run_blockwise(model, calib, process, batch_size=batch_size, progress=progress, desc="slicegpt")
        _rotate_in(lm_head, basis[-1])
        keep_hidden_channels_(model, torch.arange(k), slice_head=self.slice_head)
        for name, norm in stream["norms"].items():  # divide by the RMS over d entries, as before slicing
            if self.slice_head or name != stream["final_norm"]:  # a whole final norm does already
                norm.weight.fill_(math.sqrt(d / k))
        add_residual_rotations_(model, *shortcuts, dense_hidden_size=d)
        return {"hidden_size": [d, k], "head_size": head, "eigen_dtype": self.eigen_dtype,
                "rotation_parameters": sum(a.numel() + m.numel() for a, m in zip(*shortcuts)),
                "kept_variance": {"embedding": kept[0]["embedding"],
                                  "attention_output": [r["attention_output"] for r in kept[1:]],
                                  "block_output": [r["block_output"] for r in kept[1:]]},
                "deviations": ["no damping of the Gram matrix (it does not move the eigenvectors)"]}
