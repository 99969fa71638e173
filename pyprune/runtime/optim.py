"""SAFE as a ``torch.optim`` optimiser: prune any model while it trains (Lee et al., SAFE,
Algorithm 1; spec §1.4–1.9).

ADMM on min_{x∈C} max_{‖ε‖≤ρ} f(x+ε) with the split x = z, z ∈ C (the sparsity pattern):

* before the first step, z₀ = proj_C(x₀) and u₀ = 0 (Algorithm 1, lines 1–2; :meth:`SafeOptimizer.initialise`),
  or with ``dual_init="box"`` u₀ = x₀ − z₀ (the printed box's u-step run at t = 0);
* after steps K, 2K, … (K = ``dual_interval``), z-step and u-step: z = proj_C(x + u), u ← u + x − z
  (:func:`pyprune.ops.admm_dual_update_` on the compact state v = x + u, keep = support of z);
* every step, the x-step of Eq. (5) with Adam as the base optimiser (:func:`~pyprune.ops.sam_perturb_`
  then :func:`~pyprune.ops.sam_adam_step_`), the penalty λ(x − z + u) taken at the unperturbed x
  either as Algorithm 1 writes it, a gradient step of its own after the base optimiser's step on
  ∇f(x + ρ∇f/‖∇f‖) (lines 12–13; ``penalty="decoupled"``: x ← x_Adam − ηλ(x − z + u), which closes
  the fraction ηλ of the distance to z − u every step whatever the scale of f or of the weights),
  or added to the gradient before Adam's moments (``penalty="adam"``, the authors' code: only the
  ratio λ|x − z + u| : |∇f| matters, and once the penalty dominates Adam moves a weight by about η
  per step whatever λ is, spec §1.8);
* at the end, :meth:`SafeOptimizer.project_` (Algorithm 1, line 15) makes the weights sparse.

The penalty λ is constant (``lam_schedule="constant"``, the paper's LLM setting) or ramped from 0
to ``lam`` along a half cosine over ``lam_steps`` steps (``"cosine"``: λ_t = λ·(1 − cos(π·t/T))/2 at
step t = 1 … T, λ after T; the paper's "cosine warmup" penalty schedule, App. B, which "applies less
restriction in the initial phases of training"), so that x can leave z₀ before the penalty binds.

SAFE projects by |v|; SAFE⁺ by sqrt(P)·|v| with a diagonal P given per weight as
``importance={weight: act_sqnorm}`` (P = diag(AᵀA), Wanda's statistic, §1.6.2).

Both optimisers here also step parameters sharded by rows over the ranks
(:func:`pyprune.runtime.training.sharded_block`): each rank keeps the state of its rows and steps
them, and the norms over all parameters (SAM's ‖∇f‖, the residuals) are summed over the ranks.
A row-wise projection (N:M, or top-k per row) needs no other rank's rows.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..ops import reference
from ..patterns import NM, Pattern, Unstructured, parse
from .distributed import local, sharded, sum_shards_


_PENALTIES = ("adam", "decoupled")
_DUAL_INITS = ("zero", "box")
LAM_SCHEDULES = ("constant", "cosine")


def scheduled_lam(lam: float, schedule: str, step: int, steps: Optional[int]) -> float:
    """λ at step ``step`` (1-based) of ``schedule`` over ``steps`` steps (see the module docstring)."""
    if schedule == "constant" or step >= steps:
        return lam
    return lam * (1.0 - math.cos(math.pi * step / steps)) / 2.0


def _selection(pattern: Pattern) -> Dict:
    if isinstance(pattern, NM):
        return {"n": pattern.n, "m": pattern.m}
    return {"sparsity": pattern.sparsity, "scope": pattern.scope or "row"}


class SafeOptimizer(torch.optim.Optimizer):
    """SAFE / SAFE⁺ (Algorithm 1) with Adam as the base optimiser.

    ``step(closure)`` needs a closure that computes the loss and calls ``backward()`` (it runs
    twice: at x and at the SAM point x + ε). Parameter groups may set their own ``pattern``
    (None: the group trains with SAM-Adam and is not constrained, e.g. biases); the constrained
    weights must be 2-D [out, in] (N:M groups and rows along the last dim). ``lr`` may be changed
    by any ``torch.optim.lr_scheduler``.

    ``residuals`` holds ‖x − z‖ / ‖x‖ over the constrained weights at the initial projection, then
    at each dual update (it shrinks as x reaches the constraint set); ``grad_norms`` the ‖∇f‖ of
    each step; ``step_norms`` the norm of each step's Adam move over all its parameters (from x⁽ᵗ⁾,
    before the decoupled penalty's own step; to set against the SAM ascent ‖ε‖ = ρ).
    """

    def __init__(self, params: Iterable, pattern, *, lr: float = 2e-4, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, rho: float = 2e-4, lam: float = 1e-3, dual_interval: int = 32,
                 importance: Optional[Dict[Tensor, Tensor]] = None, penalty: str = "adam",
                 dual_init: str = "zero", lam_schedule: str = "constant", lam_steps: Optional[int] = None):
        if penalty not in _PENALTIES:
            raise ValueError(f"penalty must be one of {', '.join(_PENALTIES)}; got {penalty!r}")
        if dual_init not in _DUAL_INITS:
            raise ValueError(f"dual_init must be one of {', '.join(_DUAL_INITS)}; got {dual_init!r}")
        if lam_schedule not in LAM_SCHEDULES:
            raise ValueError(f"lam_schedule must be one of {', '.join(LAM_SCHEDULES)}; got {lam_schedule!r}")
        if lam_schedule != "constant" and not (isinstance(lam_steps, int) and lam_steps >= 1):
            raise ValueError(f"lam_steps must be an integer >= 1 with lam_schedule={lam_schedule!r}; got {lam_steps!r}")
        if not (isinstance(dual_interval, int) and dual_interval >= 1):
            raise ValueError(f"dual_interval must be an integer >= 1; got {dual_interval!r}")
        for name, value in (("lr", lr), ("rho", rho), ("lam", lam), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                      and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
        if penalty == "decoupled" and lr * lam > 1:
            raise ValueError(f"lr * lam must be <= 1 with penalty='decoupled' (each step moves x by that fraction "
                             f"of its distance to z - u); got lr={lr!r}, lam={lam!r}")
        pattern = None if pattern is None else parse(pattern)
        if pattern is not None and not isinstance(pattern, (Unstructured, NM)):
            raise ValueError(f"pattern must be an unstructured sparsity or N:M; got {pattern}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, pattern=pattern)
        super().__init__(params, defaults)
        self.rho, self.lam, self.dual_interval = float(rho), float(lam), dual_interval
        self.importance = dict(importance or {})
        for group in self.param_groups:
            if group["pattern"] is not None:
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError("the constrained parameters must be 2-D weights [out, in]; got shape "
                                         f"{tuple(p.shape)} (put it in a group with pattern=None)")
        self.decoupled = penalty == "decoupled"
        self.lam_schedule, self.lam_steps = lam_schedule, lam_steps
        self.dual_init = dual_init
        self.steps_done = 0
        self.initialised = False
        self.residuals: List[float] = []
        self.grad_norms: List[float] = []
        self.step_norms: List[float] = []

    def _constrained(self):
        for group in self.param_groups:
            if group["pattern"] is not None:
                for p in group["params"]:
                    yield group["pattern"], p

    def _state(self, p: Tensor) -> Dict:
        """The state of ``p``'s entries on this rank (all of them unless it is sharded)."""
        state = self.state[p]
        if "v" not in state:
            rows = local(p)
            state["v"] = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            state["keep"] = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
            state["exp_avg"] = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            state["exp_avg_sq"] = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            state["anchor"] = torch.empty_like(rows, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def dual_update(self) -> float:
        """z- and u-step on every constrained weight; returns (and records) ‖x − z‖ / ‖x‖."""
        sums, last = torch.zeros(2, dtype=torch.float64), None  # ‖x − z‖², ‖x‖²
        for pattern, p in self._constrained():
            state, last = self._state(p), p
            sums[0] += float(ops.admm_dual_update_(state["v"], state["keep"], local(p),
                                                   act_sqnorm=self.importance.get(p), **_selection(pattern)))
            sums[1] += float(local(p).float().square().sum())
        if last is not None:
            sum_shards_(sums, last)
        residual, total = sums.tolist()
        relative = math.sqrt(residual / total) if total > 0 else 0.0
        self.residuals.append(relative)
        return relative

    @torch.no_grad()
    def initialise(self) -> float:
        """z₀ = proj(x₀), u₀ = 0 (Algorithm 1, lines 1–2): the z-step alone on the current weights,
        whatever the state held; with ``dual_init="box"`` the u-step too, u₀ = x₀ − z₀ (the printed
        box runs it at t = 0). Returns (and records) ‖x − z₀‖ / ‖x‖. :meth:`step` calls it once
        before the first step."""
        for _, p in self._constrained():
            state = self._state(p)
            state["v"].zero_()
            state["keep"].zero_()
        residual = self.dual_update()  # from u = 0: v = x₀, keep = the support of z₀ = proj(x₀), u = x₀ − z₀
        if self.dual_init == "zero":
            for _, p in self._constrained():
                state = self.state[p]
                state["v"].mul_(state["keep"])  # v = z₀, so u = v⊙¬keep = 0
        self.initialised = True
        return residual

    def current_lam(self) -> float:
        """The penalty λ of the step counted last (``steps_done``; see ``lam_schedule``)."""
        return scheduled_lam(self.lam, self.lam_schedule, self.steps_done, self.lam_steps)

    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        """One SAFE iteration (SAM gradient, penalised Adam step, then the dual update after every
        K-th step); returns the loss at the unperturbed weights."""
        if closure is None:
            raise ValueError("SafeOptimizer.step needs a closure that computes the loss and calls backward()")
        if not self.initialised:
            self.initialise()
        self.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            raise RuntimeError("SafeOptimizer.step: the closure produced no gradient for any parameter")
        states = [self._state(p) for p in params]
        with torch.no_grad():
            norm = self._perturb(params, states)
        self.grad_norms.append(float(norm))
        self.zero_grad(set_to_none=True)
        with torch.enable_grad():
            closure()
        self.steps_done += 1
        lam = self.current_lam()
        moved = 0.0
        with torch.no_grad():
            with_grad = {id(p) for p in params}
            for group in self.param_groups:
                members = [(p, self.state[p]) for p in group["params"] if id(p) in with_grad]
                if not members:
                    continue
                grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p, _ in members]
                ops.sam_adam_step_([local(p) for p, _ in members], grads, [s["anchor"] for _, s in members],
                                   [s["v"] for _, s in members], [s["keep"] for _, s in members],
                                   [s["exp_avg"] for _, s in members], [s["exp_avg_sq"] for _, s in members],
                                   lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                   weight_decay=group["weight_decay"],
                                   lam=lam if group["pattern"] is not None and not self.decoupled else 0.0,
                                   step=self.steps_done)
                moved += sum(float((local(p).float() - s["anchor"].float()).square().sum()) for p, s in members)
                if group["pattern"] is not None and self.decoupled:  # Algorithm 1, line 13, at x⁽ᵗ⁾ = the anchor
                    for p, state in members:
                        gap = reference.admm_gap(state["anchor"], state["v"], state["keep"])
                        local(p).sub_((group["lr"] * lam * gap).to(p.dtype))
        self.step_norms.append(math.sqrt(float(sum_shards_(torch.tensor([moved], dtype=torch.float64), params[0]))))
        if self.steps_done % self.dual_interval == 0:
            self.dual_update()
        return loss

    def _perturb(self, params: List[Tensor], states: List[Dict]) -> Tensor:
        """The SAM ascent of every parameter with a gradient (:func:`pyprune.ops.sam_perturb_`);
        returns ‖∇f‖. The kernel normalises by the norm of the gradients it is given: on rows sharded
        over the ranks, this rank's ‖g_r‖, so it gets ρ·‖g_r‖/‖g‖ for its step ρ·g_r/‖g‖, with ‖g‖
        summed over the ranks."""
        grads = [local(p.grad) for p in params]
        rows, anchors = [local(p) for p in params], [s["anchor"] for s in states]
        if not sharded(params[0]):
            return ops.sam_perturb_(rows, grads, anchors, self.rho)
        squares = torch.stack([g.double().square().sum() for g in grads]).sum().reshape(1)
        mine = float(squares)
        norm = math.sqrt(float(sum_shards_(squares, params[0])))
        ops.sam_perturb_(rows, grads, anchors, self.rho * math.sqrt(mine) / norm if norm > 0 else 0.0)
        return torch.tensor(norm, dtype=torch.float32)

    def state_dict(self) -> Dict:
        """torch's optimiser state dict with the per-parameter state (v, keep, moments; kept in
        their own dtypes, which torch's loader would cast to the parameter's), the step count and
        the diagnostics, so a loaded optimiser resumes exactly (the importance is given again)."""
        state = super().state_dict()
        state["safe"] = {"state": state.pop("state"), "steps_done": self.steps_done,
                         "initialised": self.initialised, "residuals": list(self.residuals),
                         "grad_norms": list(self.grad_norms), "step_norms": list(self.step_norms)}
        state["state"] = {}
        return state

    def load_state_dict(self, state_dict: Dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("safe")
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            if i in extra["state"]:
                self.state[p] = {key: value.clone().to(p.device) for key, value in extra["state"][i].items()}
        self.steps_done, self.initialised = extra["steps_done"], extra["initialised"]
        self.residuals, self.grad_norms = list(extra["residuals"]), list(extra["grad_norms"])
        self.step_norms = list(extra.get("step_norms", []))

    @torch.no_grad()
    def masks(self, metric: str = "same") -> Dict[Tensor, Tensor]:
        """The keep mask of each constrained weight's projection (Algorithm 1, line 15): scored as
        in the z-step (``"same"``: sqrt(P)·|x| where an importance is given) or by |x|
        (``"euclidean"``, the line as printed)."""
        if metric not in ("same", "euclidean"):
            raise ValueError(f"metric must be 'same' or 'euclidean'; got {metric!r}")
        masks = {}
        for pattern, p in self._constrained():
            act = self.importance.get(p) if metric == "same" else None
            masks[p] = pattern.weight_mask(local(p), act)  # row-wise: a sharded weight's rows alone
        return masks

    @torch.no_grad()
    def project_(self, metric: str = "same") -> None:
        """Zero every constrained weight outside its projection's support (Algorithm 1, line 15)."""
        for p, keep in self.masks(metric).items():
            local(p).mul_(keep.to(p.dtype))


class MaskedAdam(torch.optim.Adam):
    """Adam on the kept entries of masked weights only: each step multiplies every masked
    parameter's gradient by its keep mask (``masks={weight: keep}``, bool of the weight's shape;
    of its rows on this rank for a weight sharded over the ranks) before Adam's moments, so a
    pruned entry keeps zero moments and an Adam step of exactly 0 (a weight that is 0 stays
    exactly 0), and the kept entries train as plain Adam. ``step`` takes the
    closure :func:`pyprune.runtime.training.train_block` gives (it runs once) and returns its loss."""

    def __init__(self, params: Iterable, masks: Dict[Tensor, Tensor], **adam):
        super().__init__(params, **adam)
        known = {id(p) for group in self.param_groups for p in group["params"]}
        for p, keep in masks.items():
            if id(p) not in known or keep.shape != local(p).shape or keep.dtype != torch.bool:
                raise ValueError("masks must map parameters of this optimiser to bool keep masks of their shape; "
                                 f"got a mask of shape {tuple(keep.shape)} and dtype {keep.dtype} for a parameter "
                                 f"of shape {tuple(p.shape)}")
        self.masks = dict(masks)

    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        if closure is None:
            raise ValueError("MaskedAdam.step needs a closure that computes the loss and calls backward()")
        with torch.enable_grad():
            loss = closure()
        with torch.no_grad():
            for p, keep in self.masks.items():
                if p.grad is not None:
                    local(p.grad).mul_(keep)
        super().step()
        return loss
