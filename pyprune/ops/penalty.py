"""DReSS's regularisation penalty on the hidden channels to be pruned (spec §1.4, Eqs. 2–4: λ times
a column-wise vector norm of every weight slice that reads or writes those channels), added to the
gradient in place after ``loss.backward()``: no penalty term enters the autograd graph, and no
gradient-sized temporary is made."""
import torch
from torch import Tensor

from . import library, reference
from . import _validate as check
from .implementations import call
from .library import kernels

NORMS = ("l2", "l1")


def _penalty_kernel(kernel):
    """``kernel(grad, weight, channels, dim, lam, l1)`` behind the op's value checks and 1-D form."""
    def run(grad, weight, channels, dim, lam, norm):
        # Range and repeats depend on the values, so they are checked here, where the tensors are
        # real also inside a torch.compile graph; still before grad is touched.
        check.index_values("channels", channels, weight.shape[dim], f"weight's dim {dim}")
        if weight.dim() == 1:  # one row whose columns are the channels
            grad, weight, dim = grad.unsqueeze(0), weight.unsqueeze(0), 1
        return kernel(grad, weight.contiguous(), channels.contiguous(), dim, lam, norm == "l1")
    return run


def _reference(grad, weight, channels, dim, lam, l1):
    return reference.channel_penalty_(grad, weight, channels, dim, lam, "l1" if l1 else "l2")


def _triton(grad, weight, channels, dim, lam, l1):
    return kernels("penalty").channel_penalty_(grad, weight, channels, dim, lam, l1,
                                               library.triton_interpreted())


def _penalty_fake(grad, weight, channels, dim, lam, norm):
    return torch.empty(channels.shape[0], dtype=torch.float32, device=weight.device)


_channel_penalty = library.define(
    "channel_penalty_(Tensor(a!) grad, Tensor weight, Tensor channels, int dim, float lam, str norm) -> Tensor",
    reference=_penalty_kernel(_reference), triton=_penalty_kernel(_triton), fake=_penalty_fake)


def channel_penalty_(grad: Tensor, weight: Tensor, channels: Tensor, dim: int, lam: float,
                     norm: str = "l2") -> Tensor:
    """grad[slice c] += lam·∂‖W[slice c]‖/∂W for every c in ``channels``; returns the fp32 norms
    ‖W[slice c]‖ in channels order (the penalty is lam·norms.sum()).

    Slice c is index c of ``dim``: a row of W for dim 0 (o_proj, down_proj: output channels), a
    column for dim 1 (q/k/v/gate/up_proj: input channels; embedding and lm_head: hidden
    columns), an element of a 1-D weight (RMSNorm). ``norm="l2"`` (DReSS-ℓ2, group lasso): the
    gradient is lam·W/‖W‖₂, and 0 where the norm is 0; ``"l1"``: ‖W‖₁ and lam·sign(W).

    weight: 1-D or 2-D, fp32/fp16/bf16 (a non-contiguous one is read from a contiguous copy);
    grad: its shape, contiguous, any of those dtypes, written in place; channels: distinct int64
    (or int32) indices into ``dim``, in any order. Norms accumulate in fp32; each updated grad
    element is computed in fp32 and rounded once. Only the selected slices are read or written.
    The norms are for logging: they carry no autograd history, even for a weight that requires
    grad (the usual call is ``channel_penalty_(p.grad, p, ...)`` after ``loss.backward()``).
    """
    check.tensor("weight", weight, dims=(1, 2))
    check.tensor("grad", grad)
    check.same_shape("grad", grad, weight.shape, "weight")
    check.contiguous("grad", grad)
    dim = check.dim_index("dim", dim, weight.dim())
    check.index_type("channels", channels)
    check.same_device(grad=grad, weight=weight, channels=channels)
    check.disjoint(("grad",), grad=grad, weight=weight)
    lam = check.nonnegative("lam", check.finite("lam", lam))
    check.choice("norm", norm, NORMS)
    # The op is a gradient step, not a differentiable function: the norms carry no history.
    return call(_channel_penalty, grad, weight.detach(), channels.long(), dim, lam, norm)
