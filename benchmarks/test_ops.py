"""Every pyprune op against the eager PyTorch a user would otherwise write.

A case is one op on one shape in one dtype; each of its implementations is a benchmark of its own
(``role``: ``pyprune``, a named baseline, or, for a mask op, the byte floor: reading the op's input
once and writing one byte per element, ``torch.ne(input, 0, out=bool)``), grouped by the case. The
``pyprune`` benchmark first checks the op's result against its eager baseline (masks: the same
number kept and the same kept score mass; values: within the dtype's tolerance). Recorded per
benchmark: the op, shape, dtype, device, role, baseline name and, for pyprune, the bytes the op
moves; ``benchmarks/report.py`` turns a run into ``ops-<device>-<dtype>.{json,md}`` (speedup, GB/s,
share of the peak bandwidth on an H100/H200, times the byte floor).

    pytest benchmarks/test_ops.py --benchmark-only --size full --benchmark-json run.json
    pytest benchmarks/test_ops.py --benchmark-only -k "nm_mask or SAFE" --dtype bfloat16
"""
import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from _common import default_device, load_average, synchronized

from pyprune import ops
from pyprune.ops.conventions import sparse24_mma_meta

SHAPES = {"full": [(4096, 4096), (11008, 4096), (4096, 11008)], "tiny": [(64, 128), (128, 64)]}
#: Tokens of the activations (accumulate_sqnorm_, accumulate_abs_outer_); the linears take the first 16.
TOKENS = {"full": 2048, "tiny": 32}
#: The seven weights of a decoder block, q/k/v/o, gate/up, down (LLaMA-7B: h 4096, FFN 11008).
BLOCK = {"full": ((4096, 4096),) * 4 + ((11008, 4096),) * 2 + ((4096, 11008),),
         "tiny": ((32, 32),) * 4 + ((88, 32),) * 2 + ((32, 88),)}
SAFE_STEP = "SAFE x-step (sam_perturb_ + sam_adam_step_)"
#: SAFE's LLM setting (spec §1.13): ρ = 2e-4, Adam lr 2e-4, β = (0.9, 0.95), no weight decay, λ = 1e-3.
SAFE_RHO, SAFE_LR, SAFE_BETAS, SAFE_EPS, SAFE_LAM = 2e-4, 2e-4, (0.9, 0.95), 1e-8, 1e-3
#: Largest error of a value allowed, relative to the reference's largest magnitude (at least 1).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
DTYPES = ["float32"]


# ---- baselines: the eager PyTorch that pruning code writes today ---------------------------

def loop_nm_mask(scores, n, m):
    """Wanda-style N:M selection: a Python loop over column blocks of m, topk + scatter_ each."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    for start in range(0, scores.shape[1], m):
        block = scores[:, start:start + m].float()
        mask.scatter_(1, start + torch.topk(block, n, dim=1)[1], True)
    return mask


def vectorised_topk_nm_mask(scores, n, m):
    """One torch.topk over [rows·cols/m, m] groups (tie order unspecified)."""
    groups = scores.float().reshape(-1, m)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(1, torch.topk(groups, n, dim=1)[1], True).reshape(scores.shape)


def eager_wanda_score(w, sqnorm):
    return w.float().abs() * sqnorm.sqrt()


def eager_topk_row_mask(scores, sparsity):
    keep = int((1 - sparsity) * scores.shape[1] + 0.5)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(1, torch.topk(scores.float(), keep, dim=1)[1], True)


def eager_topk_tensor_mask(scores, sparsity):
    keep = int((1 - sparsity) * scores.numel() + 0.5)
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    return mask.scatter_(0, torch.topk(scores.float().reshape(-1), keep)[1], True).reshape(scores.shape)


def eager_soft_threshold(w, alpha):
    return (w.float().sign() * (w.float().abs() - alpha).clamp_min(0)).to(w.dtype)


def eager_group_soft_threshold(x, alpha):
    norm = x.float().norm(dim=1, keepdim=True)
    return (x.float() * (1 - alpha / norm).clamp_min(0)).to(x.dtype)


def eager_sqnorm(acc, x):
    acc += x.float().pow(2).sum(dim=0)
    return acc


def eager_compress(w, mask):
    return w[mask].reshape(w.shape[0], -1), mask


def eager_decompress(values, meta):
    """Dense W ⊙ mask from the compressed form: unpack the mask bits, scatter the kept values."""
    rows, cols = values.shape[0], meta.shape[1] * 8
    bits = (meta.unsqueeze(-1) >> torch.arange(8, device=meta.device, dtype=torch.uint8)) & 1
    mask = bits.reshape(rows, -1)[:, :cols].bool()
    out = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
    out[mask] = values.reshape(-1)
    return out


def eager_moreau_step(delta, grad, weight, perturbed, decay, step_size, threshold, group_dim, noise_ratio):
    """MoreauPruner's step as eager PyTorch: update, group norms and scale, a stored noise tensor."""
    d = decay * delta - step_size * grad.float()
    if threshold > 0:
        norm = d.norm(dim=1 - group_dim, keepdim=True)
        d = d * (1 - threshold / norm).clamp_min(0)
    delta.copy_(d)
    w = weight.float()
    noise = torch.randn_like(w) * noise_ratio * w.abs()
    perturbed.copy_(w + delta + noise)


