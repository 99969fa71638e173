"""ALPS (Meng, Behdin, Wang, Mazumder, 2024): one-shot pruning by ADMM on the layer-wise
reconstruction problem, then preconditioned conjugate gradient on the support it finds.

Per linear layer, from H = the mean of 2·x xᵀ over its calibration inputs (SparseGPT's statistic;
the solver is invariant to its scale): ridge λ = percdamp·mean(diag H), normalise to a unit
diagonal, run ADMM with ALPS's penalty schedule to choose the support, project, refit the kept
weights by PCG (:mod:`pyprune.runtime.layer_solver`). All linears of a block see the block's
inputs before any of them is pruned, and the next block sees the pruned block's outputs, as in
the authors' code. Unstructured masks are per tensor by default (the authors' projection keeps
the k largest of the whole layer); N:M groups run along the input dim.

The report's ``admm`` gives, over the layers pruned in this run, the mean ADMM iterations and the
mean relative layer error E(Ŵ)/E(0) of the projected ADMM iterate and after the PCG refit.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..nn.experts import expert_linears
from ..runtime import distributed, engine
from ..runtime.layer_solver import (AdmmSchedule, admm_support, normalise, pcg_on_support,
                                      reconstruction_error)
from .options import at_least_one, block_checkpoint, fraction, nonnegative, option, positive
from .sparsegpt import _Hessian, HessianMethod


class Alps(HessianMethod):
    name = "alps"
    default_scope = "tensor"

    rho: float = option(0.1, "ALPS: initial ADMM penalty ρ₀ on the normalised problem (authors' code: 0.1)", positive)
    admm_iterations: int = option(300, "ALPS: most ADMM iterations per layer (authors' code: 300)", at_least_one)
    rho_interval: int = option(3, "ALPS: ADMM iterations between penalty updates (authors' code: 3)", at_least_one)
    min_iterations: int = option(30, "ALPS: ADMM iterations before the support-stability stop (authors' code: 30)",
                                 nonnegative)
    pcg_iterations: int = option(10, "ALPS: most PCG iterations of the refit on the support (authors' code: 10)",
                                 nonnegative)
    pcg_rtol: float = option(1e-4, "ALPS: PCG stops when every row's residual is below this fraction of its "
                             "right-hand side (authors' code: 1e-4)", positive)
    percdamp: float = option(0.01, "ALPS: ridge added to XᵀX, a fraction of mean(diag XᵀX) (authors' code: 0.01)",
                             fraction)
    checkpoint: Optional[str] = block_checkpoint()

    def __init__(self, **values):
        super().__init__(**values)
        self._layer_reports = []

    def check_options(self, settings):
        if settings["min_iterations"] > settings["admm_iterations"]:
            raise ValueError(f"options of method 'alps' must have min_iterations <= admm_iterations (the stop on a "
                             f"stable support is checked from min_iterations on); got min_iterations="
                             f"{settings['min_iterations']}, admm_iterations={settings['admm_iterations']}")

    def working_bytes(self, block):
        """Every layer's float64 Hessian sum (all are filled in one pass over the block), and for the
        largest layer the float64 temporaries of its normalisation, its normalised copy, eigenvectors
        and (H + ρI)⁻¹ (32 bytes per entry of H in all), and six fp32 [out, in] matrices (W, WH, the
        iterate, v, masks and PCG's vectors)."""
        with expert_linears(block, strict=False):
            linears = list(engine.block_linears(block).values())
        hessians = sum(8 * linear.in_features ** 2 for linear in linears)
        return hessians + max(32 * linear.in_features ** 2 + 24 * linear.weight.numel() for linear in linears)

    @torch.no_grad()
    def prune_layer(self, linear, stats: _Hessian, pattern) -> None:
        H, W, scale = normalise(stats.H, linear.weight.detach(), self.percdamp)
        schedule = AdmmSchedule(rho=self.rho, max_iterations=self.admm_iterations, update_every=self.rho_interval,
                                min_iterations=self.min_iterations)
        projected, support, trace = admm_support(H, W, pattern, schedule)
        refit = pcg_on_support(H, W, projected, support, max_iterations=self.pcg_iterations,
                               rtol=self.pcg_rtol)
        self._layer_reports.append((trace.iterations, reconstruction_error(H, W, projected),
                                    reconstruction_error(H, W, refit)))
        linear.weight.copy_((refit / scale).to(linear.weight.dtype))

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        self._layer_reports = []
        report = super()._prune(model, pattern, calib, batch_size=batch_size, progress=progress)
        # in a process group each rank solved its share of the layers
        self._layer_reports = [layer for rank in distributed.all_gather_objects(self._layer_reports) for layer in rank]
        if self._layer_reports:
            iterations, admm, pcg = (sum(column) / len(self._layer_reports) for column in zip(*self._layer_reports))
            report["admm"] = {"layers": len(self._layer_reports), "iterations_mean": iterations,
                              "error_admm_mean": admm, "error_pcg_mean": pcg}
        return report
