"""ALPS's layer solver (Meng, Behdin, Wang, Mazumder, 2024): the layer-wise reconstruction problem

    min_Ŵ  E(Ŵ) = tr((Ŵ − W) H (Ŵ − W)ᵀ)   s.t. Ŵ in the sparsity pattern,   H = XᵀX (+ ridge),

solved in two steps on the weights W [out, in] and the input Gram matrix H [in, in]:

1. :func:`admm_support` — ADMM on the split Ŵ = D, D in the pattern (the paper's Algorithm 1):
   Ŵ-step Ŵ = (WH − V + ρD)(H + ρI)⁻¹, D-step D = proj(Ŵ + V/ρ), dual step V ← V + ρ(Ŵ − D),
   with the penalty ρ raised every few iterations by how much the support changed (×1.3, ×1.2,
   ×1.1), and lowered (÷5, from the start) while it never moved; it stops when the support is
   stable. The iterate Ŵ is projected at the end.
2. :func:`pcg_on_support` — preconditioned conjugate gradient (diagonal preconditioner) on the
   support found, from the projected iterate: the normal equations (ŴH)_S = (WH)_S of each output
   row restricted to its kept weights S (the paper's Algorithm 2).

The projection is by magnitude on the normalised problem (:func:`normalise`: H scaled to a unit
diagonal, W's columns by ‖X_j‖, as the authors' code), so it scores |W_ij|·‖X_j‖. In the scaled
dual U = V/ρ the D- and dual steps are SAFE's (:func:`pyprune.ops.admm_dual_update_` on the
compact state v = Ŵ + U, keep = support of D); U is rescaled by ρ_old/ρ_new when ρ changes.
Defaults are those of the authors' code (github.com/mazumder-lab/ALPS): ρ₀ = 0.1, at most 300
iterations, ρ updated every 3, stop once fewer than 0.03% of the kept weights move at an update
after the first 30 iterations (their 0-based ``i_admm >= 30``: the first such update is the 33rd);
10 PCG iterations, relative tolerance 1e-4.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch
from torch import Tensor

from .. import ops
from ..patterns import NM, Pattern

#: support change (a fraction of the kept weights) above which ρ grows by the factor beside it
_RHO_STEPS = ((0.1, 1.3), (0.005, 1.2))
#: ρ grows by this while any weight still moves after ρ has started to grow
_RHO_SLOW = 1.1
#: ρ is divided by this while the support has never moved (ρ₀ too large for this layer)
_RHO_DOWN = 5.0
_RHO_MAX = 1e6


@dataclass(frozen=True)
class AdmmSchedule:
    """ALPS's ADMM iteration budget and penalty schedule (the authors' defaults)."""

    rho: float = 0.1
    max_iterations: int = 300
    update_every: int = 3
    min_iterations: int = 30
    #: at an update after the first ``min_iterations`` iterations (0-based index >= min_iterations, as the
    #: authors' ``i_admm >= switch_iter``), stop once the support change is below this fraction of the kept weights
    stable_fraction: float = 3e-4


@dataclass
class AdmmTrace:
    """One entry per ρ update: iteration, ρ before the update, support change (weights that entered
    or left), and ‖Ŵ − D‖ / ‖Ŵ‖ at that iteration (the primal residual)."""

    iterations: int = 0
    updates: List[Tuple[int, float, int, float]] = field(default_factory=list)


def normalise(H: Tensor, W: Tensor, percdamp: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(Ĥ, Ŵ₀, scale): H + λI with λ = percdamp·mean(diag H) (the identity when every input is
    zero), scaled to a unit diagonal, Ĥ = S⁻¹(H + λI)S⁻¹ with S = diag(scale), and W's columns
    multiplied by ``scale`` (the square root of that diagonal), so that E is unchanged:
    tr((Ŵ − W)(H + λI)(Ŵ − W)ᵀ) = tr((ŴS − WS) Ĥ (ŴS − WS)ᵀ). A weight of the scaled problem
    divided by ``scale`` is a weight of the layer."""
    H = H.double()
    damp = percdamp * float(torch.diagonal(H).mean())
    if damp == 0:
        H, damp = torch.zeros_like(H), 1.0
    H = H + damp * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    scale = torch.diagonal(H).sqrt()
    return (H / scale[:, None] / scale[None, :]).float(), W.float() * scale.float(), scale.float()


def reconstruction_error(H: Tensor, W: Tensor, W_hat: Tensor) -> float:
    """E(Ŵ) / E(0) = tr((Ŵ − W) H (Ŵ − W)ᵀ) / tr(W H Wᵀ): the layer's output error relative to its
    output (0 for the dense layer, 1 for all weights zero)."""
    delta = (W_hat - W).double()
    total = float(((W.double() @ H.double()) * W.double()).sum())
    return float(((delta @ H.double()) * delta).sum()) / total if total > 0 else 0.0