def eager_moreau_perturb(perturbed, w, delta, noise_ratio):
    return perturbed.copy_(w.float() + delta + noise_ratio * w.float().abs() * torch.randn_like(delta))


def eager_abs_outer(acc, dy, x):
    """COPAL's G += 2·|DY|ᵀ|X| as eager PyTorch: fp32 copies of |DY| and |X|, then one addmm_."""
    return acc.addmm_(dy.abs().float().T, x.abs().float(), alpha=2)


def eager_channel_penalty(grad, weight, channels, dim, lam, norm):
    """DReSS's penalty step as eager PyTorch: gather the slices in fp32, their norms, the step,
    and index_add_ it into grad."""
    slices = weight.index_select(dim, channels).float()
    if norm == "l1":
        norms, step = slices.abs().sum(dim=1 - dim), lam * slices.sign()
    else:
        norms = slices.norm(dim=1 - dim)
        step = slices * (lam / norms.clamp_min(1e-30)).unsqueeze(1 - dim)
    grad.index_add_(dim, channels, step.to(grad.dtype))
    return norms


def eager_admm_dual_update(v, keep, x, n=None, m=None, sparsity=None, act_sqnorm=None):
    """SAFE's dual update as eager PyTorch: v = x + v⊙¬keep, the score, the mask by torch.topk +
    scatter_ (per group of m, or per row), then ‖x − v⊙keep‖²."""
    v.copy_(x.float() + v * ~keep)
    scores = v.abs() if act_sqnorm is None else v.abs() * act_sqnorm.sqrt()
    keep.copy_(vectorised_topk_nm_mask(scores, n, m) if m else eager_topk_row_mask(scores, sparsity))
    return (x.float() - v * keep).square().sum()


def eager_sam_perturb(x, grads, anchors, rho):
    """SAM ascent as eager PyTorch: one torch._foreach_norm, then a copy_ and an add_ per tensor."""
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    for p, g, anchor in zip(x, grads, anchors):
        anchor.copy_(p)
        if norm > 0:
            p.add_(g, alpha=rho / norm)


def eager_restore_and_penalised_grads(x, grads, anchors, vs, keeps, lam):
    """x ← anchor, then G = g + λ·(x − z + u) = g + λ·(x ± v) per tensor."""
    gs = []
    for p, g, anchor, v, keep in zip(x, grads, anchors, vs, keeps):
        p.copy_(anchor)
        gs.append(g + lam * (p + torch.where(keep, -v, v)))
    return gs


def eager_safe_step(state, step):
    """SAFE's x-step as eager PyTorch: the ascent, then per tensor the penalty and Adam's math as
    torch.optim.Adam's single-tensor path writes it."""
    beta1, beta2 = SAFE_BETAS
    eager_sam_perturb(state.x, state.grads, state.anchors, SAFE_RHO)
    gs = eager_restore_and_penalised_grads(state.x, state.grads, state.anchors, state.vs, state.keeps, SAFE_LAM)
    for p, G, m, s in zip(state.x, gs, state.exp_avgs, state.exp_avg_sqs):
        m.mul_(beta1).add_(G, alpha=1 - beta1)
        s.mul_(beta2).addcmul_(G, G, value=1 - beta2)
        denom = (s.sqrt() / math.sqrt(1 - beta2 ** step)).add_(SAFE_EPS)
        p.addcdiv_(m, denom, value=-SAFE_LR / (1 - beta1 ** step))


