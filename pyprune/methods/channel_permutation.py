"""RIA's channel permutation for N:M sparsity (Zhang et al., ICLR 2024, §3.3): reorder a layer's
input channels so that the N:M mask of the permuted scores keeps more of their sum.

As in the authors' code (``prune_ria`` with ``--reallocation --lsa``):
1. heuristic channel allocation: the channels sorted by their summed score (ascending) are cut
   into m equal chunks; group g takes the g-th channel of every chunk, the chunks read in
   alternating direction (snake order), so that every group gets one channel of each quantile;
2. linear sum assignment, once for each position c of a group in turn: the channels at position c
   are reassigned among the groups to maximise the total kept score, Σ over groups of the score
   the N:M mask keeps in that group (:func:`pyprune.ops.assignment.linear_sum_assignment`).
The assignment never lowers the kept score (keeping every channel in place is one of its
choices); the heuristic may, so the identity is returned when the result keeps less than it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.assignment import linear_sum_assignment

#: candidate groups evaluated at once in an assignment's profit matrix (bounds its working memory)
_GROUPS_AT_ONCE = 16


def kept_score(scores: Tensor, n: int, m: int) -> float:
    """Σ of the scores the N:M mask keeps: the n largest of every m consecutive along the last dim."""
    return float(scores.double().reshape(scores.shape[0], -1, m).topk(n, dim=-1).values.sum())


def snake_allocation(scores: Tensor, m: int) -> Tensor:
    """Step 1: the permutation (new position -> channel) that gives every group one channel of each
    of the m chunks of the channels sorted by summed score, even chunks forward, odd backward."""
    order = torch.sort(scores.double().sum(dim=0), stable=True).indices
    chunks = order.reshape(m, -1)  # chunk c: the c-th m-quantile of the channels
    chunks[1::2] = chunks[1::2].flip(-1)
    return chunks.t().reshape(-1)


def _assignment_profit(permuted: Tensor, n: int, m: int, position: int) -> Tensor:
    """profit[g, h]: the score kept in group g when its channel at ``position`` is replaced by
    group h's channel at ``position`` (``permuted``: [rows, groups, m] scores)."""
    rows, groups, _ = permuted.shape
    others = torch.cat([permuted[:, :, :position], permuted[:, :, position + 1:]], dim=-1)  # [rows, groups, m-1]
    incoming = permuted[:, :, position]  # [rows, groups]
    profit = torch.empty(groups, groups, dtype=torch.float64)
    for start in range(0, groups, _GROUPS_AT_ONCE):
        stop = min(start + _GROUPS_AT_ONCE, groups)
        block = torch.cat([others[:, start:stop, None, :].expand(rows, stop - start, groups, m - 1),
                           incoming[:, None, :, None].expand(rows, stop - start, groups, 1)], dim=-1)
        profit[start:stop] = block.topk(n, dim=-1).values.sum(dim=(0, 3)).cpu()
    return profit


def nm_channel_permutation(scores: Tensor, n: int, m: int) -> Tensor:
    """RIA's permutation of the input channels (the columns of ``scores``, [out, in], m | in):
    ``perm`` such that the N:M mask of ``scores[:, perm]`` keeps at least the score of the N:M
    mask of ``scores`` (int64, on ``scores``' device)."""
    scores = scores.double()
    columns = scores.shape[1]
    perm = snake_allocation(scores, m)
    for position in range(m):
        permuted = scores[:, perm].reshape(scores.shape[0], columns // m, m)
        source = linear_sum_assignment(_assignment_profit(permuted, n, m, position)).to(perm.device)
        slots = perm.reshape(-1, m)
        slots[:, position] = slots[source, position].clone()
        perm = slots.reshape(-1)
    if kept_score(scores[:, perm], n, m) < kept_score(scores, n, m):
        return torch.arange(columns, device=scores.device)
    return perm
