"""DReSS's regularisation penalty on selected hidden channels (spec §1.4, Eqs. 2–4; §5 K1/K2),
added straight into the gradient:

    norms[k] = ‖W[slice c_k]‖        (ℓ2, or ℓ1: Σ|W|; fp32 accumulation)
    grad[slice c_k] += lam·W/norms[k]   (ℓ2; nothing where the norm is 0)   or   lam·sign(W)   (ℓ1)

for the channels c_0..c_{n-1} (any order, no repeats), a slice being a row (``dim=0``: o_proj,
down_proj) or a column (``dim=1``: q/k/v/gate/up, embedding, lm_head) of a row-major weight; a 1-D
weight (RMSNorm) comes in as one row of columns. Only the selected slices are read and written:
no gradient-sized temporary exists.

* Rows: a program owns BLOCK_CH channels and walks their columns in BLOCK_E tiles; the tile's
  fast axis runs along the row, which is contiguous in memory.
* Columns: a program owns BLOCK_CH channels and walks the rows; the tile is [rows, channels] so
  that its fast axis runs across the channels, which sit side by side in memory when they are a
  range (the default DReSS selection, the last p·d indices). The grid is n_channels / BLOCK_CH
  programs (16–64 for 1024 channels), fewer than a large GPU runs at once; splitting the rows over
  programs would need a second launch for ℓ2, whose update waits for the whole norm.

ℓ1 needs no norm before its update, so it is one pass (sum and update together); ℓ2 is two, the
second reading W again (from cache for a row, whose tiles were just read). The grad element is
loaded in its dtype, the step added in fp32 and the sum rounded once on the store.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _accumulate(acc, w, L1: tl.constexpr):
    """The norm's running sum: |w| (ℓ1) or w² (ℓ2), element-wise in fp32."""
    if L1:
        term = tl.abs(w)
    else:
        term = w * w
    return acc + term


@triton.jit
def _add_to_grad(grad_ptr, offsets, in_bounds, step):
    grad = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    tl.store(grad_ptr + offsets, (grad.to(tl.float32) + step).to(grad.dtype), mask=in_bounds)


@triton.jit
def _l1_step(w, lam):
    """lam·sign(w), with sign(0) = 0."""
    return tl.where(w > 0, lam, tl.where(w < 0, -lam, 0.0))


@triton.jit
def _l2_scale(sum_squares, lam):
    """lam/‖w‖₂ from the sum of squares, and 0 where the norm is 0 (the subgradient 0)."""
    norm = tl.sqrt_rn(sum_squares)
    return norm, tl.where(norm > 0, lam / tl.where(norm > 0, norm, 1.0), 0.0)


