"""Proximal operators: soft-thresholding (prox of α‖·‖₁) and group soft-thresholding (prox of
α‖·‖₂,₁, MoreauPruner Eq. 8), computed in fp32 and written in the input dtype.

Group layout: the tensor is viewed as [outer, G, inner] with the groups along G. One program owns
BLOCK_G groups and walks their [outer·inner] elements twice: once for the norms, once to scale and
store, so each group is reduced and shrunk in a single launch.
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _soft_threshold_kernel(x_ptr, out_ptr, alpha, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < numel
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0)
    xf = x.to(tl.float32)
    shrunk = tl.maximum(tl.abs(xf) - alpha, 0.0)
    out = tl.where(xf > 0, shrunk, tl.where(xf < 0, -shrunk, 0.0))
    tl.store(out_ptr + offsets, out.to(x.dtype), mask=in_bounds)


def soft_threshold(x: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)
    block = 1024
    _soft_threshold_kernel[(triton.cdiv(x.numel(), block),)](x, out, alpha, x.numel(), BLOCK=block)
    return out


@triton.jit
def group_scale(sum_squares, alpha):
    """max(0, 1 − α/‖x_g‖₂) from each group's sum of squares (the division only where ‖x_g‖₂ > α)."""
    norm = tl.sqrt_rn(sum_squares)
    return tl.where(norm > alpha, 1.0 - alpha / tl.where(norm > alpha, norm, 1.0), 0.0)


@triton.jit
def _group_offsets(groups, r, n_groups, inner):
    outer_index = r // inner
    inner_index = r % inner
    return (outer_index[None, :] * n_groups + groups[:, None]) * inner + inner_index[None, :]


@triton.jit
def _group_soft_threshold_kernel(x_ptr, out_ptr, alpha, n_groups, group_size, inner,
                                 BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    group_ok = groups < n_groups
    sq = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    for r0 in range(0, group_size, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        in_bounds = group_ok[:, None] & (r[None, :] < group_size)
        x = tl.load(x_ptr + _group_offsets(groups, r, n_groups, inner), mask=in_bounds, other=0.0)
        x = x.to(tl.float32)
        sq += x * x
    scale = group_scale(tl.sum(sq, axis=1), alpha)
    for r0 in range(0, group_size, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        in_bounds = group_ok[:, None] & (r[None, :] < group_size)
        offsets = _group_offsets(groups, r, n_groups, inner)
        x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0)
        out = x.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + offsets, out.to(x.dtype), mask=in_bounds)


def group_soft_threshold(x: torch.Tensor, alpha: float, group_dim: int) -> torch.Tensor:
    """x contiguous; groups are the indices of ``group_dim``."""
    n_groups = x.shape[group_dim]
    inner = math.prod(x.shape[group_dim + 1:])
    group_size = x.numel() // n_groups
    out = torch.empty_like(x)
    # contiguous groups (inner > 1) read along r; strided groups (inner == 1) read across groups
    block_g, block_r = (4, 512) if inner > 1 else (64, 32)
    grid = (triton.cdiv(n_groups, block_g),)
    _group_soft_threshold_kernel[grid](x, out, alpha, n_groups, group_size, inner,
                                       BLOCK_G=block_g, BLOCK_R=block_r)
    return out
