"""Matmuls over pruned weights without materialising a dense or sliced copy of W.

* ``nm_linear``: y = x @ (W ⊙ mask)ᵀ + b read from the compressed N:M form, so W costs n/m of the
  dense value bytes plus 1 bit per element (9/16 of dense for 16-bit 2:4 and 4:8). Needs a
  power-of-two m. Two kernels:

  - decode (at most GEMV_MAX_ROWS rows of x): a GEMV over the kept values only. Each value's input
    column is its group's first column plus the position of its slot's set bit in the group's
    mask bits, and x is gathered at those columns (x is small and stays in cache), so the work
    and the weight bytes are n/m of dense.
  - prefill: each [BLOCK_K, BLOCK_N] tile of Wᵀ is expanded in registers from the packed mask and
    the kept values (a kept element's value slot is its group's base plus its rank among the
    group's kept elements) and fed to ``tl.dot``.
* ``sliced_linear``: y = x @ W[out_index][:, in_index]ᵀ + b[out_index] with the indices applied
  to the pointers of each tile.

Accumulation is fp32. Under the Triton interpreter ``tl.dot`` on bf16 operands is wrong, so
UPCAST (set there) feeds the dot fp32 operands instead.
"""
import torch
import triton
import triton.language as tl

from .nm_format import keep_bits

#: x with at most this many rows goes through the GEMV kernel.
GEMV_MAX_ROWS = 8


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
def _group_bits(meta_ptr, row_offset, first_col, in_bounds, M: tl.constexpr):
    """The M keep bits of the groups starting at ``first_col`` (bit i = column first_col + i)."""
    byte_ptr = meta_ptr + row_offset + first_col // 8
    if M >= 8:
        bits = tl.zeros(byte_ptr.shape, dtype=tl.int64)
        for j in tl.static_range(M // 8):
            bits |= tl.load(byte_ptr + j, mask=in_bounds, other=0).to(tl.int64) << (8 * j)
        return bits
    byte = tl.load(byte_ptr, mask=in_bounds, other=0).to(tl.int64)
    return (byte >> (first_col % 8)) & ((1 << M) - 1)


@triton.jit
def _slot_column(bits, slot, M: tl.constexpr):
    """Position of the (slot+1)-th set bit of ``bits``: the number of prefixes of the group that
    hold at most ``slot`` kept elements."""
    position = tl.zeros(bits.shape, dtype=tl.int64)
    seen = tl.zeros(bits.shape, dtype=tl.int64)
    for b in tl.static_range(M):
        seen += (bits >> b) & 1
        position += (seen <= slot).to(tl.int64)
    return position


@triton.jit
def _nm_gemv_kernel(x_ptr, values_ptr, meta_ptr, bias_ptr, out_ptr, n_rows, n_out, K, n_values,
                    values_stride, meta_stride,
                    N: tl.constexpr, M: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for v0 in range(0, n_values, BLOCK_V):
        v = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        in_bounds = (cols[:, None] < n_out) & (v[None, :] < n_values)
        w = tl.load(values_ptr + cols[:, None].to(tl.int64) * values_stride + v[None, :],
                    mask=in_bounds, other=0.0).to(tl.float32)
        first_col = (v // N) * M
        bits = _group_bits(meta_ptr, cols[:, None].to(tl.int64) * meta_stride, first_col[None, :],
                           in_bounds, M)
        in_col = first_col[None, :] + _slot_column(bits, (v % N)[None, :], M)
        x = tl.load(x_ptr + rows[:, None, None].to(tl.int64) * K + in_col[None, :, :],
                    mask=(rows[:, None, None] < n_rows) & in_bounds[None, :, :], other=0.0)
        acc += tl.sum(x.to(tl.float32) * w[None, :, :], axis=2)
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


def _gemv_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv}, num_warps=w, num_stages=st)
            for bn in (8, 16, 32, 64) for bv in (32, 64, 128, 256) for w in (2, 4, 8) for st in (2, 4)]


