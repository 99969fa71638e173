"""MoreauPruner's displacement step (Algorithm 1 in displacement form, spec §1.5–1.6), fused:

    d = decay·δ − step_size·g;   δ ← d·max(0, 1 − threshold/‖d_S‖₂)  (δ ← d when threshold == 0)
    perturbed ← W + δ + noise_ratio·|W|·z,   z = tl.randn(seed, flat element index)

One launch per weight tensor. Without shrinking it reads δ, g and W and writes δ and the perturbed
weights once each; shrinking adds a first pass over δ and g for the group norms. z is generated in
registers (counter-based Philox), never stored.

* Row groups (``group_dim=0``), and any threshold == 0: a program owns BLOCK_R rows. With
  SHRINK it walks their columns twice: pass 1 accumulates ‖d_row‖² in a register tile, pass 2
  recomputes d (the same instructions, the same bits), scales it, and writes δ and perturbed.
  Writing d in pass 1 and reading it back instead would trade the second read of g for 4 more
  bytes of δ traffic per element (even for fp32 g, 2 bytes worse for 16-bit g); this way no pass
  reads memory that another pass wrote.
* Column groups (``group_dim=1``, threshold > 0): a program owns BLOCK_C columns and walks the
  rows twice in the same way; the norm tile is reduced over rows. The grid is in_features /
  BLOCK_C programs (64–256 for 4096 columns), fewer than a large GPU can run at once.

δ is fp32; g, W and perturbed may each be fp32/fp16/bf16 (loaded as fp32, perturbed rounded once
on the store). On a GPU the block sizes are autotuned; δ is restored after each trial launch.
"""
import torch
import triton
import triton.language as tl

from .prox import group_scale


@triton.jit
def _displaced(delta_ptr, grad_ptr, offsets, in_bounds, decay, step_size):
    """d = decay·δ − step_size·g in fp32."""
    delta = tl.load(delta_ptr + offsets, mask=in_bounds, other=0.0)
    grad = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    return decay * delta - step_size * grad


