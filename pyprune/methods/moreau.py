"""MoreauPruner, MoreauPruner-GS (Wang et al., "MoreauPruner: Robust Pruning of Large Language
Models against Weight Perturbations") and their SmoothGrad baseline.

All three are LLM-Pruner with another gradient in the first-order score |∇ ⊙ w| (Eq. 3); the
grouping, selection and compaction are :mod:`pyprune.methods.structured`'s.

MoreauGrad (Algorithm 1, written for the displacement δ = v − w, δ₀ = 0; spec §1.6):

    g_t   = (1/m) Σᵢ ∇L(w + δ_t + εᵢ),  εᵢ ~ N(0, σ²), σ = noise_std·|w| element-wise
    δ_t+1 = (1 − γ/ρ)·δ_t − γ·g_t                        (step 5)
    δ_t+1 ← GST_γη(δ_t+1)                                 (step 7, MoreauPruner-GS only)

for T steps (the printed loop "for t = 0..T" is read as T updates), then the score per element is
|δ_T ⊙ w| / ρ (Eq. 9 / 11; MG = δ/ρ up to a sign that |·| removes). GST is the proximal operator
of η‖·‖₂,₁ (Eq. 8), one group per output channel (row) by default.

The authors' released code (``moreauprune.py``; spec Appendix X) runs another loop; each of its
differences is an option, the paper's reading the default: ``decay=False`` (its proximal term
carries no gradient, so δ ← δ − γ·g), ``average_last=5`` (it scores the mean δ of the last 5 of
10 steps), ``operator="released"`` (-GS: :func:`released_shrink_`, per-row RMS and 1 − η/RMS in
place of GST_γη) and ``smooth="all"`` (noise and δ on every parameter, norms and embeddings too;
only the pruned layers' δ is scored).

δ is fp32 whatever the model's dtype and never goes through ``.grad``. Each step is one fused op
(:func:`pyprune.ops.moreau_step_`): the update, the group norms and soft-threshold, and the next
noisy weights (counter-based Philox noise, never stored) written into the parameter. Memory per
pruned parameter beyond the model: the original weights, δ (fp32) and the one gradient buffer.

SmoothGrad (spec §1.11): K noisy passes with the same noise, averaging either the gradients
(``average="gradients"``, the v1 paper: |E[∇L(w+ε)] ⊙ w|) or the importance scores
(``average="scores"``, the v2 paper: E|∇L(w+ε) ⊙ w|).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import ops
from .options import at_least_one, nonnegative, option, positive
from .structured import StructuredMethod, gradients_for

_GROUPS = {"rows": 0, "columns": 1}
_AVERAGES = ("gradients", "scores")
_OPERATORS = ("gst", "released")
_SMOOTHED = ("pruned", "all")
_SEED_STRIDE = 1_000_003  # distinct Philox keys per (seed, step, draw, tensor)


def _matrix(t: Tensor) -> Tensor:
    """A 2-D view for the fused ops: weights as they are, a bias as [n, 1] (each entry its own
    group)."""
    return t if t.dim() == 2 else t.reshape(-1, 1)


def _noise_seed(seed: int, draw: int, index: int, count: int) -> int:
    """The Philox key of tensor ``index`` (of ``count``) in noise draw number ``draw``."""
    return (seed * _SEED_STRIDE + draw) * count + index


def released_shrink_(delta: Tensor, *, eta: float, threshold: float, group_dim: int = 0) -> Tensor:
    """The released code's "group soft-threshold", in place on a 2-D ``delta`` (groups along
    ``group_dim``, as :func:`pyprune.ops.group_soft_threshold`): with r_g = RMS(δ_g) = ‖δ_g‖₂/√n,
    a group with r_g ≤ ``threshold`` (there γη) is zeroed and the others are scaled by 1 − η/r_g.
    Unlike GST_γη (Eq. 8, scale 1 − γη/‖δ_g‖₂) the factor uses η and the RMS, so it is negative for
    threshold < r_g < η: such a group flips sign and leaves with RMS |r_g − η|. Returns ``delta``."""
    rms = delta.square().mean(dim=1 - group_dim, keepdim=True).sqrt_()
    kept = rms > threshold
    scale = torch.where(kept, 1.0 - eta / torch.where(kept, rms, torch.ones_like(rms)), torch.zeros_like(rms))
    return delta.mul_(scale)


def moreau_displacements(params: Sequence[nn.Parameter], gradient: Callable[[], None], *, rho: float,
                         gamma: float, steps: int, eta: float = 0.0, group_dim: int = 0,
                         noise_std: float = 0.05, draws: int = 1, seed: int = 0, decay: bool = True,
                         operator: str = "gst", average_last: int = 1,
                         progress: bool = False, desc: str = "moreau") -> List[Tensor]:
    """δ_T of Algorithm 1 for each of ``params`` (fp32, the parameter's shape); with
    ``average_last`` N > 1 the mean of δ over the last N steps instead.

    ``gradient()`` must return ∇L at the parameters' current values, one tensor per parameter (it
    is called ``steps·draws`` times, with the noisy weights in place; the tensors it returns are
    summed over the draws in place). ``decay=False`` drops the factor 1 − γ/ρ; ``operator``
    "released" applies :func:`released_shrink_` (threshold γη) after each step in place of GST_γη.
    The parameters hold their original values again on return, with ``.grad`` cleared, also after
    an error.
    """
    if operator not in _OPERATORS:
        raise ValueError(f"operator must be one of {', '.join(_OPERATORS)}; got {operator!r}")
    if not 1 <= average_last <= steps:
        raise ValueError(f"average_last must be in 1..steps ({steps}); got {average_last}")
    originals = [_matrix(p.detach()).clone() for p in params]
    deltas = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in originals]
    sums = [torch.zeros_like(d) for d in deltas] if average_last > 1 else None
    fused = operator == "gst"  # GST runs inside the fused step; the released operator after it
    count = len(params)

    def perturb(draw: int) -> None:
        for i, (p, w, d) in enumerate(zip(params, originals, deltas)):
            ops.moreau_perturb_(_matrix(p.data), w, d, noise_ratio=noise_std,
                                seed=_noise_seed(seed, draw, i, count))

    try:
        perturb(0)
        for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
            grads = gradient()
            for draw in range(1, draws):
                perturb(step * draws + draw)
                for total, grad in zip(grads, gradient()):
                    total.add_(grad)  # the m draws' gradients add up; γ/m averages them
            last = step == steps - 1
            for i, (p, w, d, grad) in enumerate(zip(params, originals, deltas, grads)):
                next_seed = _noise_seed(seed, (step + 1) * draws, i, count)
                ops.moreau_step_(d, _matrix(grad), w, None if last or not fused else _matrix(p.data),
                                 decay=1.0 - gamma / rho if decay else 1.0, step_size=gamma / draws,
                                 threshold=gamma * eta if fused else 0.0, group_dim=group_dim,
                                 noise_ratio=noise_std, seed=next_seed)
                if not fused:
                    released_shrink_(d, eta=eta, threshold=gamma * eta, group_dim=group_dim)
                    if not last:
                        ops.moreau_perturb_(_matrix(p.data), w, d, noise_ratio=noise_std, seed=next_seed)
                if sums is not None and step >= steps - average_last:
                    sums[i].add_(d)
    finally:
        with torch.no_grad():
            for p, w in zip(params, originals):
                _matrix(p.data).copy_(w)
                p.grad = None
    if sums is not None:
        deltas = [total.div_(average_last) for total in sums]
    return [d.reshape(p.shape) for p, d in zip(params, deltas)]


def smoothed_scores(params: Sequence[nn.Parameter], gradient: Callable[[], None], *, passes: int,
                    noise_std: float = 0.05, average: str = "scores", seed: int = 0,
                    progress: bool = False, desc: str = "smoothgrad") -> List[Tensor]:
    """SmoothGrad importance (fp32, per element) of each of ``params`` over ``passes`` noisy
    gradients (see the module docstring for ``average``); ``gradient()`` as in
    :func:`moreau_displacements`. The parameters are restored on return."""
    if average not in _AVERAGES:
        raise ValueError(f"average must be one of {', '.join(_AVERAGES)}; got {average!r}")
    originals = [_matrix(p.detach()).clone() for p in params]
    zeros = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in originals]
    sums = [torch.zeros_like(z) for z in zeros]
    count = len(params)
    try:
        for k in tqdm(range(passes), desc=desc, unit="pass", disable=not progress):
            for i, (p, w, z) in enumerate(zip(params, originals, zeros)):
                ops.moreau_perturb_(_matrix(p.data), w, z, noise_ratio=noise_std,
                                    seed=_noise_seed(seed, k, i, count))
            for w, total, grad in zip(originals, sums, gradient()):
                grad = _matrix(grad)
                total.add_(grad.float() if average == "gradients" else ops.taylor_score(w, grad))
    finally:
        with torch.no_grad():
            for p, w in zip(params, originals):
                _matrix(p.data).copy_(w)
                p.grad = None
    if average == "gradients":
        scores = [ops.taylor_score(w, total / passes) for w, total in zip(originals, sums)]
    else:
        scores = [total / passes for total in sums]
    return [s.reshape(p.shape) for p, s in zip(params, scores)]


def _noise_std_option() -> Any:
    return option(0.05, "Moreau/SmoothGrad: noise σ as a fraction of |w| per element (paper: 0.05)", nonnegative)


def _noise_seed_option() -> Any:
    return option(0, "Moreau/SmoothGrad: seed of the Philox noise", nonnegative)


def _rho_option(default: float) -> Any:
    return option(default, "Moreau: envelope parameter ρ", positive)


def _gamma_option(default: float) -> Any:
    return option(default, "Moreau: step size γ (< ρ)", positive)


def moreau_diagnostics(weights: Sequence[Tensor], deltas: Sequence[Tensor], *, rho: float, gamma: float,
                       steps: int, eta: float, group_dim: int, noise_std: float, decay: bool = True,
                       operator: str = "gst") -> Dict[str, Optional[float]]:
    """Whether the Moreau part of Algorithm 1 acts, from δ_T and the original weights:

    * ``delta_to_noise``: ‖δ_T‖ / ‖σ|w|‖ over all pruned parameters (None without noise);
    * ``decay_per_step`` 1 − γ/ρ (1 with ``decay`` off) and ``decay`` (1 − γ/ρ)^T: near 1,
      δ_T ≈ −γ Σ_t g_t, a plain sum of the noisy gradients (the envelope's pull back to w barely acts);
    * with a group threshold γη > 0 and ``operator`` "gst" (MoreauPruner-GS), over all groups (rows or columns) of the
      last step's GST: ``gs_zeroed``, the fraction set to zero; ``gs_shrunk_1pct``, the fraction
      shrunk by more than 1% (γη > 0.01·‖pre-threshold row‖, zeroed included); ``gs_shrink_median``,
      the median of γη / ‖pre-threshold row‖ (rows with ‖δ_g‖ > 0 had ‖δ_g‖ + γη before GST).
    """
    delta_sq = sum(float(d.double().square().sum()) for d in deltas)
    weight_sq = sum(float(w.double().square().sum()) for w in weights)
    decay = 1.0 - gamma / rho if decay else 1.0
    report: Dict[str, Optional[float]] = {
        "delta_to_noise": delta_sq ** 0.5 / (noise_std * weight_sq ** 0.5) if noise_std > 0 and weight_sq > 0
        else None,
        "decay_per_step": decay,
        "decay": decay ** steps,
    }
    threshold = gamma * eta
    if threshold > 0 and operator == "gst":
        norms = torch.cat([_matrix(d).double().norm(dim=1 - group_dim) for d in deltas])
        shrink = torch.where(norms > 0, threshold / (norms + threshold), torch.ones_like(norms))
        report.update(gs_zeroed=float((norms == 0).double().mean()),
                      gs_shrunk_1pct=float((shrink > 0.01).double().mean()),
                      gs_shrink_median=float(shrink[norms > 0].quantile(0.5)) if bool((norms > 0).any()) else None)
    return report


class MoreauPruner(StructuredMethod):
    """MoreauPruner: structured pruning by |MoreauGrad ⊙ w| (Algorithm 1 without step 7)."""

    name = "moreau"
    rho: float = _rho_option(0.05)
    gamma: float = _gamma_option(1e-3)
    steps: int = option(10, "Moreau: optimisation length T (paper: 10)", at_least_one)
    noise_draws: int = option(1, "Moreau: noise vectors m averaged per step (Algorithm 1's m; the paper gives "
                              "no value, default 1)", at_least_one)
    noise_std: float = _noise_std_option()
    noise_seed: int = _noise_seed_option()
    decay: bool = option(True, "Moreau: contract δ by 1 - γ/ρ each step (Algorithm 1 step 5); false: δ ← δ - γg, "
                         "what the released code runs (its proximal term carries no gradient)")
    average_last: int = option(1, "Moreau: score the mean δ of the last N steps (1: δ_T, Algorithm 1; the "
                               "released code: 5)", at_least_one)
    smooth: str = option("pruned", "Moreau: the parameters perturbed and optimised: the pruned layers' (the "
                         "scored ones) or every parameter, norms and embeddings too (the released code)",
                         choices=_SMOOTHED)
    #: MoreauPruner-GS's options, fixed: no group threshold
    eta, group, operator = 0.0, "rows", "gst"

    def check_options(self, settings):
        super().check_options(settings)
        if settings["gamma"] >= settings["rho"]:
            raise ValueError(f"option gamma of method {self.name!r} must be < rho (each step scales δ by "
                             f"1 - gamma/rho); got gamma={settings['gamma']}, rho={settings['rho']}")
        if settings["average_last"] > settings["steps"]:
            raise ValueError(f"option average_last of method {self.name!r} must be <= steps; got "
                             f"average_last={settings['average_last']}, steps={settings['steps']}")

    def element_scores(self, model, params, calib, *, batch_size, progress) -> Dict[int, Tensor]:
        smoothed = list(params)
        if self.smooth == "all":
            pruned = {id(p) for p in params}
            smoothed += [p for p in model.parameters() if p.is_floating_point() and id(p) not in pruned]
        with gradients_for(model, smoothed):
            deltas = moreau_displacements(
                smoothed, lambda: self.calibration_gradients(model, smoothed, calib, batch_size=batch_size),
                rho=self.rho, gamma=self.gamma, steps=self.steps, eta=self.eta, group_dim=_GROUPS[self.group],
                noise_std=self.noise_std, draws=self.noise_draws, seed=self.noise_seed, decay=self.decay,
                operator=self.operator, average_last=self.average_last, progress=progress,
                desc=self.name)[:len(params)]
        self.diagnostics = moreau_diagnostics(
            [p.detach() for p in params], deltas, rho=self.rho, gamma=self.gamma, steps=self.steps, eta=self.eta,
            group_dim=_GROUPS[self.group], noise_std=self.noise_std, decay=self.decay, operator=self.operator)
        return {id(p): (d * p.detach().float()).abs_().div_(self.rho) for p, d in zip(params, deltas)}

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        self.diagnostics = None
        return super()._prune(model, pattern, calib, batch_size=batch_size, progress=progress)

    def scoring_details(self):
        """The loss scale and, when it scored, ``moreau``: :func:`moreau_diagnostics` of δ_T."""
        details = super().scoring_details()
        if self.diagnostics is not None:
            details["moreau"] = self.diagnostics
        return details


class MoreauPrunerGS(MoreauPruner):
    """MoreauPruner-GS: MoreauGrad with the group-sparse prox η‖δ‖₂,₁ (Algorithm 1 with step 7)."""

    name = "moreau-gs"
    rho: float = _rho_option(0.2)
    gamma: float = _gamma_option(2e-4)
    eta: float = option(5e-6, "Moreau-GS: group-sparsity η; the threshold is γ·η (paper: 5e-6)", nonnegative)
    group: str = option("rows", "Moreau-GS: the ℓ2,1 groups: rows (output channels) or columns (input channels)",
                        choices=tuple(_GROUPS))
    operator: str = option("gst", "Moreau-GS: the group prox: gst (GST_γη, Eq. 8) or released (the released "
                           "code's: rows with RMS ≤ γη zeroed, the others scaled by 1 - η/RMS)", choices=_OPERATORS)

    def moe_refusal(self):
        """Its ℓ2,1 groups are rows or columns of 2-D weights: an MoE model's fused 3-D experts are refused."""
        return ("method 'moreau-gs' groups the rows or columns of 2-D weights; an MoE model's experts are fused 3-D "
                "parameters, not grouped yet (use moreau or taylor)")


class SmoothGrad(StructuredMethod):
    """SmoothGrad: LLM-Pruner with gradients (or scores) averaged over noisy weights."""

    name = "smoothgrad"
    passes: int = option(100, "SmoothGrad: noisy passes K (paper: 100)", at_least_one)
    average: str = option("scores", "SmoothGrad: average the importance scores (v2 paper) or the gradients "
                          "(v1 paper)", choices=_AVERAGES)
    noise_std: float = _noise_std_option()
    noise_seed: int = _noise_seed_option()

    def element_scores(self, model, params, calib, *, batch_size, progress) -> Dict[int, Tensor]:
        with gradients_for(model, params):
            scores = smoothed_scores(params,
                                     lambda: self.calibration_gradients(model, params, calib, batch_size=batch_size),
                                     passes=self.passes, noise_std=self.noise_std, average=self.average,
                                     seed=self.noise_seed, progress=progress, desc=self.name)
        return {id(p): s for p, s in zip(params, scores)}
