"""How flat a loss is around trained weights (the half of SAFE's claim that is not sparsity: SAM
seeks x where f(x + ε) stays low for every small ε, Eq. 2):

* :func:`perturbed_loss_increase`: the mean of f(x + ε) − f(x) over random directions ε of a fixed
  norm relative to the weights, ‖ε_t‖ = r·‖x_t‖ per tensor, drawn in antithetic pairs (ε, −ε) so
  the first-order term cancels exactly and the mean is the curvature term ½ εᵀ∇²f ε + O(r⁴);
* :func:`top_hessian_eigenvalue`: the largest eigenvalue of ∇²f by power iteration on
  Hessian-vector products (double backward).

Both restrict the directions to ``masks`` (the kept entries of a pruned weight, True = kept)
where given: the flatness of the sparse model as it is deployed, its zeros held at zero.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor


def _directions(params: Sequence[Tensor], masks: Dict[Tensor, Tensor], generator: torch.Generator) -> List[Tensor]:
    """A Gaussian direction per tensor, zero outside its mask."""
    out = []
    for p in params:
        d = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device)
        keep = masks.get(p)
        out.append(d if keep is None else d * keep)
    return out


@torch.no_grad()
def perturbed_loss_increase(loss: Callable[[], Tensor], params: Sequence[Tensor], *, relative_norm: float,
                            pairs: int = 8, seed: int = 0,
                            masks: Optional[Dict[Tensor, Tensor]] = None) -> Dict[str, float]:
    """Mean f(x + ε) − f(x) over ``pairs`` antithetic pairs of random ε with ‖ε_t‖ = ``relative_norm``
    ·‖x_t‖ for each tensor x_t of ``params`` (its kept entries where ``masks`` gives them); ``loss()``
    evaluates f at the current values. The weights come back exactly. Returns the base loss, the
    mean increase, its standard error over pairs and the increase relative to the base loss."""
    if not relative_norm > 0:
        raise ValueError(f"relative_norm must be > 0; got {relative_norm!r}")
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1; got {pairs!r}")
    masks = masks or {}
    generator = torch.Generator().manual_seed(seed)
    saved = [p.detach().clone() for p in params]
    base = float(loss())
    increases = []
    try:
        for _ in range(pairs):
            directions = _directions(params, masks, generator)
            for d, x in zip(directions, saved):
                norm = d.norm()
                d.mul_(relative_norm * x.float().norm() / norm if norm > 0 else 0.0)
            pair = []
            for sign in (1.0, -1.0):
                for p, x, d in zip(params, saved, directions):
                    p.copy_((x.float() + sign * d).to(p.dtype))
                pair.append(float(loss()) - base)
            increases.append(sum(pair) / 2)
    finally:
        for p, x in zip(params, saved):
            p.copy_(x)
    values = torch.tensor(increases, dtype=torch.float64)
    mean = float(values.mean())
    stderr = float(values.std() / len(increases) ** 0.5) if len(increases) > 1 else float("nan")
    return {"loss": base, "increase": mean, "increase_stderr": stderr,
            "relative_increase": mean / base if base > 0 else float("nan")}


def top_hessian_eigenvalue(loss: Callable[[], Tensor], params: Sequence[Tensor], *, iterations: int = 20,
                           seed: int = 0, masks: Optional[Dict[Tensor, Tensor]] = None) -> float:
    """The largest-magnitude eigenvalue of ∇²f over ``params`` (restricted to ``masks``' kept
    entries where given) by ``iterations`` steps of power iteration v ← Hv/‖Hv‖ from a seeded
    Gaussian v, Hv by double backward through ``loss()`` (the params must require grad);
    returns the Rayleigh quotient vᵀHv of the last v."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1; got {iterations!r}")
    masks = masks or {}
    params = list(params)
    with torch.enable_grad():
        grads = torch.autograd.grad(loss(), params, create_graph=True)
    vector = _directions(params, masks, torch.Generator().manual_seed(seed))
    eigenvalue = 0.0
    for _ in range(iterations):
        norm = torch.sqrt(sum(v.square().sum() for v in vector))
        vector = [v / norm for v in vector]
        with torch.enable_grad():
            products = torch.autograd.grad(grads, params, grad_outputs=[v.to(p.dtype) for v, p in zip(vector, params)],
                                           retain_graph=True)
        products = [hv.float() * masks[p] if p in masks else hv.float() for hv, p in zip(products, params)]
        eigenvalue = float(sum((v * hv).sum() for v, hv in zip(vector, products)))
        vector = products
    return eigenvalue
