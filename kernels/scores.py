"""Per-element importance scores and activation statistics (fp32 accumulation).

score kinds, shared with the mask kernels: 0 = the input itself, 1 = |W| (magnitude),
2 = |W|·sqrt(Σx²) (Wanda), 3 = |W ⊙ G| (first-order Taylor, LLM-Pruner).
"""
import torch
import triton
import triton.language as tl

GIVEN, MAGNITUDE, WANDA, TAYLOR = 0, 1, 2, 3


@triton.jit
def load_score(src_ptr, aux_ptr, offsets, cols, in_bounds, SCORE_KIND: tl.constexpr):
    """fp32 score of the elements at flat ``offsets`` (column ``cols``) of a contiguous tensor."""
    x = tl.load(src_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    if SCORE_KIND == 1:
        x = tl.abs(x)
    elif SCORE_KIND == 2:
        sqnorm = tl.load(aux_ptr + cols, mask=in_bounds, other=0.0).to(tl.float32)
        x = tl.abs(x) * tl.sqrt_rn(sqnorm)
    elif SCORE_KIND == 3:
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
