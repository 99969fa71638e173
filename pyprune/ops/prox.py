"""Proximal operators used by MoreauPruner (Eq. 8, group soft-thresholding) and by ℓ₁ methods."""
import torch
from torch import Tensor

from . import library, reference
from . import _validate as check
from .implementations import call
from .library import kernels


def _like_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_soft_threshold = library.define(
    "soft_threshold(Tensor x, float alpha) -> Tensor",
    reference=lambda x, alpha: reference.soft_threshold(x.contiguous(), alpha),
    triton=lambda x, alpha: kernels("prox").soft_threshold(x.contiguous(), alpha), fake=_like_fake)


def soft_threshold(x: Tensor, alpha: float) -> Tensor:
    """prox of α‖·‖₁: sign(x)·max(|x| − α, 0), in fp32, returned in x's dtype."""
    check.tensor("x", x)
    return call(_soft_threshold, x, check.nonnegative("alpha", alpha))


_group_soft_threshold = library.define(
    "group_soft_threshold(Tensor x, float alpha, int group_dim) -> Tensor",
    reference=lambda x, alpha, group_dim: reference.group_soft_threshold(x.contiguous(), alpha, group_dim),
    triton=lambda x, alpha, group_dim: kernels("prox").group_soft_threshold(x.contiguous(), alpha, group_dim),
    fake=_like_fake)


def group_soft_threshold(x: Tensor, alpha: float, group_dim: int = 0) -> Tensor:
    """prox of α‖·‖₂,₁ (MoreauPruner Eq. 8): each index g of ``group_dim`` is one group and
    x_g ← x_g·max(0, 1 − α/‖x_g‖₂). group_dim=0 on a [out, in] weight shrinks output channels
    (rows), group_dim=1 input channels (columns). One kernel reduces and shrinks every group."""
    check.tensor("x", x)
    group_dim = check.dim_index("group_dim", group_dim, x.dim())
    return call(_group_soft_threshold, x, check.nonnegative("alpha", alpha), group_dim)
