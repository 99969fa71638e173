"""Pure-PyTorch reference of every op: the test oracle for the kernels and the fallback path.
It follows the conventions of :mod:`pyprune.ops.conventions` (kept counts, mask packing), as every
backend does.

Nothing here validates arguments: :mod:`pyprune.ops` does that before any backend runs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .conventions import kept_count, pack_mask, sparse24_mma_mask, sparse24_mma_meta, unpack_mask


def magnitude_score(w: Tensor) -> Tensor:
    """|W| in fp32."""
    return w.float().abs()


def wanda_score(w: Tensor, act_sqnorm: Tensor) -> Tensor:
    """Wanda: |W_ij|·‖X_j‖₂ with ‖X_j‖₂ = sqrt(Σ_tokens x_j²) given as the column sum of squares.

    The square root is taken in fp64 and rounded once to fp32, i.e. the correctly rounded fp32
    sqrt that the kernels use (torch's vectorised CPU sqrt can be 1 ulp off, which flips ties).
    """
    return w.float().abs() * act_sqnorm.double().sqrt().float()


def taylor_score(w: Tensor, grad: Tensor) -> Tensor:
    """First-order Taylor importance |W ⊙ ∇W| (LLM-Pruner), in fp32."""
    return (w.float() * grad.float()).abs()


def accumulate_sqnorm_(acc: Tensor, x: Tensor) -> Tensor:
    """acc[j] += Σ_tokens x[..., j]² in fp32; returns acc."""
    acc += x.reshape(-1, x.shape[-1]).float().square().sum(dim=0)
    return acc


def accumulate_abs_outer_(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """acc [M, D] += alpha·|a|ᵀ|b| over the tokens (all leading dims) of a [..., M] and b [..., D],
    an fp32 matmul of the absolute values (COPAL's G += 2|DY|ᵀ|X|); returns acc."""
    a_abs = a.reshape(-1, a.shape[-1]).float().abs()
    b_abs = b.reshape(-1, b.shape[-1]).float().abs()
    return acc.addmm_(a_abs.T, b_abs, alpha=alpha)


def keep_top(scores: Tensor, k: int) -> Tensor:
    """Keep the k highest of each row of a 2-D fp32 tensor; equal scores keep the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(-1, order[:, :k], True)


def topk_mask(scores: Tensor, sparsity: float, scope: str = "row") -> Tensor:
    """Keep exactly kept_count(count, sparsity) highest scores per row (last dim) or per tensor."""
    scores = scores.float()
    rows = scores.reshape(-1, scores.shape[-1]) if scope == "row" else scores.reshape(1, -1)
    return keep_top(rows, kept_count(rows.shape[1], sparsity)).reshape(scores.shape)


def nm_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the n highest of every m consecutive scores along the last dim."""
    groups = scores.float().reshape(-1, m)
    return keep_top(groups, n).reshape(scores.shape)


def _score(w: Tensor, act_sqnorm: Optional[Tensor]) -> Tensor:
    return magnitude_score(w) if act_sqnorm is None else wanda_score(w, act_sqnorm)


def score_nm_mask(w: Tensor, n: int, m: int, act_sqnorm: Optional[Tensor] = None) -> Tensor:
    """N:M mask of the magnitude score, or of the Wanda score when ``act_sqnorm`` is given."""
    return nm_mask(_score(w, act_sqnorm), n, m)


def score_topk_mask(w: Tensor, sparsity: float, scope: str = "row",
                    act_sqnorm: Optional[Tensor] = None) -> Tensor:
    """Top-k mask of the magnitude score, or of the Wanda score when ``act_sqnorm`` is given."""
    return topk_mask(_score(w, act_sqnorm), sparsity, scope)


def soft_threshold(x: Tensor, alpha: float) -> Tensor:
    """prox of α‖·‖₁: sign(x)·max(|x| − α, 0), computed in fp32."""
    xf = x.float()
    return (xf.sign() * (xf.abs() - alpha).clamp_min(0.0)).to(x.dtype)


def group_soft_threshold(x: Tensor, alpha: float, group_dim: int) -> Tensor:
    """prox of α‖·‖₂,₁ (MoreauPruner Eq. 8): x_g·max(0, 1 − α/‖x_g‖₂), one group per index of group_dim."""
    xf = x.float()
    other_dims = [d for d in range(x.dim()) if d != group_dim % x.dim()]
    norm = xf.square().sum(dim=other_dims, keepdim=True).sqrt() if other_dims else xf.abs()
    return group_shrink(xf, norm, alpha).to(x.dtype)


def group_shrink(x: Tensor, norms: Tensor, alpha: float) -> Tensor:
    """x_g·max(0, 1 − α/‖x_g‖₂) given the groups' norms (broadcast against x): group
    soft-thresholding once the norms are known, e.g. summed over the ranks that hold a group's parts."""
    return x * torch.where(norms > alpha, 1.0 - alpha / norms, torch.zeros_like(norms))


def nm_compress(w: Tensor, mask: Tensor, n: int, m: int) -> Tuple[Tensor, Tensor]:
    """(values, meta) of an N:M-masked weight; ``mask`` has exactly n True per group of m."""
    values = w[mask].reshape(w.shape[0], w.shape[1] * n // m)
    return values, pack_mask(mask)


def nm_decompress(values: Tensor, meta: Tensor, n: int, m: int) -> Tensor:
    """Dense W ⊙ mask from the compressed form."""
    cols = values.shape[1] * m // n
    mask = unpack_mask(meta, cols)
    dense = torch.zeros(values.shape[0], cols, dtype=values.dtype, device=values.device)
    dense[mask] = values.reshape(-1)
    return dense


def nm_linear(x: Tensor, values: Tensor, meta: Tensor, n: int, m: int,
              bias: Optional[Tensor] = None) -> Tensor:
    """x @ (W ⊙ mask)ᵀ + b from the compressed form."""
    return F.linear(x, nm_decompress(values, meta, n, m), bias)


def sparse24_linear(x: Tensor, values: Tensor, mma_meta: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x @ Wᵀ + b for a 2:4 W given as the CUDA kernel takes it (values as nm_compress gives them,
    int16 mma.sp metadata as sparse24_mma_meta gives it): fp32 products and sums, rounded once to
    x's dtype, as the kernel does."""
    mask = sparse24_mma_mask(mma_meta, values.shape[1] * 2)
    dense = nm_decompress(values, pack_mask(mask), 2, 4)
    return F.linear(x.float(), dense.float(), None if bias is None else bias.float()).to(x.dtype)


def sliced_linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
                  in_index: Optional[Tensor] = None, out_index: Optional[Tensor] = None) -> Tensor:
    """x @ W[out_index][:, in_index]ᵀ + b[out_index]; x holds only the kept input channels."""
    if out_index is not None:
        w = w.index_select(0, out_index)
        bias = None if bias is None else bias.index_select(0, out_index)
    if in_index is not None:
        w = w.index_select(1, in_index)
    return F.linear(x, w, bias)


# ---- MoreauPruner displacement step (Algorithm 1 in displacement form) -------------------------
#
# z is Triton's tl.randn(seed, offset) with offset = the flat (row-major) element index:
# Philox4x32-10 with counter (offset mod 2**32, offset >> 32, 0, 0) and key (seed mod 2**32,
# seed >> 32); its first two outputs become uniforms (tl.random.uint_to_uniform_float) and the
# first Box–Muller output is z. The uint32s and uniforms are exact; log, cos (and the Triton/C++
# versions of them) are within a few fp32 ulps, so z agrees across backends to ~1e-6.

_UINT32 = 0xFFFFFFFF
_PHILOX_ROUNDS = 10
_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
#: tl.random's uint_to_uniform_float scale: (2**31 - 1)·scale < 1 after fp32 rounding.
_UNIFORM_SCALE = 4.6566127342e-10
_TWO_PI = 6.283185307179586
_MIN_UNIFORM = 1.0e-7


def _mul_wide(x: Tensor, multiplier: int) -> Tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of x·multiplier for uint32 values held in int64, in 16-bit pieces so
    no int64 product overflows."""
    low_part = x * (multiplier & 0xFFFF)
    middle = x * (multiplier >> 16) + (low_part >> 16)
    return middle >> 16, ((middle & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox_uint32(seed: int, offsets: Tensor) -> Tuple[Tensor, Tensor]:
    """The first two uint32 outputs (held in int64) of Philox4x32-10 at each offset: exactly
    ``tl.randint4x(seed, offsets)[:2]`` for int64 offsets and a seed in [0, 2**63)."""
    offsets = offsets.to(torch.int64)
    c0, c1 = offsets & _UINT32, (offsets >> 32) & _UINT32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _UINT32, (seed >> 32) & _UINT32
    for _ in range(_PHILOX_ROUNDS):
        high0, low0 = _mul_wide(c0, _PHILOX_MULTIPLIERS[0])
        high2, low2 = _mul_wide(c2, _PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
        k0 = (k0 + _PHILOX_KEY_STEPS[0]) & _UINT32
        k1 = (k1 + _PHILOX_KEY_STEPS[1]) & _UINT32
    return c0, c1


def _uniform(bits: Tensor) -> Tensor:
    """tl.random.uint_to_uniform_float: the word as int32, negatives bit-inverted, times the scale
    (int -> fp32 rounding, then one fp32 multiply): U[0, 1)."""
    signed = torch.where(bits > 0x7FFFFFFF, bits - (1 << 32), bits)
    signed = torch.where(signed < 0, ~signed, signed)
    return signed.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def standard_normal(seed: int, offsets: Tensor) -> Tensor:
    """z ~ N(0, 1) at each offset, fp32: ``tl.randn(seed, offsets)`` (Box–Muller, first output)."""
    c0, c1 = philox_uint32(seed, offsets)
    u1 = _uniform(c0).clamp_min(_MIN_UNIFORM)
    theta = _uniform(c1) * torch.tensor(_TWO_PI, dtype=torch.float32)
    return (-2.0 * u1.log()).sqrt() * theta.cos()


def moreau_perturb_(perturbed: Tensor, weight: Tensor, delta: Tensor, noise_ratio: float,
                    seed: int) -> None:
    """perturbed ← W + δ + noise_ratio·|W|·z in fp32, written in perturbed's dtype."""
    w = weight.float()
    offsets = torch.arange(w.numel(), device=w.device).reshape(w.shape)
    noise = noise_ratio * w.abs() * standard_normal(seed, offsets)
    perturbed.copy_(w + delta + noise)


def moreau_step_(delta: Tensor, grad: Tensor, weight: Tensor, perturbed: Optional[Tensor],
                 decay: float, step_size: float, threshold: float, group_dim: int,
                 noise_ratio: float, seed: int) -> None:
    """δ ← GST_threshold(decay·δ − step_size·g) along group_dim (no shrinking at threshold 0), then
    perturbed ← W + δ + noise_ratio·|W|·z when perturbed is given. δ is fp32."""
    d = decay * delta - step_size * grad.float()
    if threshold > 0:
        d = group_soft_threshold(d, threshold, group_dim)
    delta.copy_(d)
    if perturbed is not None:
        moreau_perturb_(perturbed, weight, delta, noise_ratio, seed)


# ---- DReSS channel penalty (spec §1.4, Eqs. 2–4) ------------------------------------------------

def channel_penalty_(grad: Tensor, weight: Tensor, channels: Tensor, dim: int, lam: float,
                     norm: str = "l2") -> Tensor:
    """grad[slice c] += lam·∂‖W[slice c]‖/∂W for every c in ``channels``, slice c being index c of
    ``dim`` (a row for dim 0, a column for dim 1, one element of a 1-D weight); returns the fp32
    norms ‖W[slice c]‖ in channels order.

    "l2": the gradient is lam·W/‖W‖₂ (none where the norm is 0); "l1": ‖W‖₁ and lam·sign(W).
    Each updated grad element is computed in fp32 and rounded once to grad's dtype.
    """
    slices = weight.index_select(dim, channels).float()
    others = [d for d in range(weight.dim()) if d != dim]
    if norm == "l1":
        norms = slices.abs().sum(dim=others, keepdim=True) if others else slices.abs()
    else:
        norms = torch.linalg.vector_norm(slices, dim=others, keepdim=True) if others else slices.abs()
    updated = grad.index_select(dim, channels).float() + penalty_gradient(slices, norms, lam, norm)
    grad.index_copy_(dim, channels, updated.to(grad.dtype))
    return norms.reshape(-1)


def penalty_gradient(slices: Tensor, norms: Tensor, lam: float, norm: str) -> Tensor:
    """lam·∂‖W_c‖/∂W on the fp32 ``slices`` given their norms (broadcast against them): lam·W/‖W‖₂
    (none where the norm is 0) for "l2", lam·sign(W) for "l1"."""
    if norm == "l1":
        return lam * slices.sign()
    return slices * torch.where(norms > 0, lam / norms, torch.zeros_like(norms))


# ---- SAFE: ADMM dual update and the penalised SAM/Adam step (spec §1.4–1.8, K5–K6) --------------

def admm_dual_update_(v: Tensor, keep: Tensor, x: Tensor, act_sqnorm: Optional[Tensor], n: int, m: int,
                      sparsity: float, scope: str) -> Tensor:
    """SAFE's z- and u-step on the compact state (v, keep), where z = v⊙keep and u = v⊙¬keep:
    v ← x + u, then keep ← the projection's support of v (N:M when m > 0, else top-k at
    ``sparsity`` per ``scope``) by |v|, or by |v|·sqrt(act_sqnorm) (SAFE⁺, P = diag(AᵀA)).
    Returns the squared primal residual ‖x − z‖² (fp32, 0-d) with the new z."""
    v.mul_(~keep).add_(x.float())
    keep.copy_(score_nm_mask(v, n, m, act_sqnorm) if m else score_topk_mask(v, sparsity, scope, act_sqnorm))
    return (x.float() - v * keep).square().sum()


def sam_perturb_(params, grads, anchors, rho: float) -> Tensor:
    """SAM ascent (spec §1.5): anchor ← x, then x ← x + rho·g/‖g‖₂ with the norm over all tensors
    (fp32, no perturbation where ‖g‖ = 0). Returns ‖g‖₂ (fp32, 0-d)."""
    norm = torch.stack([g.float().square().sum() for g in grads]).sum().sqrt()
    scale = rho / norm if float(norm) > 0 else torch.zeros_like(norm)
    for p, g, anchor in zip(params, grads, anchors):
        anchor.copy_(p)
        p.copy_((p.float() + scale * g.float()).to(p.dtype))
    return norm


def admm_gap(x: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """x − z + u in fp32 from the compact ADMM state (z = v⊙keep, u = v⊙¬keep): x + v⊙(1 − 2·keep),
    the term the penalty λ(x − z + u) of Eq. (5) scales."""
    return x.float() + v * (1.0 - 2.0 * keep.float())


def sam_adam_step_(params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, lam: float, step: int) -> None:
    """Eq. (5) with Adam: x ← anchor (undo the SAM ascent), G = g + lam·(x − z + u) with
    x − z + u = x + v⊙(1 − 2·keep), then an Adam step on G (the penalty enters the moments) with
    decoupled weight decay; all in fp32, x rounded once to its dtype."""
    bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    for p, g, anchor, v, keep, m1, m2 in zip(params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs):
        x = anchor.float()
        G = g.float() + lam * admm_gap(x, v, keep)
        x = x * (1.0 - lr * weight_decay)
        m1.mul_(beta1).add_(G, alpha=1.0 - beta1)
        m2.mul_(beta2).addcmul_(G, G, value=1.0 - beta2)
        x = x - lr * (m1 / bias1) / ((m2 / bias2).sqrt() + eps)
        p.copy_(x.to(p.dtype))
