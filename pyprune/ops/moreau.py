"""MoreauPruner's displacement step (Algorithm 1 in displacement form; spec §1.5–1.6), fused.

For a pruned weight W [out, in] the method keeps an fp32 displacement δ (δ⁰ = 0) and runs

    δ ← GST_threshold(decay·δ − step_size·g),   decay = 1 − γ/ρ,  step_size = γ,  threshold = γη

where g is the loss gradient at the perturbed weights P = W + δ + ε, ε = noise_ratio·|W|·z. GST
shrinks each group S (a row for group_dim=0, a column for group_dim=1) to δ_S·max(0, 1 −
threshold/‖δ_S‖₂); threshold 0 is plain MoreauPruner, threshold > 0 MoreauPruner-GS.

z ~ N(0, 1) comes from a counter-based generator, so no noise tensor exists anywhere: it is
Triton's ``tl.randn(seed, i)`` at the flat (row-major) element index i, i.e. Philox4x32-10 with
counter (i mod 2**32, i >> 32, 0, 0) and key (seed mod 2**32, seed >> 32), then Box–Muller. The
Triton kernel, the C++ kernel and :func:`pyprune.ops.reference.standard_normal` produce the same
Philox words and uniforms bit for bit; z then differs between them only by the rounding of log and
cos (|Δz| < 2e-6). Callers derive a distinct seed in [0, 2**63) for every step and noise draw.

Scalars (decay, step_size, threshold, noise_ratio) are rounded to fp32 before use, as in the
reference's eager arithmetic.
"""
from typing import Optional

import torch
from torch import Tensor

from . import library, reference
from . import _validate as check
from .implementations import call
from .library import kernels

_GROUP_DIMS = (0, 1)
_MAX_SEED = 2 ** 63 - 1


def _reference_perturb(perturbed, weight, delta, noise_ratio, seed):
    reference.moreau_perturb_(perturbed, weight.contiguous(), delta, noise_ratio, seed)


def _triton_perturb(perturbed, weight, delta, noise_ratio, seed):
    kernels("moreau").moreau_perturb_(perturbed, weight.contiguous(), delta, noise_ratio, seed,
                                      library.triton_interpreted())


def _no_result_fake(*args):
    return None


_moreau_perturb = library.define(
    "moreau_perturb_(Tensor(a!) perturbed, Tensor weight, Tensor delta, float noise_ratio, int seed) -> ()",
    reference=_reference_perturb, triton=_triton_perturb, fake=_no_result_fake)


def _reference_step(delta, grad, weight, perturbed, *scalars):
    reference.moreau_step_(delta, grad.contiguous(), weight.contiguous(), perturbed, *scalars)


def _triton_step(delta, grad, weight, perturbed, *scalars):
    kernels("moreau").moreau_step_(delta, grad.contiguous(), weight.contiguous(), perturbed, *scalars,
                                   library.triton_interpreted())


_moreau_step = library.define(
    "moreau_step_(Tensor(a!) delta, Tensor grad, Tensor weight, Tensor(b!)? perturbed, float decay, "
    "float step_size, float threshold, int group_dim, float noise_ratio, int seed) -> ()",
    reference=_reference_step, triton=_triton_step, fake=_no_result_fake)


def _check_tensors(delta: Tensor, perturbed: Optional[Tensor], **read: Tensor) -> None:
    """delta: fp32, 2-D, contiguous; the read tensors and perturbed: delta's shape, any float
    dtype, one device; perturbed contiguous; nothing written in place overlaps another tensor."""
    check.tensor("delta", delta, dims=(2,))
    check.dtype("delta", delta, torch.float32)
    check.contiguous("delta", delta)
    for name, value in read.items():
        check.tensor(name, value)
        check.same_shape(name, value, delta.shape, "delta")
    if perturbed is not None:
        check.tensor("perturbed", perturbed)
        check.same_shape("perturbed", perturbed, delta.shape, "delta")
        check.contiguous("perturbed", perturbed)
    check.same_device(delta=delta, perturbed=perturbed, **read)
    check.disjoint(("delta", "perturbed"), delta=delta, perturbed=perturbed, **read)


def _noise_args(noise_ratio, seed):
    noise_ratio = check.nonnegative("noise_ratio", check.finite("noise_ratio", noise_ratio))
    if not 0 <= check.integer("seed", seed) <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1]; got {seed}")
    return noise_ratio, seed


def moreau_perturb_(perturbed: Tensor, weight: Tensor, delta: Tensor, *, noise_ratio: float,
                    seed: int) -> None:
    """perturbed[:] = (W + δ + noise_ratio·|W|·z).to(perturbed.dtype), computed in fp32.

    weight, delta (fp32, contiguous) and perturbed (contiguous) share one 2-D shape; weight and
    perturbed may be fp32/fp16/bf16. z is the Philox normal of the module docstring.
    """
    _check_tensors(delta, perturbed, weight=weight)
    noise_ratio, seed = _noise_args(noise_ratio, seed)
    call(_moreau_perturb, perturbed, weight, delta, noise_ratio, seed)


def moreau_step_(delta: Tensor, grad: Tensor, weight: Tensor, perturbed: Optional[Tensor] = None,
                 *, decay: float, step_size: float, threshold: float = 0.0, group_dim: int = 0,
                 noise_ratio: float = 0.05, seed: int = 0) -> None:
    """One MoreauPruner step in place: δ ← GST_threshold(decay·δ − step_size·g) along group_dim
    (δ ← decay·δ − step_size·g when threshold == 0), then, when ``perturbed`` is given, the
    :func:`moreau_perturb_` write from the new δ.

    delta is fp32 and contiguous; grad, weight and perturbed have its shape and any float dtype.
    One pass over memory (two over g when shrinking); the noise is never stored.
    """
    _check_tensors(delta, perturbed, grad=grad, weight=weight)
    decay = check.finite("decay", decay)
    step_size = check.finite("step_size", step_size)
    threshold = check.nonnegative("threshold", check.finite("threshold", threshold))
    check.choice("group_dim", check.integer("group_dim", group_dim), _GROUP_DIMS)
    noise_ratio, seed = _noise_args(noise_ratio, seed)
    call(_moreau_step, delta, grad, weight, perturbed, decay, step_size, threshold, group_dim,
                 noise_ratio, seed)
