"""Mask selection: N:M per group and exact top-k per row or per tensor, fused with the score.

Ties keep the lower index. The score of each element is computed in registers from the weight
(and the Wanda statistic) by :func:`load_score`, so the fused ops never write a score tensor.
The selection helpers (:func:`nm_keep`, :func:`nm_tile`, :func:`segment_keys`,
:func:`topk_thresholds`, :func:`flag_nan`) are shared with the fused ADMM update in ``admm.py``.

* N:M: one program handles BLOCK_G groups as a [BLOCK_G, M] tile; an element is kept when fewer
  than N elements of its group beat it (higher score, or equal score at a lower index). M is a
  constexpr, so 2:4 and 4:8 compile to their own fully unrolled kernels.
* top-k: an exact radix select on 64-bit keys (order-preserving score bits, then the inverted
  index), one bit per pass from the top: keys are distinct, so ``key >= k-th key`` keeps exactly k.
  Segments are rows (``scope="row"``) or the whole tensor; partial counts add up with atomics
  (integers, so the result is deterministic).
"""
import torch
import triton
import triton.language as tl

from .scores import load_score


@triton.jit
def flag_nan(nan_ptr, score, in_bounds):
    """Raise the device flag when a score in bounds is NaN."""
    has_nan = tl.max(tl.where(in_bounds & (score != score), 1, 0))
    tl.atomic_max(nan_ptr, has_nan)


@triton.jit
def _nm_mask_kernel(src_ptr, aux_ptr, mask_ptr, nan_ptr, n_groups, n_cols,
                    N: tl.constexpr, M: tl.constexpr, M_POW2: tl.constexpr,
                    BLOCK_G: tl.constexpr, SCORE_KIND: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, M_POW2)
    in_bounds = (groups[:, None] < n_groups) & (lane[None, :] < M)
    offsets = groups[:, None] * M + lane[None, :]
    score = load_score(src_ptr, aux_ptr, offsets, offsets % n_cols, in_bounds, SCORE_KIND)
    flag_nan(nan_ptr, score, in_bounds)
    tl.store(mask_ptr + offsets, nm_keep(score, lane, N, M).to(tl.uint8), mask=in_bounds)


@triton.jit
def nm_keep(score, lane, N: tl.constexpr, M: tl.constexpr):
    """Keep flags of a [groups, M_POW2] score tile (lanes >= M are padding): an element is kept
    when fewer than N elements of its group beat it (higher score, or equal at a lower lane)."""
    mine = score[:, :, None]
    other = score[:, None, :]
    my_lane = lane[None, :, None]
    other_lane = lane[None, None, :]
    beats = ((other > mine) | ((other == mine) & (other_lane < my_lane))) & (other_lane < M)
    rank = tl.sum(beats.to(tl.int32), axis=2)
    return rank < N