@triton.jit
def _perturb(perturbed_ptr, weight_ptr, offsets, in_bounds, delta, noise_ratio, seed):
    """perturbed = W + δ + noise_ratio·|W|·z; z is keyed by the flat index, so it does not depend
    on the tiling (or on the backend: pyprune.ops.reference.standard_normal is the same Philox)."""
    w = tl.load(weight_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    z = tl.randn(seed, offsets)
    perturbed = w + delta + noise_ratio * tl.abs(w) * z
    tl.store(perturbed_ptr + offsets, perturbed.to(perturbed_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _finish(delta_ptr, weight_ptr, perturbed_ptr, offsets, in_bounds, delta, noise_ratio, seed,
            PERTURB: tl.constexpr):
    tl.store(delta_ptr + offsets, delta, mask=in_bounds)
    if PERTURB:
        _perturb(perturbed_ptr, weight_ptr, offsets, in_bounds, delta, noise_ratio, seed)


@triton.jit(do_not_specialize=["decay", "step_size", "threshold", "noise_ratio", "seed"])
def _moreau_rows_kernel(delta_ptr, grad_ptr, weight_ptr, perturbed_ptr, n_rows, n_cols,
                        decay, step_size, threshold, noise_ratio, seed,
                        SHRINK: tl.constexpr, PERTURB: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    if SHRINK:
        # Element-wise partial sums; one cross-lane reduction per row block, after the walk.
        squares = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            in_bounds = row_ok[:, None] & (cols[None, :] < n_cols)
            d = _displaced(delta_ptr, grad_ptr, rows[:, None] * n_cols + cols[None, :], in_bounds,
                           decay, step_size)
            squares += d * d
        scale = group_scale(tl.sum(squares, axis=1), threshold)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        in_bounds = row_ok[:, None] & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        d = _displaced(delta_ptr, grad_ptr, offsets, in_bounds, decay, step_size)
        if SHRINK:
            d = d * scale[:, None]
        _finish(delta_ptr, weight_ptr, perturbed_ptr, offsets, in_bounds, d, noise_ratio, seed,
                PERTURB)


@triton.jit(do_not_specialize=["decay", "step_size", "threshold", "noise_ratio", "seed"])
def _moreau_columns_kernel(delta_ptr, grad_ptr, weight_ptr, perturbed_ptr, n_rows, n_cols,
                           decay, step_size, threshold, noise_ratio, seed,
                           PERTURB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    squares = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        in_bounds = (rows[:, None] < n_rows) & col_ok[None, :]
        d = _displaced(delta_ptr, grad_ptr, rows[:, None] * n_cols + cols[None, :], in_bounds,
                       decay, step_size)
        squares += d * d
    scale = group_scale(tl.sum(squares, axis=0), threshold)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        in_bounds = (rows[:, None] < n_rows) & col_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        d = _displaced(delta_ptr, grad_ptr, offsets, in_bounds, decay, step_size) * scale[None, :]
        _finish(delta_ptr, weight_ptr, perturbed_ptr, offsets, in_bounds, d, noise_ratio, seed,
                PERTURB)


@triton.jit(do_not_specialize=["noise_ratio", "seed"])
def _moreau_perturb_kernel(perturbed_ptr, weight_ptr, delta_ptr, numel, noise_ratio, seed,
                           BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < numel
    delta = tl.load(delta_ptr + offsets, mask=in_bounds, other=0.0)
    _perturb(perturbed_ptr, weight_ptr, offsets, in_bounds, delta, noise_ratio, seed)


@triton.jit
def _philox_kernel(out_ptr, offsets_ptr, n, seed, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = index < n
    offsets = tl.load(offsets_ptr + index, mask=in_bounds, other=0)
    c0, c1, _, _ = tl.randint4x(seed, offsets)
    tl.store(out_ptr + 2 * index, c0.to(tl.int64) & 0xFFFFFFFF, mask=in_bounds)
    tl.store(out_ptr + 2 * index + 1, c1.to(tl.int64) & 0xFFFFFFFF, mask=in_bounds)


# GPU tiles: rows x columns of at most 4096 (rows) / 8192 (columns kernel, short columns walk many
# rows) fp32 elements per program, so the norm accumulator stays in registers.
_ROW_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                for r, c in ((1, 1024), (1, 2048), (2, 1024), (2, 2048), (4, 512), (4, 1024))
                for w in (4, 8)]
_COLUMN_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                   for c in (16, 32, 64) for r in (64, 128, 256) if r * c <= 8192 for w in (4, 8)]
_PERTURB_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]

_rows_tuned = triton.autotune(_ROW_CONFIGS, key=["n_cols", "SHRINK", "PERTURB"],
                              restore_value=["delta_ptr"])(_moreau_rows_kernel)
_columns_tuned = triton.autotune(_COLUMN_CONFIGS, key=["n_rows", "n_cols", "PERTURB"],
                                 restore_value=["delta_ptr"])(_moreau_columns_kernel)
_perturb_tuned = triton.autotune(_PERTURB_CONFIGS, key=["numel"])(_moreau_perturb_kernel)


#: Elements per program under the CPU interpreter, whose cost is mostly per operation (Philox
#: alone is ~100 of them): few, large tiles run several times faster there.
_INTERPRETER_TILE = 1 << 16


def _interpreter_tile(n_rows: int, n_cols: int, max_cols: int):
    block_c = min(triton.next_power_of_2(n_cols), max_cols)
    return min(triton.next_power_of_2(n_rows), max(1, _INTERPRETER_TILE // block_c)), block_c


def moreau_step_(delta, grad, weight, perturbed, decay: float, step_size: float, threshold: float,
                 group_dim: int, noise_ratio: float, seed: int, interpreted: bool) -> None:
    """delta [rows, cols] fp32, grad/weight/perturbed (or None) contiguous of the same shape."""
    n_rows, n_cols = delta.shape
    perturb = perturbed is not None
    args = (delta, grad, weight, perturbed if perturb else delta, n_rows, n_cols,
            decay, step_size, threshold, noise_ratio, seed)
    if threshold > 0 and group_dim == 1:
        if interpreted:
            block_r, block_c = _interpreter_tile(n_rows, n_cols, 256)
            _moreau_columns_kernel[(triton.cdiv(n_cols, block_c),)](
                *args, PERTURB=perturb, BLOCK_R=block_r, BLOCK_C=block_c)
        else:
            _columns_tuned[lambda meta: (triton.cdiv(n_cols, meta["BLOCK_C"]),)](*args, PERTURB=perturb)
        return
    shrink = threshold > 0
    if interpreted:
        block_r, block_c = _interpreter_tile(n_rows, n_cols, 8192)
        _moreau_rows_kernel[(triton.cdiv(n_rows, block_r),)](
            *args, SHRINK=shrink, PERTURB=perturb, BLOCK_R=block_r, BLOCK_C=block_c)
    else:
        _rows_tuned[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]),)](
            *args, SHRINK=shrink, PERTURB=perturb)


def moreau_perturb_(perturbed, weight, delta, noise_ratio: float, seed: int, interpreted: bool) -> None:
    """perturbed, weight, delta contiguous of one shape."""
    numel = delta.numel()
    if interpreted:
        block = _INTERPRETER_TILE
        _moreau_perturb_kernel[(triton.cdiv(numel, block),)](perturbed, weight, delta, numel,
                                                             noise_ratio, seed, BLOCK=block)
    else:
        _perturb_tuned[lambda meta: (triton.cdiv(numel, meta["BLOCK"]),)](
            perturbed, weight, delta, numel, noise_ratio, seed)


def philox_uint32(seed: int, offsets: torch.Tensor):
    """tl.randint4x(seed, offsets)[:2] as int64 (the generator behind z; compared with
    pyprune.ops.reference.philox_uint32 in the tests)."""
    offsets = offsets.to(torch.int64).contiguous()
    out = torch.empty(offsets.numel(), 2, dtype=torch.int64, device=offsets.device)
    block = 1024
    _philox_kernel[(triton.cdiv(offsets.numel(), block),)](out, offsets, offsets.numel(), seed, BLOCK=block)
    return out[:, 0].reshape(offsets.shape), out[:, 1].reshape(offsets.shape)