def optimizer_safe_step(state, optimizer):
    """SAFE's x-step with torch.optim: the eager ascent and penalty, G handed to the optimizer."""
    eager_sam_perturb(state.x, state.grads, state.anchors, SAFE_RHO)
    gs = eager_restore_and_penalised_grads(state.x, state.grads, state.anchors, state.vs, state.keeps, SAFE_LAM)
    for p, G in zip(state.x, gs):
        p.grad = G.to(p.dtype)  # a gradient of the parameter's dtype, as autograd gives
    optimizer.step()


def byte_floor(source):
    """The least a mask op can cost: read its input once and write one byte per element (a
    comparison into a preallocated bool tensor, at the machine's streaming bandwidth)."""
    out = torch.empty(source.shape, dtype=torch.bool, device=source.device)
    return lambda: torch.ne(source, 0, out=out)


# ---- checks ------------------------------------------------------------------------------------

def assert_close(ours, reference, dtype):
    scale = max(1.0, reference.float().abs().max().item())
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"largest error {error:.3g} (reference up to {scale:.3g})"


def assert_same_selection(ours, reference, scores, groups):
    """Two masks keep as many entries of every group (``groups`` columns wide; None: the whole tensor)
    and the same score mass in each: the same selection up to ties."""
    assert ours.dtype == torch.bool and ours.shape == reference.shape
    width = scores.numel() if groups is None else groups
    counts = [mask.reshape(-1, width).sum(-1) for mask in (ours, reference)]
    assert torch.equal(*counts)
    mass = [(scores.float() * mask).reshape(-1, width).sum(-1) for mask in (ours, reference)]
    torch.testing.assert_close(*mass, rtol=1e-5, atol=1e-6)


# ---- the cases ---------------------------------------------------------------------------------

class Operands(NamedTuple):
    """The tensors of one shape's cases."""
    w: torch.Tensor
    scores: torch.Tensor
    sqnorm: torch.Tensor
    x: torch.Tensor
    grad: torch.Tensor
    mask24: torch.Tensor
    values: torch.Tensor
    meta: torch.Tensor


@functools.lru_cache(maxsize=1)  # one shape's tensors at a time: cases run shape by shape
def operands(shape, dtype, device, tokens):
    cols = shape[1]
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype).to(device)
    mask24 = ops.score_nm_mask(w, 2, 4)
    values, meta = ops.nm_compress(w, mask24, 2, 4)
    return Operands(w=w, scores=w.float().abs(), sqnorm=(torch.rand(cols, generator=g) + 0.1).to(device),
                    x=torch.randn(tokens, cols, generator=g).to(dtype).to(device),
                    grad=torch.randn(shape, generator=g).to(dtype).to(device),
                    mask24=mask24, values=values, meta=meta)


class Built(NamedTuple):
    """A case's implementations ({role: call}), the bytes pyprune's op moves, its check, and the row's
    name where the shape sets part of it."""
    calls: dict
    nbytes: int
    check: Callable[[], None]
    op: Optional[str] = None


class Case(NamedTuple):
    op: str  # the row's name in the results
    key: str  # its test id
    baselines: Sequence[Tuple[str, str]]  # (role, the baseline's name in the results)
    build: Callable[[Operands], Built]
    floor: bool = False  # a mask op, timed against its byte floor
    runs: Callable[[torch.device, torch.dtype], bool] = lambda device, dtype: True


def nm_mask_case(n, m):
    def build(t):
        def check():
            ours = ops.nm_mask(t.scores, n, m)
            for reference in (loop_nm_mask(t.scores, n, m), vectorised_topk_nm_mask(t.scores, n, m)):
                assert_same_selection(ours, reference, t.scores, m)
        return Built({"pyprune": lambda: ops.nm_mask(t.scores, n, m), "loop": lambda: loop_nm_mask(t.scores, n, m),
                      "topk": lambda: vectorised_topk_nm_mask(t.scores, n, m), "floor": byte_floor(t.scores)},
                     t.scores.numel() * 5, check)
    return Case(f"nm_mask {n}:{m}", f"nm_mask-{n}:{m}",
                [("loop", "python loop of topk+scatter_"), ("topk", "vectorised torch.topk")], build, floor=True)


