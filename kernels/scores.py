"""Per-element importance scores and activation statistics (fp32 accumulation).

The score kinds (``SCORE_KIND``, shared with the mask kernels) are
:class:`pyprune.ops.conventions.ScoreKind`: the input itself, |W| (magnitude), |W|·sqrt(Σx²)
(Wanda), |W ⊙ G| (first-order Taylor, LLM-Pruner).

``accumulate_abs_outer_`` is COPAL's statistic G += alpha·|DY|ᵀ|X| (Malla et al., Eqs. 10–11 for a
linear layer): a GEMM over the tokens whose operands take |·| as they are loaded, so no |DY| or |X|
copy exists, and whose epilogue adds into G in place.
"""
import torch
import triton
import triton.language as tl

from ..conventions import ScoreKind
from .linear import _dot

# The kinds as constexpr globals, which a jit function may read.
_MAGNITUDE = tl.constexpr(int(ScoreKind.MAGNITUDE))
_WANDA = tl.constexpr(int(ScoreKind.WANDA))
_TAYLOR = tl.constexpr(int(ScoreKind.TAYLOR))


@triton.jit
def load_score(src_ptr, aux_ptr, offsets, cols, in_bounds, SCORE_KIND: tl.constexpr):
    """fp32 score of the elements at flat ``offsets`` (column ``cols``) of a contiguous tensor."""
    x = tl.load(src_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    return score_of(x, aux_ptr, offsets, cols, in_bounds, SCORE_KIND)


@triton.jit
def score_of(x, aux_ptr, offsets, cols, in_bounds, SCORE_KIND: tl.constexpr):
    """fp32 score of the fp32 values ``x`` held in registers (at flat ``offsets``, column ``cols``)."""
    if SCORE_KIND == _MAGNITUDE:
        x = tl.abs(x)
    elif SCORE_KIND == _WANDA:
        sqnorm = tl.load(aux_ptr + cols, mask=in_bounds, other=0.0).to(tl.float32)
        x = tl.abs(x) * tl.sqrt_rn(sqnorm)
    elif SCORE_KIND == _TAYLOR:
        grad = tl.load(aux_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        x = tl.abs(x * grad)
    return x


@triton.jit
def _score_kernel(src_ptr, aux_ptr, out_ptr, numel, n_cols,
                  SCORE_KIND: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < numel
    score = load_score(src_ptr, aux_ptr, offsets, offsets % n_cols, in_bounds, SCORE_KIND)
    tl.store(out_ptr + offsets, score, mask=in_bounds)


def score(src: torch.Tensor, aux, kind: int) -> torch.Tensor:
    """fp32 score tensor of ``src`` (contiguous); ``aux`` is act_sqnorm (Wanda) or grad (Taylor)."""
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    block = 1024
    grid = (triton.cdiv(src.numel(), block),)
    _score_kernel[grid](src, src if aux is None else aux, out, src.numel(), src.shape[-1],
                        SCORE_KIND=kind, BLOCK=block)
    return out


@triton.jit
def _sqnorm_partial_kernel(x_ptr, partial_ptr, n_tokens, n_cols, tokens_per_chunk,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """partial[chunk, c] = Σ over this chunk's tokens of x[t, c]², in fp32."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    chunk = tl.program_id(1)
    start = chunk * tokens_per_chunk
    stop = tl.minimum(start + tokens_per_chunk, n_tokens)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for t0 in range(start, stop, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        in_bounds = (tokens[:, None] < stop) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + tokens[:, None].to(tl.int64) * n_cols + cols[None, :],
                    mask=in_bounds, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + chunk * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols)


def accumulate_sqnorm_(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc += column sums of squares of x [tokens, cols]; deterministic (no atomics)."""
    n_tokens, n_cols = x.shape
    block_t, block_c = 32, 128
    chunks = max(1, min(64, triton.cdiv(n_tokens, 256)))
    tokens_per_chunk = triton.cdiv(n_tokens, chunks)
    partial = torch.empty(chunks, n_cols, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_cols, block_c), chunks)
    _sqnorm_partial_kernel[grid](x, partial, n_tokens, n_cols, tokens_per_chunk,
                                 BLOCK_T=block_t, BLOCK_C=block_c)
    acc += partial.sum(dim=0)
    return acc


@triton.jit
def _abs_outer_kernel(acc_ptr, a_ptr, b_ptr, M, D, T, alpha,
                      UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr, GROUP_M: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[M, D] += alpha·|a|ᵀ|b| for a [T, M], b [T, D] (contiguous); one program per output tile."""
    # Tiles are numbered down columns of GROUP_M tile rows, so programs that run together share
    # the same few strips of a and b (L2 reuse), as in a grouped-ordering GEMM.
    pid = tl.program_id(0)
    tiles_d = tl.cdiv(D, BLOCK_D)
    first_m = (pid // (GROUP_M * tiles_d)) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_d)) % group_rows
    tile_d = (pid % (GROUP_M * tiles_d)) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_d * BLOCK_D + tl.arange(0, BLOCK_D)
    result = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, T, BLOCK_K):
        tokens = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        # a is [T, M] row-major: the tile of aᵀ [BLOCK_M, BLOCK_K] is loaded transposed by its
        # offsets (feature m of token t at t·M + m). Masked lanes load 0, which adds nothing.
        a_t = tl.load(a_ptr + tokens[None, :] * M + rows[:, None],
                      mask=(rows[:, None] < M) & (tokens[None, :] < T), other=0.0)
        b = tl.load(b_ptr + tokens[:, None] * D + cols[None, :],
                    mask=(tokens[:, None] < T) & (cols[None, :] < D), other=0.0)
        # |x| is exact in every dtype, and products of 16-bit values are exact in fp32. Mixed
        # dtypes are made fp32 here: tl.dot needs one dtype even on _dot's untaken 16-bit path.
        a_t, b = tl.abs(a_t), tl.abs(b)
        if UPCAST:
            a_t, b = a_t.to(tl.float32), b.to(tl.float32)
        result = _dot(result, a_t, b, UPCAST, FP32_IEEE)
    offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
    in_bounds = (rows[:, None] < M) & (cols[None, :] < D)
    acc = tl.load(acc_ptr + offsets, mask=in_bounds, other=0.0)
    tl.store(acc_ptr + offsets, acc + alpha * result, mask=in_bounds)


# GPU tiles (autotuned per M, D and the operand dtypes). acc is restored after each trial launch:
# the kernel adds into it.
_ABS_OUTER_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_D": bd, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                      for bm, bd in ((64, 64), (64, 128), (128, 64), (128, 128)) for bk in (32, 64)
                      for w, st in ((4, 3), (8, 4))]
#: Shared memory for the pipelined operand tiles: an sm_80 block may have up to 163 KB.
_SHARED_MEMORY = 160 * 1024


def _fits_shared_memory(configs, named_args, **kwargs):
    """Keep the configs whose num_stages copies of the a and b tiles fit in shared memory (the
    large fp32 tiles do not; launching them would only fail)."""
    element_size = 4 if kwargs["UPCAST"] or kwargs["FP32_IEEE"] else 2
    return [c for c in configs
            if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_D"]) * c.kwargs["BLOCK_K"] * element_size
            <= _SHARED_MEMORY]


_abs_outer_tuned = triton.autotune(_ABS_OUTER_CONFIGS, key=["M", "D"], restore_value=["acc_ptr"],
                                   prune_configs_by={"early_config_prune": _fits_shared_memory})(
    _abs_outer_kernel)
#: Grouped tile ordering: tile rows per group.
_GROUP_M = 8
#: Tiles under the CPU interpreter, whose cost is mostly per operation.
_INTERPRETER_BLOCKS = {"BLOCK_M": 64, "BLOCK_D": 64, "BLOCK_K": 32}


def accumulate_abs_outer_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float,
                          interpreted: bool) -> None:
    """acc [M, D] fp32 += alpha·|a|ᵀ|b| for a [T, M], b [T, D] contiguous, fp32/fp16/bf16 each.

    Two operands of one 16-bit dtype go to the tensor cores as they are; otherwise both are fed as
    fp32 (exact for 16-bit values) to an IEEE fp32 dot. Under the interpreter bf16 is upcast too
    (its bf16 ``tl.dot`` is wrong).
    """
    n_tokens, M = a.shape
    D = b.shape[1]
    upcast = a.dtype != b.dtype or (interpreted and a.dtype == torch.bfloat16)
    constexprs = dict(UPCAST=upcast, FP32_IEEE=torch.float32 in (a.dtype, b.dtype), GROUP_M=_GROUP_M)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(D, meta["BLOCK_D"]),)

    if interpreted:
        _abs_outer_kernel[grid(_INTERPRETER_BLOCKS)](acc, a, b, M, D, n_tokens, alpha, **constexprs,
                                                     **_INTERPRETER_BLOCKS)
    else:
        _abs_outer_tuned[grid](acc, a, b, M, D, n_tokens, alpha, **constexprs)
