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

δ is fp32 whatever the model's dtype and never goes through ``.grad``. Each step is one fused op
(:func:`pyprune.ops.moreau_step_`): the update, the group norms and soft-threshold, and the next
noisy weights (counter-based Philox noise, never stored) written into the parameter. Memory per
pruned parameter beyond the model: the original weights, δ (fp32) and the one gradient buffer.

SmoothGrad (spec §1.11): K noisy passes with the same noise, averaging either the gradients
(``average="gradients"``, the v1 paper: |E[∇L(w+ε)] ⊙ w|) or the importance scores
(``average="scores"``, the v2 paper: E|∇L(w+ε) ⊙ w|).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import engine, ops
from .options import Option, at_least_one, nonnegative, positive
from .structured import StructuredMethod, gradients_for

_GROUPS = {"rows": 0, "columns": 1}
_AVERAGES = ("gradients", "scores")
_SEED_STRIDE = 1_000_003  # distinct Philox keys per (seed, step, draw, tensor)


def _matrix(t: Tensor) -> Tensor:
    """A 2-D view for the fused ops: weights as they are, a bias as [n, 1] (each entry its own
    group)."""
    return t if t.dim() == 2 else t.reshape(-1, 1)


def _noise_seed(seed: int, draw: int, index: int, count: int) -> int:
    """The Philox key of tensor ``index`` (of ``count``) in noise draw number ``draw``."""
    return (seed * _SEED_STRIDE + draw) * count + index


def moreau_displacements(params: Sequence[nn.Parameter], gradient: Callable[[], None], *, rho: float,
                         gamma: float, steps: int, eta: float = 0.0, group_dim: int = 0,
                         noise_std: float = 0.05, draws: int = 1, seed: int = 0,
                         progress: bool = False, desc: str = "moreau") -> List[Tensor]:
    """δ_T of Algorithm 1 for each of ``params`` (fp32, the parameter's shape).

    ``gradient()`` must add ∇L at the parameters' current values to their ``.grad`` (it is called
    ``steps·draws`` times, with the noisy weights in place). The parameters hold their original
    values again on return, with ``.grad`` cleared, also after an error.
    """
    originals = [_matrix(p.detach()).clone() for p in params]
    deltas = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in originals]
    count = len(params)

    def perturb(draw: int) -> None:
        for i, (p, w, d) in enumerate(zip(params, originals, deltas)):
            ops.moreau_perturb_(_matrix(p.data), w, d, noise_ratio=noise_std,
                                seed=_noise_seed(seed, draw, i, count))

    try:
        perturb(0)
        for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
            for p in params:
                p.grad = None
            for draw in range(draws):
                if draw > 0:
                    perturb(step * draws + draw)
                gradient()  # the m draws' gradients add up in .grad; γ/m averages them
            last = step == steps - 1
            for i, (p, w, d) in enumerate(zip(params, originals, deltas)):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                ops.moreau_step_(d, _matrix(grad), w, None if last else _matrix(p.data),
                                 decay=1.0 - gamma / rho, step_size=gamma / draws,
                                 threshold=gamma * eta, group_dim=group_dim, noise_ratio=noise_std,
                                 seed=_noise_seed(seed, (step + 1) * draws, i, count))
    finally:
        with torch.no_grad():
            for p, w in zip(params, originals):
                _matrix(p.data).copy_(w)
                p.grad = None
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
                p.grad = None
            gradient()
            for p, w, total in zip(params, originals, sums):
                grad = _matrix(p.grad) if p.grad is not None else torch.zeros_like(w)
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


def _noise_options(noise_default: float = 0.05) -> tuple:
    return (
        Option("noise_std", float, noise_default, "Moreau/SmoothGrad: noise σ as a fraction of |w| per "
               "element (paper: 0.05)", nonnegative),
        Option("noise_seed", int, 0, "Moreau/SmoothGrad: seed of the Philox noise", nonnegative),
    )


def _moreau_options(rho: float, gamma: float) -> tuple:
    return StructuredMethod.options + (
        Option("rho", float, rho, "Moreau: envelope parameter ρ", positive),
        Option("gamma", float, gamma, "Moreau: step size γ (< ρ)", positive),
        Option("steps", int, 10, "Moreau: optimisation length T (paper: 10)", at_least_one),
        Option("noise_draws", int, 1, "Moreau: noise vectors m averaged per step (Algorithm 1's m; the "
               "paper gives no value, default 1)", at_least_one),
    ) + _noise_options()


class _CalibrationGradient:
    """``gradient()`` for the noisy loops: adds ∇ of the mean next-token loss over the calibration
    tokens to ``.grad``."""

    def __init__(self, model: nn.Module, calib: Tensor, batch_size: int):
        self.model, self.calib, self.batch_size = model, calib, batch_size

    def __call__(self) -> None:
        engine.accumulate_gradients(self.model, self.calib, batch_size=self.batch_size, progress=False,
                                    zero_first=False)


class MoreauPruner(StructuredMethod):
    """MoreauPruner: structured pruning by |MoreauGrad ⊙ w| (Algorithm 1 without step 7)."""

    name = "moreau"
    options = _moreau_options(rho=0.05, gamma=1e-3)
    eta, group = 0.0, "rows"

    def check_options(self, settings):
        if settings["gamma"] >= settings["rho"]:
            raise ValueError(f"option gamma of method {self.name!r} must be < rho (each step scales δ by "
                             f"1 - gamma/rho); got gamma={settings['gamma']}, rho={settings['rho']}")

    def element_scores(self, model, params, calib, *, batch_size, progress) -> Dict[int, Tensor]:
        with gradients_for(model, params):
            deltas = moreau_displacements(
                params, _CalibrationGradient(model, calib, batch_size), rho=self.rho, gamma=self.gamma,
                steps=self.steps, eta=self.eta, group_dim=_GROUPS[self.group], noise_std=self.noise_std,
                draws=self.noise_draws, seed=self.noise_seed, progress=progress, desc=self.name)
        return {id(p): (d * p.detach().float()).abs_().div_(self.rho) for p, d in zip(params, deltas)}


class MoreauPrunerGS(MoreauPruner):
    """MoreauPruner-GS: MoreauGrad with the group-sparse prox η‖δ‖₂,₁ (Algorithm 1 with step 7)."""

    name = "moreau-gs"
    options = _moreau_options(rho=0.2, gamma=2e-4) + (
        Option("eta", float, 5e-6, "Moreau-GS: group-sparsity η; the threshold is γ·η (paper: 5e-6)",
               nonnegative),
        Option("group", str, "rows", "Moreau-GS: the ℓ2,1 groups: rows (output channels) or columns "
               "(input channels)", choices=tuple(_GROUPS)),
    )


class SmoothGrad(StructuredMethod):
    """SmoothGrad: LLM-Pruner with gradients (or scores) averaged over noisy weights."""

    name = "smoothgrad"
    options = StructuredMethod.options + (
        Option("passes", int, 100, "SmoothGrad: noisy passes K (paper: 100)", at_least_one),
        Option("average", str, "scores", "SmoothGrad: average the importance scores (v2 paper) or the "
               "gradients (v1 paper)", choices=_AVERAGES),
    ) + _noise_options()

    def element_scores(self, model, params, calib, *, batch_size, progress) -> Dict[int, Tensor]:
        with gradients_for(model, params):
            scores = smoothed_scores(params, _CalibrationGradient(model, calib, batch_size),
                                     passes=self.passes, noise_std=self.noise_std, average=self.average,
                                     seed=self.noise_seed, progress=progress, desc=self.name)
        return {id(p): s for p, s in zip(params, scores)}
