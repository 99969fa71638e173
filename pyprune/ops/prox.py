"""Proximal operators used by MoreauPruner (Eq. 8, group soft-thresholding) and by ℓ₁ methods."""
import torch
from torch import Tensor

from . import reference
from . import _validate as check
from ._dispatch import kernels, run

_SOFT_IMPLS = {
    "reference": reference.soft_threshold,
    "triton": lambda x, alpha: kernels("prox").soft_threshold(x, alpha),
}


@torch.library.custom_op("pyprune::soft_threshold", mutates_args=())
def _soft_threshold(x: Tensor, alpha: float) -> Tensor:
    return run("soft_threshold", _SOFT_IMPLS, x.device, x.contiguous(), alpha)


@_soft_threshold.register_fake
def _(x, alpha):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def soft_threshold(x: Tensor, alpha: float) -> Tensor:
    """prox of α‖·‖₁: sign(x)·max(|x| − α, 0), in fp32, returned in x's dtype."""
    check.tensor("x", x)
    return _soft_threshold(x, check.nonnegative("alpha", alpha))


_GROUP_IMPLS = {
    "reference": reference.group_soft_threshold,
    "triton": lambda x, alpha, group_dim: kernels("prox").group_soft_threshold(x, alpha, group_dim),
}


@torch.library.custom_op("pyprune::group_soft_threshold", mutates_args=())
def _group_soft_threshold(x: Tensor, alpha: float, group_dim: int) -> Tensor:
    return run("group_soft_threshold", _GROUP_IMPLS, x.device, x.contiguous(), alpha, group_dim)


@_group_soft_threshold.register_fake
def _(x, alpha, group_dim):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def group_soft_threshold(x: Tensor, alpha: float, group_dim: int = 0) -> Tensor:
    """prox of α‖·‖₂,₁ (MoreauPruner Eq. 8): each index g of ``group_dim`` is one group and
    x_g ← x_g·max(0, 1 − α/‖x_g‖₂). group_dim=0 on a [out, in] weight shrinks output channels
    (rows), group_dim=1 input channels (columns). One kernel reduces and shrinks every group."""
    check.tensor("x", x)
    group_dim = check.dim_index("group_dim", group_dim, x.dim())
    return _group_soft_threshold(x, check.nonnegative("alpha", alpha), group_dim)
