"""The linear sum assignment problem (Kuhn, 1955; Munkres, 1957): the one-to-one matching of rows
to columns of a square matrix with the largest total, by the Hungarian method with potentials
(shortest augmenting paths, O(n³)), each step vectorised over the columns."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def linear_sum_assignment(profit: Tensor) -> Tensor:
    """The column matched to each row of the square matrix ``profit`` so that Σ_r profit[r, col[r]]
    is the largest possible (a permutation, int64, on ``profit``'s device)."""
    if profit.dim() != 2 or profit.shape[0] != profit.shape[1]:
        raise ValueError(f"profit must be a square matrix; got shape {tuple(profit.shape)}")
    if not bool(torch.isfinite(profit).all()):
        raise ValueError("profit must be finite")
    cost = -profit.detach().double().cpu().numpy()
    n = cost.shape[0]
    # 1-based as in the textbook method: column 0 is the virtual start of every augmenting path
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    row_of = np.zeros(n + 1, dtype=np.int64)  # row_of[j]: the row matched to column j (0: none)
    way = np.zeros(n + 1, dtype=np.int64)
    for row in range(1, n + 1):
        row_of[0], column = row, 0
        slack = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while row_of[column] != 0:  # row_of[0] is the row being matched
            used[column] = True
            current = row_of[column]
            reduced = cost[current - 1] - u[current] - v[1:]
            free = ~used[1:]
            lower = free & (reduced < slack[1:])
            slack[1:][lower] = reduced[lower]
            way[1:][lower] = column
            candidates = np.where(free, slack[1:], np.inf)
            nearest = int(np.argmin(candidates)) + 1
            delta = candidates[nearest - 1]
            u[row_of[used]] += delta
            v[used] -= delta
            slack[~used] -= delta
            column = nearest
        while column != 0:  # flip the augmenting path
            previous = way[column]
            row_of[column] = row_of[previous]
            column = previous
    columns = np.empty(n, dtype=np.int64)
    columns[row_of[1:] - 1] = np.arange(n)
    return torch.from_numpy(columns).to(profit.device)