def _fits_registers(configs, named_args, **kwargs):
    """Keep GEMV configs whose [BLOCK_R, BLOCK_N, BLOCK_V] gather tile stays within 16K elements."""
    block_r = kwargs.get("BLOCK_R", named_args.get("BLOCK_R"))
    return [c for c in configs if block_r * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_V"] <= 16384]


def _dot_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn in (64, 128) for bk in (32, 64, 128) for w in (4, 8) for st in (3, 4)]


_nm_gemv_tuned = triton.autotune(_gemv_configs(), key=["n_out", "n_values", "BLOCK_R", "N", "M"],
                                 prune_configs_by={"early_config_prune": _fits_registers})(_nm_gemv_kernel)
_nm_linear_tuned = triton.autotune(_dot_configs(), key=["n_out", "K", "BLOCK_M", "N", "M"])(
    _nm_linear_kernel)
_sliced_linear_tuned = triton.autotune(_dot_configs(), key=["n_out", "K", "BLOCK_M"])(_sliced_linear_kernel)


def _block_m(n_rows: int) -> int:
    return 16 if n_rows <= 16 else 64


def _launch(kernel, tuned, interpreted: bool, n_rows: int, n_out: int, block_m: int,
            fixed: dict, *args, **constexprs):
    """Run ``tuned`` (autotuned over the block sizes in ``fixed``) on a GPU, or ``kernel`` with the
    ``fixed`` block sizes under the interpreter (where autotuning would only cost time)."""
    rows_grid = triton.cdiv(n_rows, block_m)
    if interpreted:
        kernel[(rows_grid, triton.cdiv(n_out, fixed["BLOCK_N"]))](*args, **constexprs, **fixed)
    else:
        tuned[lambda meta: (rows_grid, triton.cdiv(n_out, meta["BLOCK_N"]))](*args, **constexprs)


def nm_linear(x, values, meta, n: int, m: int, bias, interpreted: bool) -> torch.Tensor:
    """x [rows, K] contiguous; values/meta from nm_compress; m a power of two."""
    n_rows, K = x.shape
    n_out = values.shape[0]
    out = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    bias_arg = out if bias is None else bias
    if n_rows <= GEMV_MAX_ROWS:
        block_r = triton.next_power_of_2(n_rows)
        _launch(_nm_gemv_kernel, _nm_gemv_tuned, interpreted, n_rows, n_out, block_r,
                {"BLOCK_N": 16, "BLOCK_V": 64}, x, values, meta, bias_arg, out, n_rows, n_out, K,
                values.shape[1], values.shape[1], meta.shape[1],
                N=n, M=m, HAS_BIAS=bias is not None, BLOCK_R=block_r)
        return out
    block_m = _block_m(n_rows)
    _launch(_nm_linear_kernel, _nm_linear_tuned, interpreted, n_rows, n_out, block_m,
            {"BLOCK_N": 64, "BLOCK_K": max(32, m)}, x, values, meta, bias_arg, out, n_rows, n_out,
            K, values.shape[1], meta.shape[1], N=n, M=m, HAS_BIAS=bias is not None,
            UPCAST=interpreted, FP32_IEEE=x.dtype == torch.float32, BLOCK_M=block_m)
    return out


def sliced_linear(x, w, bias, in_index, out_index, interpreted: bool) -> torch.Tensor:
    """x [rows, K] contiguous with K = len(in_index) (or w's in); w [out, in] contiguous."""
    n_rows, K = x.shape
    n_out = w.shape[0] if out_index is None else out_index.numel()
    out = torch.empty(n_rows, n_out, dtype=x.dtype, device=x.device)
    _launch(_sliced_linear_kernel, _sliced_linear_tuned, interpreted, n_rows, n_out,
            _block_m(n_rows), {"BLOCK_N": 64, "BLOCK_K": 32}, x, w, out if bias is None else bias,
            w if in_index is None else in_index, w if out_index is None else out_index, out,
            n_rows, n_out, K, w.shape[1],
            HAS_IN=in_index is not None, HAS_OUT=out_index is not None,
            HAS_BIAS=bias is not None, UPCAST=interpreted, FP32_IEEE=x.dtype == torch.float32,
            BLOCK_M=_block_m(n_rows))
    return out