def score_nm_mask_case(n, m):
    def build(t):
        def check():
            assert_same_selection(ops.score_nm_mask(t.w, n, m, t.sqnorm),
                                  vectorised_topk_nm_mask(eager_wanda_score(t.w, t.sqnorm), n, m),
                                  eager_wanda_score(t.w, t.sqnorm), m)
        return Built({"pyprune": lambda: ops.score_nm_mask(t.w, n, m, t.sqnorm),
                      "eager": lambda: vectorised_topk_nm_mask(eager_wanda_score(t.w, t.sqnorm), n, m),
                      "floor": byte_floor(t.w)}, t.w.numel() * (t.w.element_size() + 1), check)
    return Case(f"score_nm_mask wanda {n}:{m}", f"score_nm_mask-wanda-{n}:{m}",
                [("eager", "eager score + torch.topk")], build, floor=True)


def topk_mask_case(scope):
    eager = eager_topk_row_mask if scope == "row" else eager_topk_tensor_mask

    def build(t):
        def check():
            assert_same_selection(ops.topk_mask(t.scores, 0.5, scope), eager(t.scores, 0.5), t.scores,
                                  t.scores.shape[1] if scope == "row" else None)
        return Built({"pyprune": lambda: ops.topk_mask(t.scores, 0.5, scope), "eager": lambda: eager(t.scores, 0.5),
                      "floor": byte_floor(t.scores)}, t.scores.numel() * 5, check)
    name = "torch.topk + scatter_" + (" (flattened)" if scope == "tensor" else "")
    return Case(f"topk_mask {scope} 50%", f"topk_mask-{scope}", [("eager", name)], build, floor=True)


def score_topk_mask_case():
    def build(t):
        def check():
            scores = eager_wanda_score(t.w, t.sqnorm)
            assert_same_selection(ops.score_topk_mask(t.w, 0.5, "row", t.sqnorm), eager_topk_row_mask(scores, 0.5),
                                  scores, scores.shape[1])
        return Built({"pyprune": lambda: ops.score_topk_mask(t.w, 0.5, "row", t.sqnorm),
                      "eager": lambda: eager_topk_row_mask(eager_wanda_score(t.w, t.sqnorm), 0.5),
                      "floor": byte_floor(t.w)}, t.w.numel() * (t.w.element_size() + 1), check)
    return Case("score_topk_mask wanda row 50%", "score_topk_mask-wanda-row",
                [("eager", "eager score + torch.topk + scatter_")], build, floor=True)


def pure_case(op, key, baseline, pyprune, eager, nbytes, compare=assert_close):
    """A pure function of the operands: ``pyprune(t)`` and ``eager(t)`` return the same value."""
    def build(t):
        return Built({"pyprune": lambda: pyprune(t), "eager": lambda: eager(t)}, nbytes(t),
                     lambda: compare(pyprune(t), eager(t), t.w.dtype))
    return Case(op, key, [("eager", baseline)], build)


def assert_equal(ours, reference, dtype):
    assert torch.equal(ours, reference)


def masked_dense(t):
    return t.w * t.mask24


def sparse24_runs(device, dtype):
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(device) >= (8, 0))  # sparse tensor cores


def sparse24_case():
    def build(t):
        mma_meta = sparse24_mma_meta(t.meta, t.w.shape[1])
        x = t.x[:16]
        return Built({"pyprune": lambda: ops.sparse24_linear(x, t.values, mma_meta),
                      "dense": lambda: F.linear(x, t.w)},
                     t.values.numel() * t.values.element_size() + mma_meta.numel() * mma_meta.element_size(),
                     lambda: assert_close(ops.sparse24_linear(x, t.values, mma_meta),
                                          F.linear(x.float(), masked_dense(t).float()), t.w.dtype))
    return Case("sparse24_linear M=16", "sparse24_linear-M16", [("dense", "dense F.linear")], build,
                runs=sparse24_runs)


