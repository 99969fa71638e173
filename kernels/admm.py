"""SAFE's dual update on the compact state (v, keep) (spec §1.8, K6), in place:

    v ← x + v⊙¬keep;   keep ← support of the projection of v;   returns ‖x − v⊙keep‖²

The score of v is |v| (SAFE) or |v|·sqrt(act_sqnorm[col]) (SAFE⁺, Wanda-P); selection and ties
are those of the mask kernels in ``masks.py``, whose helpers are reused here.

* N:M: one launch, one pass. A program loads BLOCK_G groups of x, v and keep as a
  [BLOCK_G, M_POW2] tile, forms the new v, scores it in registers, ranks each group
  (:func:`masks.nm_keep`), and writes v, keep and its partial residual.
* top-k per row or per tensor: an element-wise launch writes the new v; the radix select of the
  top-k masks (:func:`masks.topk_thresholds`, 64 counting passes over v) finds every segment's
  threshold key; a last launch writes keep and the partial residuals.

The residual is summed per program in fp32 and the partial sums are added by torch afterwards:
deterministic, no atomics.
"""
import torch
import triton
import triton.language as tl

from .masks import TOPK_BLOCK, flag_nan, nm_keep, nm_tile, segment_keys, topk_segments, topk_thresholds
from ..conventions import ScoreKind
from .scores import score_of


@triton.jit
def _updated(v_ptr, keep_ptr, x_ptr, offsets, in_bounds):
    """(x, x + v⊙¬keep) in fp32. v is multiplied by 0/1 as the reference does (a dropped -3.0
    gives -0.0, an inf NaN), so the new v is bitwise the reference's."""
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=in_bounds, other=0.0)
    kept = tl.load(keep_ptr + offsets, mask=in_bounds, other=0)
    return x, v * (kept == 0).to(tl.float32) + x


@triton.jit
def _residual(x, v, keep):
    """Σ (x − v⊙keep)² over the tile (out-of-bounds lanes were loaded as x = v = 0: they add 0)."""
    diff = x - v * keep.to(tl.float32)
    return tl.sum(diff * diff)


@triton.jit
def _dual_nm_kernel(v_ptr, keep_ptr, x_ptr, act_ptr, partial_ptr, nan_ptr, n_groups, n_cols,
                    N: tl.constexpr, M: tl.constexpr, M_POW2: tl.constexpr,
                    BLOCK_G: tl.constexpr, SCORE_KIND: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, M_POW2)
    in_bounds = (groups[:, None] < n_groups) & (lane[None, :] < M)
    offsets = groups[:, None] * M + lane[None, :]
    x, v = _updated(v_ptr, keep_ptr, x_ptr, offsets, in_bounds)
    score = score_of(v, act_ptr, offsets, offsets % n_cols, in_bounds, SCORE_KIND)
    flag_nan(nan_ptr, score, in_bounds)
    keep = nm_keep(score, lane, N, M)
    tl.store(v_ptr + offsets, v, mask=in_bounds)
    tl.store(keep_ptr + offsets, keep.to(tl.uint8), mask=in_bounds)
    tl.store(partial_ptr + tl.program_id(0), _residual(x, v, keep))


@triton.jit
def _dual_update_kernel(v_ptr, keep_ptr, x_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < numel
    _, v = _updated(v_ptr, keep_ptr, x_ptr, offsets, in_bounds)
    tl.store(v_ptr + offsets, v, mask=in_bounds)


@triton.jit
def _dual_keep_kernel(v_ptr, act_ptr, keep_ptr, x_ptr, prefix_ptr, partial_ptr, nan_ptr,
                      segment_len, n_cols, SCORE_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """keep = (key >= the segment's threshold) for one chunk of a segment, and its residual."""
    segment, chunk = tl.program_id(0), tl.program_id(1)
    key, score, offsets, in_bounds = segment_keys(v_ptr, act_ptr, segment, chunk, segment_len,
                                                  n_cols, SCORE_KIND, BLOCK)
    flag_nan(nan_ptr, score, in_bounds)
    keep = key >= tl.load(prefix_ptr + segment)
    tl.store(keep_ptr + offsets, keep.to(tl.uint8), mask=in_bounds)
    # segment_keys returns the score, not v: read v again (the same addresses, still in cache)
    v = tl.load(v_ptr + offsets, mask=in_bounds, other=0.0)
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    tl.store(partial_ptr + segment * tl.num_programs(1) + chunk, _residual(x, v, keep))


def _score_kind(act_sqnorm):
    return int(ScoreKind.MAGNITUDE if act_sqnorm is None else ScoreKind.WANDA)


def admm_dual_update_(v: torch.Tensor, keep: torch.Tensor, x: torch.Tensor, act_sqnorm, n: int, m: int,
                      keep_count: int, per_row: bool):
    """The dual update in place on v (fp32) and keep (bool): N:M when m > 0, else top-k (exactly
    ``keep_count`` kept per row or per tensor). Returns (‖x − v⊙keep‖² as a 0-d fp32 tensor, NaN
    flag)."""
    if m:
        return _dual_update_nm(v, keep, x, act_sqnorm, n, m)
    return _dual_update_topk(v, keep, x, act_sqnorm, keep_count, per_row)


def _dual_update_nm(v: torch.Tensor, keep: torch.Tensor, x: torch.Tensor, act_sqnorm, n: int, m: int):
    """N:M dual update in place on v (fp32) and keep (bool), x contiguous [out, in], in % m == 0.
    Returns (‖x − v⊙keep‖² as a 0-d fp32 tensor, NaN flag)."""
    nan_flag = torch.zeros(1, dtype=torch.int32, device=v.device)
    m_pow2, block_g = nm_tile(m)
    n_groups = v.numel() // m
    grid = (triton.cdiv(n_groups, block_g),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=v.device)
    _dual_nm_kernel[grid](v, keep.view(torch.uint8), x, v if act_sqnorm is None else act_sqnorm,
                          partial, nan_flag, n_groups, v.shape[-1], N=n, M=m, M_POW2=m_pow2,
                          BLOCK_G=block_g, SCORE_KIND=_score_kind(act_sqnorm))
    return partial.sum(), nan_flag


def _dual_update_topk(v: torch.Tensor, keep: torch.Tensor, x: torch.Tensor, act_sqnorm, keep_count: int,
                      per_row: bool):
    """Top-k dual update in place: exactly ``keep_count`` kept per row (``per_row``) or per tensor.
    Returns (‖x − v⊙keep‖² as a 0-d fp32 tensor, NaN flag)."""
    keep_bytes = keep.view(torch.uint8)
    _dual_update_kernel[(triton.cdiv(v.numel(), TOPK_BLOCK),)](v, keep_bytes, x, v.numel(),
                                                               BLOCK=TOPK_BLOCK)
    kind, aux = _score_kind(act_sqnorm), v if act_sqnorm is None else act_sqnorm
    prefix = topk_thresholds(v, aux, keep_count, per_row, kind)
    segment_len, _, grid = topk_segments(v, per_row)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=v.device)
    partial = torch.empty(grid, dtype=torch.float32, device=v.device)
    _dual_keep_kernel[grid](v, aux, keep_bytes, x, prefix, partial, nan_flag, segment_len, v.shape[-1],
                            SCORE_KIND=kind, BLOCK=TOPK_BLOCK)
    return partial.sum(), nan_flag