def _projection(pattern: Pattern) -> dict:
    """The constraint arguments of :func:`pyprune.ops.admm_dual_update_` for ``pattern``."""
    if isinstance(pattern, NM):
        return {"n": pattern.n, "m": pattern.m}
    return {"sparsity": pattern.sparsity, "scope": pattern.scope or "row"}


def _inverse(eigenvalues: Tensor, eigenvectors: Tensor, rho: float) -> Tensor:
    """(H + ρI)⁻¹ from H's eigendecomposition."""
    return (eigenvectors / (eigenvalues + rho)) @ eigenvectors.T


def admm_support(H: Tensor, W: Tensor, pattern: Pattern,
                 schedule: AdmmSchedule = AdmmSchedule()) -> Tuple[Tensor, Tensor, AdmmTrace]:
    """ALPS's ADMM (Algorithm 1) on the normalised problem (:func:`normalise`): returns the last
    iterate Ŵ projected onto ``pattern`` by magnitude, its support (bool, exactly the pattern's
    count) and the :class:`AdmmTrace`. H [in, in] symmetric positive definite; W [out, in]."""
    H, W = H.float(), W.float().contiguous()
    eigenvalues, eigenvectors = torch.linalg.eigh(H)  # fp32: Ĥ has a unit diagonal and a ridge
    rho = schedule.rho
    inverse = _inverse(eigenvalues, eigenvectors, rho)
    target = W @ H  # WH, the linear term of E
    projection = _projection(pattern)
    start = pattern.weight_mask(W)
    kept = int(start.sum())
    # compact state of D = proj(W), U = 0: v = D + U, keep = support of D
    keep, v = start.clone(), W * start
    previous = keep.clone()
    rho_grew = False
    trace = AdmmTrace()
    W_hat = W
    for iteration in range(1, schedule.max_iterations + 1):
        trace.iterations = iteration
        signs = keep.float().mul_(2).sub_(1)  # D − U = v ⊙ (2·keep − 1)
        W_hat = torch.addcmul(target, v, signs, value=rho) @ inverse
        primal = float(ops.admm_dual_update_(v, keep, W_hat, **projection)) ** 0.5  # D-step, dual step
        if iteration % schedule.update_every:
            continue
        change = int((keep != previous).sum())
        trace.updates.append((iteration, rho, change, primal / max(float(W_hat.norm()), 1e-30)))
        old_rho = rho
        for fraction, factor in _RHO_STEPS:
            if change > fraction * kept:
                rho, rho_grew = rho * factor, True
                break
        else:
            if change and rho_grew:
                rho *= _RHO_SLOW
            elif rho_grew:
                break  # the support is stable
            else:
                rho /= _RHO_DOWN
                if change:  # ρ₀ was too large: start again from proj(W)
                    keep, v = start.clone(), W * start
        previous = keep.clone()
        rho = min(rho, _RHO_MAX)
        if rho != old_rho:
            v.mul_(torch.where(keep, 1.0, old_rho / rho))  # U = V/ρ for the new ρ
            inverse = _inverse(eigenvalues, eigenvectors, rho)
        if iteration - 1 >= schedule.min_iterations and change < schedule.stable_fraction * kept:
            break
    support = pattern.weight_mask(W_hat)
    return W_hat * support, support, trace


def pcg_on_support(H: Tensor, W: Tensor, start: Tensor, keep: Tensor, *, max_iterations: int = 10,
                   rtol: float = 1e-4) -> Tensor:
    """Minimise E over the weights kept by ``keep`` (the others stay zero) by conjugate gradient
    with the diagonal (Jacobi) preconditioner diag(H)⁻¹, one system per output row, all rows at once
    (the paper's Algorithm 2): solve (ŴH)_S = (WH)_S from ``start`` (zero outside ``keep``). Stops
    after ``max_iterations`` or when every row's residual norm is at most ``rtol`` times its
    right-hand side's."""
    H, keep = H.float(), keep.to(torch.bool)
    mask = keep.float()
    rhs = (W.float() @ H) * mask
    X = start.float() * mask
    R = rhs - (X @ H) * mask
    inverse_diagonal = 1.0 / torch.diagonal(H)
    Z = R * inverse_diagonal
    P = Z.clone()
    rz = (R * Z).sum(dim=1)
    bound = rtol * rhs.norm(dim=1)
    for _ in range(max_iterations):
        if bool((R.norm(dim=1) <= bound).all()):
            break
        AP = (P @ H) * mask
        curvature = (P * AP).sum(dim=1)
        alpha = torch.where(curvature > 0, rz / curvature.clamp_min(1e-30), torch.zeros_like(rz))
        X.addcmul_(alpha[:, None], P)
        R.addcmul_(alpha[:, None], AP, value=-1.0)
        Z = R * inverse_diagonal
        rz_new = (R * Z).sum(dim=1)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(1e-30), torch.zeros_like(rz))
        P = Z + beta[:, None] * P
        rz = rz_new
    return X
