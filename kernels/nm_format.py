"""Compressed N:M format: ``values [rows, cols·n/m]`` + ``meta [rows, ceil(cols/8)] uint8``.

meta is the keep mask packed 8 columns per byte (column 8b+j in bit j of byte b), so one layout
serves every N:M and costs 1 bit per dense element. The kept element at column c of group g goes
to value slot g·n + (number of kept elements before c in the group).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def keep_bits(meta_ptr, rows, cols, meta_stride, in_bounds):
    """The keep bit of (rows, cols) read from the packed mask."""
    byte = tl.load(meta_ptr + rows * meta_stride + cols // 8, mask=in_bounds, other=0)
    return ((byte.to(tl.int32) >> (cols % 8).to(tl.int32)) & 1) != 0


@triton.jit
def _pack_mask_kernel(mask_ptr, meta_ptr, n_rows, n_cols, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = byte // n_bytes
    col = (byte % n_bytes)[:, None] * 8 + tl.arange(0, 8)[None, :]
    in_bounds = (byte[:, None] < n_rows * n_bytes) & (col < n_cols)
    bit = tl.load(mask_ptr + row[:, None] * n_cols + col, mask=in_bounds, other=0).to(tl.int32)
    packed = tl.sum(bit << tl.arange(0, 8)[None, :], axis=1)
    tl.store(meta_ptr + byte, packed.to(tl.uint8), mask=byte < n_rows * n_bytes)


@triton.jit
def _value_slots(groups, keep, N: tl.constexpr):
    """Value slots of a [BLOCK_G, M_POW2] tile of groups, given its keep bits."""
    rank = tl.cumsum(keep.to(tl.int32), axis=1) - keep.to(tl.int32)
    return groups[:, None] * N + rank


@triton.jit
def _compress_kernel(w_ptr, mask_ptr, values_ptr, n_groups,
                     N: tl.constexpr, M: tl.constexpr, M_POW2: tl.constexpr, BLOCK_G: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, M_POW2)
    in_bounds = (groups[:, None] < n_groups) & (lane[None, :] < M)
    offsets = groups[:, None] * M + lane[None, :]
    keep = (tl.load(mask_ptr + offsets, mask=in_bounds, other=0) != 0) & in_bounds
    w = tl.load(w_ptr + offsets, mask=keep, other=0.0)
    tl.store(values_ptr + _value_slots(groups, keep, N), w, mask=keep)


@triton.jit
def _decompress_kernel(values_ptr, meta_ptr, dense_ptr, n_groups, n_cols, meta_stride,
                       N: tl.constexpr, M: tl.constexpr, M_POW2: tl.constexpr, BLOCK_G: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, M_POW2)
    in_bounds = (groups[:, None] < n_groups) & (lane[None, :] < M)
    offsets = groups[:, None] * M + lane[None, :]
    keep = keep_bits(meta_ptr, offsets // n_cols, offsets % n_cols, meta_stride, in_bounds) & in_bounds
    slots = _value_slots(groups, keep, N)
    value = tl.load(values_ptr + slots, mask=keep, other=0.0)
    tl.store(dense_ptr + offsets, value, mask=in_bounds)


def _group_grid(n_groups: int, m: int):
    m_pow2 = triton.next_power_of_2(m)
    block_g = max(1, 2048 // m_pow2)
    return (triton.cdiv(n_groups, block_g),), m_pow2, block_g


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    n_rows, n_cols = mask.shape
    n_bytes = triton.cdiv(n_cols, 8)
    meta = torch.empty(n_rows, n_bytes, dtype=torch.uint8, device=mask.device)
    block = 256
    _pack_mask_kernel[(triton.cdiv(n_rows * n_bytes, block),)](
        mask.view(torch.uint8), meta, n_rows, n_cols, n_bytes, BLOCK=block)
    return meta


def nm_compress(w: torch.Tensor, mask: torch.Tensor, n: int, m: int):
    n_rows, n_cols = w.shape
    values = torch.empty(n_rows, n_cols * n // m, dtype=w.dtype, device=w.device)
    n_groups = w.numel() // m
    grid, m_pow2, block_g = _group_grid(n_groups, m)
    _compress_kernel[grid](w, mask.view(torch.uint8), values, n_groups,
                           N=n, M=m, M_POW2=m_pow2, BLOCK_G=block_g)
    return values, pack_mask(mask)


def nm_decompress(values: torch.Tensor, meta: torch.Tensor, n: int, m: int) -> torch.Tensor:
    n_rows = values.shape[0]
    n_cols = values.shape[1] * m // n
    dense = torch.empty(n_rows, n_cols, dtype=values.dtype, device=values.device)
    n_groups = dense.numel() // m
    grid, m_pow2, block_g = _group_grid(n_groups, m)
    _decompress_kernel[grid](values, meta, dense, n_groups, n_cols, meta.shape[1],
                             N=n, M=m, M_POW2=m_pow2, BLOCK_G=block_g)
    return dense
