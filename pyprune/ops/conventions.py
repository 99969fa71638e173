"""The conventions every backend and every caller shares (the kernels, the reference, the nn
layers and the methods):

* weights are ``[out, in]``; N:M groups are ``m`` consecutive elements of the last dim;
* masks are ``torch.bool`` with True = keep; among equal scores the lower index is kept;
* scores and statistics are fp32 whatever the input dtype;
* a fraction of a count is rounded halves up (:func:`kept_count`);
* the score a selection ranks by is a :class:`ScoreKind` (mirrored for C++/CUDA in
  ``csrc/score_kind.h``);
* the compressed N:M format is ``values [rows, in*n/m]`` (kept elements of each row, in index
  order) and ``meta [rows, ceil(in/8)] uint8``: the keep mask packed 8 columns per byte, column
  ``8*b + j`` in bit ``j`` of byte ``b`` (:func:`pack_mask`). For fp16/bf16 2:4 and 4:8 that is
  9/16 of the dense bytes.
"""
from __future__ import annotations

import math
from enum import IntEnum

import torch
import torch.nn.functional as F
from torch import Tensor


class ScoreKind(IntEnum):
    """What the score and mask kernels rank: one number per kind, shared by the Triton kernels, the
    C++ and CUDA kernels (``csrc/score_kind.h``, checked equal by tests/ops/test_conventions.py)."""
    GIVEN = 0       #: the input itself is the score
    MAGNITUDE = 1   #: |W|
    WANDA = 2       #: |W|·sqrt(act_sqnorm[col])
    TAYLOR = 3      #: |W ⊙ G| (first-order Taylor)


def round_half_up(value: float) -> int:
    """The nearest integer to ``value``, halves up (Python's ``round`` takes halves to even)."""
    return int(math.floor(value + 0.5))


def kept_count(count: int, sparsity: float) -> int:
    """Number of elements kept out of ``count`` at ``sparsity``: round((1 - sparsity)·count), halves up."""
    return round_half_up((1.0 - sparsity) * count)


def pack_mask(mask: Tensor) -> Tensor:
    """Pack a bool mask [rows, cols] into uint8 [rows, ceil(cols/8)], column 8b+j in bit j of byte b."""
    rows, cols = mask.shape
    padded = F.pad(mask.to(torch.uint8), (0, (-cols) % 8)).reshape(rows, -1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_mask(meta: Tensor, cols: int) -> Tensor:
    """Inverse of :func:`pack_mask`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=meta.device)
    bits = (meta.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(meta.shape[0], -1)[:, :cols].bool()


def sparse24_mma_meta(meta: Tensor, cols: int) -> Tensor:
    """The 2:4 sparse tensor-core metadata (csrc/cuda/sparse24_linear.cu) of a packed 2:4 keep mask:
    int16 [rows, cols/16]; word j holds groups 4j..4j+3 of its row, group i in bits 4i..4i+3 as
    (first kept position) | (second kept position) << 2, positions 0..3 in the group."""
    mask = unpack_mask(meta, cols).reshape(meta.shape[0], cols // 4, 4).to(torch.int32)
    first = mask.argmax(dim=-1)
    second = 3 - mask.flip(-1).argmax(dim=-1)
    codes = (first | (second << 2)).reshape(meta.shape[0], cols // 16, 4)
    shifts = torch.arange(0, 16, 4, device=meta.device)
    words = (codes << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)


def sparse24_mma_mask(mma_meta: Tensor, cols: int) -> Tensor:
    """Inverse of :func:`sparse24_mma_meta`: the bool 2:4 keep mask [rows, cols] of int16 mma.sp
    metadata [rows, cols/16]."""
    words = mma_meta.to(torch.int32) & 0xFFFF
    shifts = torch.arange(0, 16, 4, device=mma_meta.device)
    codes = (words.unsqueeze(-1) >> shifts) & 0xF  # [rows, cols/16, 4]: one code per group
    positions = torch.arange(4, device=mma_meta.device)
    mask = (positions == (codes & 3).unsqueeze(-1)) | (positions == (codes >> 2).unsqueeze(-1))
    return mask.reshape(mma_meta.shape[0], cols)
