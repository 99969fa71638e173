"""Matmuls over pruned weights without materialising a dense or sliced copy of W.

* ``nm_linear``: y = x @ (W ⊙ mask)ᵀ + b read from the compressed N:M form. Each [BLOCK_K, BLOCK_N]
  tile of Wᵀ is expanded in registers from the packed mask and the kept values (the value slot of a
  kept element is its group's base plus its rank among the group's kept elements), so W costs
  n/m of the dense value bytes plus 1 bit per element. Needs a power-of-two m (BLOCK_K is a
  multiple of m, so tiles hold whole groups).
* ``sliced_linear``: y = x @ W[out_index][:, in_index]ᵀ + b[out_index] with the indices applied
  to the pointers of each tile.

Accumulation is fp32. Under the Triton interpreter ``tl.dot`` on bf16 operands is wrong, so
UPCAST (set there) feeds the dot fp32 operands instead.
"""
import torch
import triton
import triton.language as tl

from .nm_format import keep_bits


@triton.jit
def _dot(acc, x, w, UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr):
    if UPCAST or FP32_IEEE:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _x_tile(x_ptr, rows, k, n_rows, K):
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                   mask=(rows[:, None] < n_rows) & (k[None, :] < K), other=0.0)


@triton.jit
def _store_output(out_ptr, acc, bias_ptr, bias_index, rows, cols, n_rows, n_out,
                  HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + bias_index, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_out))


@triton.jit
def _nm_linear_kernel(x_ptr, values_ptr, meta_ptr, bias_ptr, out_ptr, n_rows, n_out, K,
                      values_stride, meta_stride,
                      N: tl.constexpr, M: tl.constexpr, HAS_BIAS: tl.constexpr,
                      UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, rows, k, n_rows, K)
        in_bounds = (k[:, None] < K) & (cols[None, :] < n_out)
        keep = keep_bits(meta_ptr, cols[None, :].to(tl.int64), k[:, None], meta_stride, in_bounds)
        keep = (keep & in_bounds).to(tl.int32)
        in_group = tl.reshape(tl.cumsum(tl.reshape(keep, [BLOCK_K // M, M, BLOCK_N]), axis=1),
                              [BLOCK_K, BLOCK_N])
        slots = cols[None, :].to(tl.int64) * values_stride + (k[:, None] // M) * N + in_group - keep
        w = tl.load(values_ptr + slots, mask=keep != 0, other=0.0)
        acc = _dot(acc, x, w, UPCAST, FP32_IEEE)
    _store_output(out_ptr, acc, bias_ptr, cols, rows, cols, n_rows, n_out, HAS_BIAS)


@triton.jit
def _sliced_linear_kernel(x_ptr, w_ptr, bias_ptr, in_index_ptr, out_index_ptr, out_ptr,
                          n_rows, n_out, K, w_stride,
                          HAS_IN: tl.constexpr, HAS_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols.to(tl.int64)
    if HAS_OUT:
        w_rows = tl.load(out_index_ptr + cols, mask=cols < n_out, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, rows, k, n_rows, K)
        w_cols = k.to(tl.int64)
        if HAS_IN:
            w_cols = tl.load(in_index_ptr + k, mask=k < K, other=0)
        w = tl.load(w_ptr + w_rows[None, :] * w_stride + w_cols[:, None],
                    mask=(k[:, None] < K) & (cols[None, :] < n_out), other=0.0)
        acc = _dot(acc, x, w, UPCAST, FP32_IEEE)
    _store_output(out_ptr, acc, bias_ptr, w_rows, rows, cols, n_rows, n_out, HAS_BIAS)


def _tiles(n_rows: int, n_out: int, min_k: int = 32):
    block_m = 16 if n_rows <= 16 else 64
    block_n, block_k = 64, max(32, min_k)
    return block_m, block_n, block_k, (triton.cdiv(n_rows, block_m), triton.cdiv(n_out, block_n))


def nm_linear(x, values, meta, n: int, m: int, bias, upcast: bool) -> torch.Tensor:
    """x [rows, K] contiguous; values/meta from nm_compress; m a power of two."""
    n_rows, K = x.shape
    n_out = values.shape[0]
    out = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, grid = _tiles(n_rows, n_out, m)
    _nm_linear_kernel[grid](x, values, meta, out if bias is None else bias, out, n_rows, n_out, K,
                            values.shape[1], meta.shape[1], N=n, M=m, HAS_BIAS=bias is not None,
                            UPCAST=upcast, FP32_IEEE=x.dtype == torch.float32,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def sliced_linear(x, w, bias, in_index, out_index, upcast: bool) -> torch.Tensor:
    """x [rows, K] contiguous with K = len(in_index) (or w's in); w [out, in] contiguous."""
    n_rows, K = x.shape
    n_out = w.shape[0] if out_index is None else out_index.numel()
    out = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, grid = _tiles(n_rows, n_out)
    _sliced_linear_kernel[grid](x, w, out if bias is None else bias,
                                w if in_index is None else in_index,
                                w if out_index is None else out_index, out,
                                n_rows, n_out, K, w.shape[1],
                                HAS_IN=in_index is not None, HAS_OUT=out_index is not None,
                                HAS_BIAS=bias is not None, UPCAST=upcast,
                                FP32_IEEE=x.dtype == torch.float32,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