def nm_tile(m: int):
    """(M_POW2, BLOCK_G) of an N:M tile: m padded to a power of two, and groups per program so
    that the [BLOCK_G, M_POW2, M_POW2] comparison cube holds about 4096 elements."""
    m_pow2 = triton.next_power_of_2(m)
    return m_pow2, max(1, 4096 // (m_pow2 * m_pow2))


def nm_mask(src: torch.Tensor, aux, n: int, m: int, kind: int) -> torch.Tensor:
    """N:M keep mask of the score of ``src`` (contiguous, last dim divisible by m)."""
    mask = torch.empty(src.shape, dtype=torch.bool, device=src.device)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    m_pow2, block_g = nm_tile(m)
    n_groups = src.numel() // m
    grid = (triton.cdiv(n_groups, block_g),)
    _nm_mask_kernel[grid](src, src if aux is None else aux, mask.view(torch.uint8), nan_flag,
                          n_groups, src.shape[-1], N=n, M=m, M_POW2=m_pow2, BLOCK_G=block_g,
                          SCORE_KIND=kind)
    return mask, nan_flag


@triton.jit
def _sort_key(score, index):
    """uint64 key ordered like (score, -index): order-preserving float bits, then ~index."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 are the same score
    bits = score.to(tl.uint32, bitcast=True).to(tl.uint64)
    ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    return (ordered << 32) | (0xFFFFFFFF - index.to(tl.uint64))


@triton.jit
def segment_keys(src_ptr, aux_ptr, segment, chunk, segment_len, n_cols,
                 SCORE_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """(keys, scores, flat offsets, in-bounds flags) of BLOCK elements of a segment, from ``chunk``."""
    index = chunk * BLOCK + tl.arange(0, BLOCK)
    in_bounds = index < segment_len
    offsets = segment.to(tl.int64) * segment_len + index
    score = load_score(src_ptr, aux_ptr, offsets, offsets % n_cols, in_bounds, SCORE_KIND)
    return _sort_key(score, index), score, offsets, in_bounds


@triton.jit(do_not_specialize=["bit"])
def _count_at_least_kernel(src_ptr, aux_ptr, prefix_ptr, count_ptr, bit, segment_len, n_cols,
                           SCORE_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """count[segment] += #{keys >= prefix | (1 << bit)} in this program's chunk."""
    segment = tl.program_id(0)
    key, _, _, in_bounds = segment_keys(src_ptr, aux_ptr, segment, tl.program_id(1), segment_len,
                                        n_cols, SCORE_KIND, BLOCK)
    candidate = tl.load(prefix_ptr + segment) | (tl.full([], 1, tl.uint64) << bit)
    count = tl.sum(((key >= candidate) & in_bounds).to(tl.int32))
    tl.atomic_add(count_ptr + segment, count)


@triton.jit(do_not_specialize=["bit", "keep"])
def _accept_bit_kernel(prefix_ptr, count_ptr, keep, bit, n_segments, BLOCK: tl.constexpr):
    """Set the bit in each segment's prefix when at least ``keep`` keys reach it; reset counts."""
    segments = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = segments < n_segments
    prefix = tl.load(prefix_ptr + segments, mask=in_bounds, other=0)
    count = tl.load(count_ptr + segments, mask=in_bounds, other=0)
    candidate = prefix | (tl.full([], 1, tl.uint64) << bit)
    tl.store(prefix_ptr + segments, tl.where(count >= keep, candidate, prefix), mask=in_bounds)
    tl.store(count_ptr + segments, tl.zeros_like(count), mask=in_bounds)


@triton.jit
def _threshold_mask_kernel(src_ptr, aux_ptr, prefix_ptr, mask_ptr, nan_ptr, segment_len, n_cols,
                           SCORE_KIND: tl.constexpr, BLOCK: tl.constexpr):
    segment = tl.program_id(0)
    key, score, offsets, in_bounds = segment_keys(src_ptr, aux_ptr, segment, tl.program_id(1),
                                                  segment_len, n_cols, SCORE_KIND, BLOCK)
    flag_nan(nan_ptr, score, in_bounds)
    keep = key >= tl.load(prefix_ptr + segment)
    tl.store(mask_ptr + offsets, keep.to(tl.uint8), mask=in_bounds)


#: Elements per program of the top-k passes.
TOPK_BLOCK = 1024


def topk_segments(src: torch.Tensor, per_row: bool):
    """(segment length, number of segments, grid of the per-element passes)."""
    segment_len = src.shape[-1] if per_row else src.numel()
    n_segments = src.numel() // segment_len
    return segment_len, n_segments, (n_segments, triton.cdiv(segment_len, TOPK_BLOCK))


def topk_thresholds(src: torch.Tensor, aux, keep: int, per_row: bool, kind: int) -> torch.Tensor:
    """The ``keep``-th largest key of every segment (uint64 [segments]) by radix select: the
    elements kept are exactly those whose key reaches their segment's threshold."""
    segment_len, n_segments, grid = topk_segments(src, per_row)
    # keep == 0: no key reaches the all-ones prefix; keep == segment_len: every key reaches zero
    start = -1 if keep == 0 else 0
    prefix = torch.full((n_segments,), start, dtype=torch.int64, device=src.device).view(torch.uint64)
    if 0 < keep < segment_len:
        counts = torch.zeros(n_segments, dtype=torch.int32, device=src.device)
        accept_grid = (triton.cdiv(n_segments, TOPK_BLOCK),)
        for bit in range(63, -1, -1):
            _count_at_least_kernel[grid](src, aux, prefix, counts, bit, segment_len, src.shape[-1],
                                         SCORE_KIND=kind, BLOCK=TOPK_BLOCK)
            _accept_bit_kernel[accept_grid](prefix, counts, keep, bit, n_segments, BLOCK=TOPK_BLOCK)
    return prefix


def topk_mask(src: torch.Tensor, aux, keep: int, per_row: bool, kind: int) -> torch.Tensor:
    """Exactly ``keep`` elements per row (last dim) or per tensor, highest score first."""
    mask = torch.empty(src.shape, dtype=torch.bool, device=src.device)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    aux = src if aux is None else aux
    prefix = topk_thresholds(src, aux, keep, per_row, kind)
    segment_len, _, grid = topk_segments(src, per_row)
    _threshold_mask_kernel[grid](src, aux, prefix, mask.view(torch.uint8), nan_flag, segment_len,
                                 src.shape[-1], SCORE_KIND=kind, BLOCK=TOPK_BLOCK)
    return mask, nan_flag
