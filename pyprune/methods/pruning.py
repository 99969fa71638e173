"""``pyprune.prune``: the one entry point that runs a method on a model and reports what it did."""
from __future__ import annotations

import time
from typing import Dict, Optional, Union

from torch import Tensor, nn

from .. import methods
from .base import Method
from ..nn.measure import parameter_count, sparsity_report
from ..patterns import NM, Pattern, Structured, parse


def prune(model: nn.Module, method: Union[str, Method], pattern: Union[str, float, Pattern],
          calib: Optional[Tensor] = None, *, batch_size: int = 8, progress: bool = True,
          **method_options) -> Dict:
    """Prune ``model`` in place with ``method`` to ``pattern`` using calibration tokens ``calib``
    ([nsamples, seqlen] token ids; not needed by magnitude). Returns a report with the method, the
    pattern, the measured sparsity, parameter counts and the time taken.

    ``method`` is a name (built with ``method_options``) or a :class:`~pyprune.methods.Method`
    object, which keeps its state between calls (COPAL's continual accumulators).

    Everything is checked before the model is touched: an unknown method or pattern, a pattern the
    method cannot produce, an N:M pattern that does not divide a layer, or missing calibration.
    The measured sparsity covers the linear layers the method pruned (an MoE's experts one layer per
    expert matrix); ``left_dense`` names the block parameters it left dense (an MoE's routers, a hybrid
    mixer's convolution and state, fused experts of a layout pyprune does not reproduce), which a
    user must not take for pruned. A
    layer-wise method's ``magnitude_fallback`` counts and names the expert matrices no calibration
    token reached, pruned by magnitude.
    """
    pattern = parse(pattern)
    if isinstance(method, Method):
        if method_options:
            raise ValueError("give method options when building the method object, not to prune(); "
                             f"got {', '.join(sorted(method_options))}")
        runner = method
    else:
        runner = methods.get(method, **method_options)
    params_before = parameter_count(model)
    start = time.perf_counter()
    details = runner.prune(model, pattern, calib, batch_size=batch_size, progress=progress)  # checks first
    elapsed = time.perf_counter() - start
    checked = [(2, 4), (4, 8)]
    if isinstance(pattern, NM) and (pattern.n, pattern.m) not in checked:
        checked.append((pattern.n, pattern.m))  # the report always states whether the asked pattern holds
    measured = sparsity_report(model, nm=checked)
    report = {
        "method": runner.name,
        "pattern": str(pattern),
        "sparsity": measured["sparsity"] if not isinstance(pattern, Structured)
        else 1.0 - parameter_count(model) / params_before,
        "time_s": round(elapsed, 3),
        "parameters_before": params_before,
        "parameters_after": parameter_count(model),
        "nm_valid": measured["nm_valid"],
        "layers": measured["layers"],
        "left_dense": measured["left_dense"],
        "options": runner.settings,
    }
    report.update(details or {})
    return report