def sliced_case():
    def build(t):
        cols = t.w.shape[1]
        in_index = torch.arange(0, cols, 2, device=t.w.device)
        x = t.x[:16, :cols // 2]
        return Built({"pyprune": lambda: ops.sliced_linear(x, t.w, in_index=in_index),
                      "eager": lambda: F.linear(x, t.w.index_select(1, in_index))},
                     t.w.numel() * t.w.element_size() // 2,
                     lambda: assert_close(ops.sliced_linear(x, t.w, in_index=in_index),
                                          F.linear(x.float(), t.w.index_select(1, in_index).float()), t.w.dtype))
    return Case("sliced_linear half inputs M=16", "sliced_linear-half-M16", [("eager", "index_select + F.linear")],
                build)


def abs_outer_case():
    """COPAL's accumulation G [out, in] += 2·|DY|ᵀ|X| over the tokens of x, DY [tokens, out] in x's
    dtype. Bytes: DY and X read once, G read and written (a GEMM: 2·tokens·out·in FLOP)."""
    def build(t):
        dy = torch.randn(t.x.shape[0], t.w.shape[0], generator=torch.Generator().manual_seed(2)).to(t.x)
        acc = torch.zeros(t.w.shape, device=t.w.device)

        def check():
            ours = ops.accumulate_abs_outer_(torch.zeros_like(acc), dy, t.x, alpha=2.0)
            assert_close(ours, eager_abs_outer(torch.zeros_like(acc), dy, t.x), torch.float32)
        return Built({"pyprune": lambda: ops.accumulate_abs_outer_(acc, dy, t.x, alpha=2.0),
                      "eager": lambda: eager_abs_outer(acc, dy, t.x)},
                     acc.numel() * 8 + (dy.numel() + t.x.numel()) * t.x.element_size(), check)
    return Case("accumulate_abs_outer_", "accumulate_abs_outer_", [("eager", "eager abs().float() + addmm_")], build)


def channel_penalty_case(norm):
    """DReSS's penalty (λ = 1e-3) on the last quarter of the hidden dim, the shorter side of a
    LLaMA weight: input columns of q/k/v/gate/up ([4096, 4096], [11008, 4096]: dim 1), output rows
    of o/down ([4096, 11008]: dim 0). Bytes: the selected slices of W read and of grad read and
    written, once each (ℓ2 reads W twice; the second read is not counted)."""
    def build(t):
        w = t.w
        dim = 0 if w.shape[0] < w.shape[1] else 1
        hidden = w.shape[dim]
        channels = torch.arange(hidden - hidden // 4, hidden, device=w.device)
        grad = t.grad.clone()

        def check():
            ours, theirs = t.grad.clone(), t.grad.clone()
            assert_close(ops.channel_penalty_(ours, w, channels, dim, 1e-3, norm),
                         eager_channel_penalty(theirs, w, channels, dim, 1e-3, norm), torch.float32)
            assert_close(ours, theirs, w.dtype)
        return Built({"pyprune": lambda: ops.channel_penalty_(grad, w, channels, dim, 1e-3, norm),
                      "eager": lambda: eager_channel_penalty(grad, w, channels, dim, 1e-3, norm)},
                     channels.numel() * w.shape[1 - dim] * 3 * w.element_size(), check,
                     f"channel_penalty_ {norm} dim={dim}")
    return Case(f"channel_penalty_ {norm}", f"channel_penalty_-{norm}",
                [("eager", "index_select + norm + index_add_")], build)


def moreau_perturb_case():
    """moreau_perturb_ (noise ratio 0.05; checked without noise, where it is W + δ).
    Bytes: δ read (fp32), W read, perturbed written, once each."""
    def build(t):
        delta = torch.randn(t.w.shape, generator=torch.Generator().manual_seed(3)).to(t.w.device) * 1e-2
        perturbed = torch.empty_like(t.w)

        def check():
            ops.moreau_perturb_(perturbed, t.w, delta, noise_ratio=0.0, seed=1)
            assert_close(perturbed, (t.w.float() + delta).to(t.w.dtype), t.w.dtype)
        return Built({"pyprune": lambda: ops.moreau_perturb_(perturbed, t.w, delta, noise_ratio=0.05, seed=1),
                      "eager": lambda: eager_moreau_perturb(perturbed, t.w, delta, 0.05)},
                     t.w.numel() * (4 + 2 * t.w.element_size()), check)
    return Case("moreau_perturb_", "moreau_perturb_", [("eager", "eager W + δ + r·|W|·randn_like")], build)


def moreau_step_case(label, group_dim, gs):
    """moreau_step_ with a perturbed write (γ = 2e-4, ρ = 0.2 as in the paper): plain, and -GS along
    rows and columns with the threshold γ·sqrt(group size). Checked without noise: δ and the perturbed
    weight as eager PyTorch computes them. Bytes: δ read and written (fp32), g and W read, perturbed
    written, each once."""
    step_size, decay = 2e-4, 1 - 2e-4 / 0.2

    def build(t):
        threshold = step_size * t.w.shape[1 - group_dim] ** 0.5 if gs else 0.0
        kwargs = dict(decay=decay, step_size=step_size, threshold=threshold, group_dim=group_dim)
        delta, perturbed = torch.zeros(t.w.shape, device=t.w.device), torch.empty_like(t.w)

        def check():
            ours, theirs = ((torch.zeros_like(delta), torch.empty_like(t.w)) for _ in range(2))
            ops.moreau_step_(ours[0], t.grad, t.w, ours[1], seed=1, noise_ratio=0.0, **kwargs)
            eager_moreau_step(theirs[0], t.grad, t.w, theirs[1], noise_ratio=0.0, **kwargs)
            assert_close(ours[0], theirs[0], torch.float32)
            assert_close(ours[1], theirs[1], t.w.dtype)
        return Built({"pyprune": lambda: ops.moreau_step_(delta, t.grad, t.w, perturbed, seed=1, noise_ratio=0.05,
                                                          **kwargs),
                      "eager": lambda: eager_moreau_step(delta, t.grad, t.w, perturbed, noise_ratio=0.05, **kwargs)},
                     t.w.numel() * (8 + 3 * t.w.element_size()), check)
    return Case(f"moreau_step_{label}", "moreau_step_" + label.strip().replace(" ", "-"),
                [("eager", "eager PyTorch + randn_like")], build)


def admm_case(label, key, wanda=False, **kwargs):
    """admm_dual_update_ (SAFE's z- and u-step, x = w): each implementation on its own (v, keep)
    state carried across the timed calls. Bytes: x read, v (fp32) and keep (1 byte) read and
    written, once each."""
    def build(t):
        options = dict(kwargs, act_sqnorm=t.sqnorm) if wanda else kwargs
        v = torch.randn(t.w.shape, generator=torch.Generator().manual_seed(4)).to(t.w.device) * 0.1
        keep = ops.score_nm_mask(v, 2, 4)
        state = (v.clone(), keep.clone())

        def check():
            ours, theirs = (v.clone(), keep.clone()), (v.clone(), keep.clone())
            loss = ops.admm_dual_update_(*ours, t.w, **options)
            assert_close(loss, eager_admm_dual_update(*theirs, t.w, **options), torch.float32)
            assert_close(ours[0], theirs[0], torch.float32)
            score = ours[0].abs() * (t.sqnorm.sqrt() if wanda else 1)
            assert_same_selection(ours[1], theirs[1], score, options.get("m") or t.w.shape[1])
        calls = {"pyprune": lambda: ops.admm_dual_update_(*state, t.w, **options),
                 "eager": lambda: eager_admm_dual_update(*state, t.w, **options)}
        return Built(calls, t.w.numel() * (t.w.element_size() + 10), check)
    return Case(f"admm_dual_update_ {label}", f"admm_dual_update_-{key}",
                [("eager", "eager update + torch.topk + scatter_")], build)


def elementwise(t, extra=4):
    return t.w.numel() * (t.w.element_size() + extra)


CASES = [
    *[builder(n, m) for n, m in ((2, 4), (4, 8)) for builder in (nm_mask_case, score_nm_mask_case)],
    topk_mask_case("row"), topk_mask_case("tensor"), score_topk_mask_case(),
    pure_case("soft_threshold", "soft_threshold", "eager sign·clamp in fp32", lambda t: ops.soft_threshold(t.w, 0.5),
              lambda t: eager_soft_threshold(t.w, 0.5), lambda t: t.w.numel() * t.w.element_size() * 2),
    pure_case("group_soft_threshold rows", "group_soft_threshold-rows", "eager norm/clamp/mul",
              lambda t: ops.group_soft_threshold(t.w, 1.0, 0), lambda t: eager_group_soft_threshold(t.w, 1.0),
              lambda t: t.w.numel() * t.w.element_size() * 3),
    pure_case("accumulate_sqnorm_", "accumulate_sqnorm_", "eager pow+sum",
              lambda t: ops.accumulate_sqnorm_(torch.zeros(t.x.shape[1], device=t.x.device), t.x),
              lambda t: eager_sqnorm(torch.zeros(t.x.shape[1], device=t.x.device), t.x),
              lambda t: t.x.numel() * t.x.element_size()),
    pure_case("nm_compress 2:4", "nm_compress-2:4", "boolean indexing",
              lambda t: ops.nm_compress(t.w, t.mask24, 2, 4)[0], lambda t: eager_compress(t.w, t.mask24)[0],
              lambda t: t.w.numel() * (t.w.element_size() + 1) + t.values.numel() * t.w.element_size(), assert_equal),
    Case("nm_linear 2:4 M=16", "nm_linear-2:4-M16", [("dense", "dense F.linear")],
         lambda t: Built({"pyprune": lambda: ops.nm_linear(t.x[:16], t.values, t.meta, 2, 4),
                          "dense": lambda: F.linear(t.x[:16], t.w)},
                         t.values.numel() * t.w.element_size() + t.meta.numel(),
                         lambda: assert_close(ops.nm_linear(t.x[:16], t.values, t.meta, 2, 4),
                                              F.linear(t.x[:16].float(), masked_dense(t).float()), t.w.dtype))),
    sparse24_case(),
    pure_case("magnitude_score", "magnitude_score", "w.float().abs()", lambda t: ops.magnitude_score(t.w),
              lambda t: t.w.float().abs(), elementwise),
    pure_case("wanda_score", "wanda_score", "eager |w|·sqrt(sqnorm)", lambda t: ops.wanda_score(t.w, t.sqnorm),
              lambda t: eager_wanda_score(t.w, t.sqnorm), elementwise),
    pure_case("taylor_score", "taylor_score", "eager (w·grad).abs() in fp32", lambda t: ops.taylor_score(t.w, t.grad),
              lambda t: (t.w.float() * t.grad.float()).abs(), lambda t: elementwise(t, 4 + t.w.element_size())),
    pure_case("nm_decompress 2:4", "nm_decompress-2:4", "unpack bits + boolean scatter",
              lambda t: ops.nm_decompress(t.values, t.meta, 2, 4), lambda t: eager_decompress(t.values, t.meta),
              lambda t: t.w.numel() * t.w.element_size() + t.values.numel() * t.w.element_size() + t.meta.numel(),
              assert_equal),
    moreau_perturb_case(),
    moreau_step_case("", 0, False), moreau_step_case(" GS rows", 0, True), moreau_step_case(" GS columns", 1, True),
    sliced_case(), abs_outer_case(), channel_penalty_case("l2"), channel_penalty_case("l1"),
    admm_case("2:4", "2:4", n=2, m=4), admm_case("wanda 2:4", "wanda-2:4", wanda=True, n=2, m=4),
    admm_case("row 50%", "row-50", sparsity=0.5),
]


# ---- SAFE's x-step over a decoder block ------------------------------------------------------------

class SafeState(NamedTuple):
    x: list
    grads: list
    anchors: list
    vs: list
    keeps: list
    exp_avgs: list
    exp_avg_sqs: list

    def clone(self):
        return SafeState(*([t.clone() for t in tensors] for tensors in self))


@functools.lru_cache(maxsize=1)
def safe_state(shapes, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    new = lambda make: [make(shape).to(device) for shape in shapes]  # noqa: E731
    x = new(lambda shape: torch.randn(shape, generator=g).to(dtype))
    return SafeState(x, new(lambda shape: (torch.randn(shape, generator=g) * 1e-3).to(dtype)),
                     [torch.empty_like(p) for p in x], new(lambda shape: torch.randn(shape, generator=g) * 0.1),
                     new(lambda shape: torch.rand(shape, generator=g) < 0.5), new(torch.zeros), new(torch.zeros))


def ours_safe_step(state, step=10):
    ops.sam_perturb_(state.x, state.grads, state.anchors, SAFE_RHO)
    ops.sam_adam_step_(*state, lr=SAFE_LR, betas=SAFE_BETAS, eps=SAFE_EPS, lam=SAFE_LAM, step=step)


def safe_step_case():
    """One SAFE x-step (spec K4–K5) over all the weights of a block at once: pyprune's two
    multi-tensor ops against eager PyTorch and against torch.optim.AdamW (foreach and fused) fed the
    penalised gradient; the gradient at the perturbed point is the same g (no model here). Bytes
    for pyprune: the ascent reads g twice and x once and writes the anchor and x; the step reads
    the anchor, g, v, keep (1 byte), m and s and writes x, m and s. Checked: one step from the same
    state lands on the same x as eager PyTorch's."""
    def build(state):
        def with_optimizer(**kind):
            optimizer = torch.optim.AdamW(state.x, lr=SAFE_LR, betas=SAFE_BETAS, eps=SAFE_EPS, weight_decay=0.0,
                                          **kind)
            return lambda: optimizer_safe_step(state, optimizer)

        def check():
            ours, theirs = state.clone(), state.clone()
            ours_safe_step(ours, step=1)
            eager_safe_step(theirs, 1)
            for p, q in zip(ours.x, theirs.x):
                assert_close(p, q, p.dtype)
        numel = sum(p.numel() for p in state.x)
        nbytes = numel * (5 * state.x[0].element_size() + 3 * state.grads[0].element_size() + 4 * 5 + 1)
        return Built({"pyprune": lambda: ours_safe_step(state), "eager": lambda: eager_safe_step(state, 10),
                      "adamw-foreach": with_optimizer(foreach=True), "adamw-fused": with_optimizer(fused=True)},
                     nbytes, check)
    return Case(SAFE_STEP, "SAFE-x-step", [("eager", "eager: _foreach_norm + per-tensor add_, penalty, Adam math"),
                                           ("adamw-foreach", "eager ascent + penalty, AdamW(foreach=True)"),
                                           ("adamw-fused", "eager ascent + penalty, AdamW(fused=True)")], build)


SAFE_CASE = safe_step_case()


def block_label(block):
    return f"block of {len(block)}: {sum(r * c for r, c in block) / 1e6:.1f}M"


# ---- collection and the test --------------------------------------------------------------------

def roles(case):
    return ["pyprune", *(role for role, _ in case.baselines)] + (["floor"] if case.floor else [])


CASE_BY_KEY = {case.key: case for case in CASES + [SAFE_CASE]}


def pytest_generate_tests(metafunc):
    """One test per dtype, shape (or the block), case and role; only names and shapes as parameters, so
    pytest-benchmark's JSON can hold them."""
    if "role" not in metafunc.fixturenames:
        return
    config = metafunc.config
    size, device = config.getoption("size"), default_device(config.getoption("device"))
    params = []
    for dtype_name in config.getoption("dtype") or DTYPES:
        for shape in SHAPES[size]:
            params += [pytest.param(dtype_name, shape, case.key, role,
                                    id=f"{dtype_name}-{shape[0]}x{shape[1]}-{case.key}-{role}")
                       for case in CASES if case.runs(device, getattr(torch, dtype_name)) for role in roles(case)]
        params += [pytest.param(dtype_name, "block", SAFE_CASE.key, role,
                                id=f"{dtype_name}-block-{SAFE_CASE.key}-{role}") for role in roles(SAFE_CASE)]
    metafunc.parametrize(("dtype_name", "shape", "case_key", "role"), params)


def test_op(benchmark, dtype_name, shape, case_key, role, device, size):
    dtype, case = getattr(torch, dtype_name), CASE_BY_KEY[case_key]
    if case is SAFE_CASE:
        built, label = case.build(safe_state(BLOCK[size], dtype, device)), block_label(BLOCK[size])
    else:
        built, label = case.build(operands(shape, dtype, device, TOKENS[size])), list(shape)
    if role == "pyprune":
        built.check()
    baselines, op = dict(case.baselines), built.op or case.op
    benchmark.group = f"{op} | {label if case is SAFE_CASE else '×'.join(map(str, shape))} | {dtype_name}"
    benchmark.extra_info.update(suite="ops", op=op, shape=label, dtype=dtype_name, device=str(device),
                                role=role, baseline=baselines.get(role), load_average=load_average())
    if role == "pyprune":
        benchmark.extra_info["bytes"] = built.nbytes
    call = synchronized(built.calls[role], device)
    if benchmark.enabled:  # one untimed warm-up call: first-call costs (library set-up, allocations)
        call()
    benchmark(call)
