"""Residual-stream rotations: a decoder block whose residual path is multiplied by a matrix.

SliceGPT (Ashkboos et al., 2024) expresses every block in its own rotated, sliced basis: the
residual entering the attention is in block l's basis, the attention writes in a middle basis, the
MLP in the next block's. The residual then crosses bases through the shortcut matrices
``Q_l[:, :k]^T Q_mid[:, :k]`` (around the attention) and ``Q_mid[:, :k]^T Q_{l+1}[:, :k]`` (around the MLP):
``h = x S_attn + attn(norm(x))``, ``y = h S_mlp + mlp(norm(h))`` (the paper's Eq. 9 with a
separate matrix per sub-layer, as in the authors' code). Every block's residual is k wide but the
last block's output may be wider (m, the LM head's width: the authors' default keeps the head
whole), its ``S_mlp`` then ``[k, m]``.

:class:`ResidualRotations` holds the two matrices of one block and applies them by hooks on the
block (it remembers the input ``x``), its attention and its MLP (each adds ``r S - r`` to its
output, so the block's own ``r + output`` becomes ``r S + output``): the block's forward stays the
model's own, for every family whose attention and MLP outputs are added to the residual as they
are (Llama, Mistral, Qwen2/3, Phi-3). The sum is exact up to one rounding of ``r`` in the model's
dtype. A block whose output is wider than its residual cannot add it itself: its MLP hook hands
``h S + output`` to a hook on the block's output, which returns it in place of the block's sum.

A model holding them is recorded by :func:`pyprune.save` (``residual_rotations`` in
``pyprune.json``) and rebuilt by :func:`pyprune.load`; plain ``from_pretrained`` refuses it.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .anatomy import decoder_blocks
from .layout import block_family

__all__ = ["ResidualRotations", "add_residual_rotations_", "residual_rotations", "sublayers", "DENSE_HIDDEN_SIZE"]

#: the config attribute that records the hidden size of the model before it was rotated and sliced
#: (the size its saved ``config.json`` states, so that ``from_pretrained`` refuses the checkpoint)
DENSE_HIDDEN_SIZE = "rotated_from_hidden_size"


class ResidualRotations(nn.Module):
    """The residual's matrices around a block's attention (``attention``, ``[k, k]``) and MLP
    (``mlp``, ``[k, m]``; m = k but in a last block that widens the stream):
    ``h = x @ attention + attn(...)``, ``y = h @ mlp + mlp(...)``."""

    def __init__(self, attention: Tensor, mlp: Tensor):
        super().__init__()
        if attention.dim() != 2 or attention.shape[0] != attention.shape[1] or mlp.dim() != 2 \
                or mlp.shape[0] != attention.shape[0] or mlp.shape[1] < mlp.shape[0]:
            raise ValueError(f"the attention rotation must be square [k, k] and the mlp rotation [k, m] with "
                             f"m >= k; got {list(attention.shape)} and {list(mlp.shape)}")
        self.attention = nn.Parameter(attention.detach().clone(), requires_grad=False)
        self.mlp = nn.Parameter(mlp.detach().clone(), requires_grad=False)
        self._residual: Optional[Tensor] = None
        self._output: Optional[Tensor] = None

    def _take(self) -> Tensor:
        residual, self._residual = self._residual, None
        if residual is None:
            raise RuntimeError("ResidualRotations: a sub-layer ran outside its block's forward")
        return residual

    @staticmethod
    def _replaced(output, value: Tensor):
        return (value,) + tuple(output[1:]) if isinstance(output, tuple) else value

    def before_block(self, block, args, kwargs) -> None:
        self._residual = args[0] if args else kwargs["hidden_states"]

    def after_attention(self, module, args, output):
        x = self._take()
        h = x @ self.attention + (output[0] if isinstance(output, tuple) else output)
        self._residual = h  # the MLP's residual
        return self._replaced(output, h - x)  # the block adds x back

    def after_mlp(self, module, args, output):
        h = self._take()
        y = h @ self.mlp + (output[0] if isinstance(output, tuple) else output)
        if y.shape == h.shape:
            return self._replaced(output, y - h)  # the block adds h back
        self._output = y  # wider than h: after_block returns it in place of the block's sum
        return self._replaced(output, torch.zeros_like(h))

    def after_block(self, block, args, output):
        y, self._output = self._output, None
        return None if y is None else self._replaced(output, y)

    def __getstate__(self):  # deepcopy / pickle: no activation travels with the module
        state = dict(self.__dict__)
        state["_residual"] = state["_output"] = None
        return state

    def extra_repr(self) -> str:
        k, m = self.mlp.shape
        return f"size={k}" if m == k else f"size={k}, output={m}"


def sublayers(block: nn.Module, name: str = "block") -> Tuple[nn.Module, nn.Module]:
    """(attention, MLP) of ``block``, whose outputs its forward adds to the residual as they are;
    ValueError (one line) for a family that normalises them first (Gemma) or is not Llama-style."""
    family = block_family(block, name)
    if len(family.norms) != 2 or family.norm_offset or family.post_norm:
        how = " after attention and MLP" if family.post_norm else " before attention and MLP in parallel" \
            if family.parallel else ""
        raise ValueError(f"{name}: residual rotations need a block whose attention and MLP outputs are added to the "
                         f"residual directly (two norms, Llama-style); family {family.name} has norms "
                         f"{', '.join(family.norms)}{how}")
    return block.get_submodule(family.attention), block.get_submodule(family.mlp_out.rpartition(".")[0])


def add_residual_rotations_(model: nn.Module, attention, mlp, dense_hidden_size: int) -> None:
    """Give every decoder block of ``model`` a :class:`ResidualRotations` (``block.residual_rotation``)
    with matrices ``attention[i]`` and ``mlp[i]``, hooked into its forward; ``dense_hidden_size`` is
    recorded in the config (:data:`DENSE_HIDDEN_SIZE`). Every matrix is ``[k, k]`` of one k but the
    last block's ``mlp``, ``[k, m]`` when the stream leaves it m wide (the LM head's width). Refuses
    a model that has them already."""
    blocks = decoder_blocks(model)
    if residual_rotations(model) is not None:
        raise ValueError("model already holds residual rotations")
    if len(attention) != len(blocks) or len(mlp) != len(blocks):
        raise ValueError(f"need one attention and one mlp rotation per block ({len(blocks)}); got "
                         f"{len(attention)} and {len(mlp)}")
    shapes = {tuple(matrix.shape) for matrix in [*attention, *mlp[:-1]]}
    if len(shapes) != 1:
        raise ValueError(f"every residual rotation but the last block's mlp must be [k, k] of one k; got shapes "
                         f"{sorted(shapes)}")
    points = [sublayers(block, f"block {i}") for i, block in enumerate(blocks)]
    for block, (attn, feed_forward), a, m in zip(blocks, points, attention, mlp):
        weight = next(block.parameters())
        rotation = ResidualRotations(a.to(weight), m.to(weight))
        block.residual_rotation = rotation
        block.register_forward_pre_hook(rotation.before_block, with_kwargs=True)
        attn.register_forward_hook(rotation.after_attention)
        feed_forward.register_forward_hook(rotation.after_mlp)
        block.register_forward_hook(rotation.after_block)
    setattr(model.config, DENSE_HIDDEN_SIZE, int(dense_hidden_size))


def residual_rotations(model: nn.Module) -> Optional[Dict[str, int]]:
    """``{"hidden_size": k, "head_size": m, "dense_hidden_size": d}`` when ``model``'s blocks hold
    :class:`ResidualRotations` (m: the width the last block leaves, the LM head's: k when the head
    is sliced too, d when it is whole), else None."""
    shapes = [tuple(module.mlp.shape) for module in model.modules() if isinstance(module, ResidualRotations)]
    if not shapes:
        return None
    return {"hidden_size": shapes[0][0], "head_size": shapes[-1][1],
            "dense_hidden_size": int(getattr(model.config, DENSE_HIDDEN_SIZE))}