@triton.jit(do_not_specialize=["lam"])
def _penalty_rows_kernel(grad_ptr, weight_ptr, channels_ptr, norms_ptr, n_channels, n_cols, lam,
                         L1: tl.constexpr, BLOCK_CH: tl.constexpr, BLOCK_E: tl.constexpr):
    k = tl.program_id(0) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    k_ok = k < n_channels
    rows = tl.load(channels_ptr + k, mask=k_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_CH, BLOCK_E], dtype=tl.float32)
    for e0 in range(0, n_cols, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        in_bounds = k_ok[:, None] & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        w = tl.load(weight_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        acc = _accumulate(acc, w, L1)
        if L1:
            _add_to_grad(grad_ptr, offsets, in_bounds, _l1_step(w, lam))
    norms = tl.sum(acc, axis=1)
    if not L1:
        norms, scale = _l2_scale(norms, lam)
        for e0 in range(0, n_cols, BLOCK_E):
            cols = e0 + tl.arange(0, BLOCK_E)
            in_bounds = k_ok[:, None] & (cols[None, :] < n_cols)
            offsets = rows[:, None] * n_cols + cols[None, :]
            w = tl.load(weight_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
            _add_to_grad(grad_ptr, offsets, in_bounds, scale[:, None] * w)
    tl.store(norms_ptr + k, norms, mask=k_ok)


@triton.jit(do_not_specialize=["lam"])
def _penalty_columns_kernel(grad_ptr, weight_ptr, channels_ptr, norms_ptr, n_channels, n_rows,
                            n_cols, lam, L1: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_CH: tl.constexpr):
    k = tl.program_id(0) * BLOCK_CH + tl.arange(0, BLOCK_CH)
    k_ok = k < n_channels
    cols = tl.load(channels_ptr + k, mask=k_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_CH], dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        in_bounds = (rows[:, None] < n_rows) & k_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        w = tl.load(weight_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        acc = _accumulate(acc, w, L1)
        if L1:
            _add_to_grad(grad_ptr, offsets, in_bounds, _l1_step(w, lam))
    norms = tl.sum(acc, axis=0)
    if not L1:
        norms, scale = _l2_scale(norms, lam)
        for r0 in range(0, n_rows, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            in_bounds = (rows[:, None] < n_rows) & k_ok[None, :]
            offsets = rows[:, None] * n_cols + cols[None, :]
            w = tl.load(weight_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
            _add_to_grad(grad_ptr, offsets, in_bounds, scale[None, :] * w)
    tl.store(norms_ptr + k, norms, mask=k_ok)


# GPU tiles of at most 4096 fp32 accumulator elements per program (registers), autotuned per
# shape; grad is restored after each trial launch, since the kernels add into it.
_ROW_CONFIGS = [triton.Config({"BLOCK_CH": ch, "BLOCK_E": e}, num_warps=w)
                for ch, e in ((1, 1024), (1, 2048), (2, 1024), (4, 512)) for w in (4, 8)]
_COLUMN_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_CH": ch}, num_warps=w)
                   for ch in (16, 32, 64) for r in (32, 64, 128) if r * ch <= 4096 for w in (4, 8)]
_rows_tuned = triton.autotune(_ROW_CONFIGS, key=["n_channels", "n_cols", "L1"],
                              restore_value=["grad_ptr"])(_penalty_rows_kernel)
_columns_tuned = triton.autotune(_COLUMN_CONFIGS, key=["n_channels", "n_rows", "n_cols", "L1"],
                                 restore_value=["grad_ptr"])(_penalty_columns_kernel)

#: Accumulator elements per program under the CPU interpreter, whose cost is mostly per
#: operation: few, large tiles run faster there.
_INTERPRETER_TILE = 1 << 14


def channel_penalty_(grad: torch.Tensor, weight: torch.Tensor, channels: torch.Tensor, dim: int,
                     lam: float, l1: bool, interpreted: bool) -> torch.Tensor:
    """grad, weight: contiguous 2-D of one shape; channels: int64 indices into ``dim``. Returns
    the fp32 norms."""
    n_rows, n_cols = weight.shape
    n_channels = channels.numel()
    norms = torch.empty(n_channels, dtype=torch.float32, device=weight.device)
    args = (grad, weight, channels, norms, n_channels)
    if dim == 0:
        if interpreted:
            block_e = min(triton.next_power_of_2(n_cols), _INTERPRETER_TILE)
            block_ch = min(triton.next_power_of_2(n_channels), _INTERPRETER_TILE // block_e)
            _penalty_rows_kernel[(triton.cdiv(n_channels, block_ch),)](
                *args, n_cols, lam, L1=l1, BLOCK_CH=block_ch, BLOCK_E=block_e)
        else:
            _rows_tuned[lambda meta: (triton.cdiv(n_channels, meta["BLOCK_CH"]),)](
                *args, n_cols, lam, L1=l1)
    else:
        if interpreted:
            block_ch = min(triton.next_power_of_2(n_channels), 256)
            block_r = min(triton.next_power_of_2(n_rows), _INTERPRETER_TILE // block_ch)
            _penalty_columns_kernel[(triton.cdiv(n_channels, block_ch),)](
                *args, n_rows, n_cols, lam, L1=l1, BLOCK_R=block_r, BLOCK_CH=block_ch)
        else:
            _columns_tuned[lambda meta: (triton.cdiv(n_channels, meta["BLOCK_CH"]),)](
                *args, n_rows, n_cols, lam, L1=l1)
    return norms
