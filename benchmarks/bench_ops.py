"""Benchmark every pyprune op against the eager PyTorch a user would otherwise write.

Each row is one op on one shape: pyprune's time (the implementation PyTorch dispatches to for the
device), a named baseline's time measured in the same process, and their ratio. Results go to JSON (with the
device, versions and thread count) and a markdown table beside it.

    python benchmarks/bench_ops.py                    # LLaMA-7B shapes on the default device
    python benchmarks/bench_ops.py --quick            # small shapes, a smoke run
"""
import argparse
import itertools
import math
import os
import sys

import torch
import torch.nn.functional as F
from _common import environment, roofline, timed, write_atomic, write_json

from pyprune import ops
from pyprune.ops.conventions import sparse24_mma_meta

LLAMA7B_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
QUICK_SHAPES = [(512, 1024), (1024, 512)]
#: The seven weights of a decoder block, q/k/v/o, gate/up, down (LLaMA-7B: h 4096, FFN 11008).
LLAMA7B_BLOCK = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
QUICK_BLOCK = [(256, 256)] * 4 + [(688, 256)] * 2 + [(256, 688)]
SAFE_STEP = "SAFE x-step (sam_perturb_ + sam_adam_step_)"
#: SAFE's LLM setting (spec §1.13): ρ = 2e-4, Adam lr 2e-4, β = (0.9, 0.95), no weight decay, λ = 1e-3.
SAFE_RHO, SAFE_LR, SAFE_BETAS, SAFE_EPS, SAFE_LAM = 2e-4, 2e-4, (0.9, 0.95), 1e-8, 1e-3


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


def eager_wanda_nm_mask(w, sqnorm, n, m):
    return vectorised_topk_nm_mask(w.float().abs() * sqnorm.sqrt(), n, m)


def eager_topk_row_mask(scores, sparsity):
    keep = int((1 - sparsity) * scores.shape[1] + 0.5)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(1, torch.topk(scores.float(), keep, dim=1)[1], True)


def eager_topk_tensor_mask(scores, sparsity):
    keep = int((1 - sparsity) * scores.numel() + 0.5)
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    return mask.scatter_(0, torch.topk(scores.float().reshape(-1), keep)[1], True).reshape(scores.shape)


def eager_wanda_topk_row_mask(w, sqnorm, sparsity):
    return eager_topk_row_mask(w.float().abs() * sqnorm.sqrt(), sparsity)


def eager_group_soft_threshold(x, alpha):
    norm = x.float().norm(dim=1, keepdim=True)
    return (x.float() * (1 - alpha / norm).clamp_min(0)).to(x.dtype)


def eager_sqnorm(acc, x):
    acc += x.float().pow(2).sum(dim=0)
    return acc


def eager_compress(w, mask, n, m):
    return w[mask].reshape(w.shape[0], -1), mask


def eager_moreau_step(delta, grad, weight, perturbed, decay, step_size, threshold, group_dim,
                      noise_ratio):
    """MoreauPruner's step as eager PyTorch: update, group norms and scale, a stored noise tensor."""
    d = decay * delta - step_size * grad.float()
    if threshold > 0:
        norm = d.norm(dim=1 - group_dim, keepdim=True)
        d = d * (1 - threshold / norm).clamp_min(0)
    delta.copy_(d)
    w = weight.float()
    noise = torch.randn_like(w) * noise_ratio * w.abs()
    perturbed.copy_(w + delta + noise)


def eager_decompress(values, meta, n, m):
    """Dense W ⊙ mask from the compressed form: unpack the mask bits, scatter the kept values."""
    rows, cols = values.shape[0], meta.shape[1] * 8
    bits = (meta.unsqueeze(-1) >> torch.arange(8, device=meta.device, dtype=torch.uint8)) & 1
    mask = bits.reshape(rows, -1)[:, :cols].bool()
    out = torch.zeros(rows, cols, dtype=values.dtype, device=values.device)
    out[mask] = values.reshape(-1)
    return out


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


def eager_safe_step(x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, step):
    """SAFE's x-step as eager PyTorch: the ascent, then per tensor the penalty and Adam's math as
    torch.optim.Adam's single-tensor path writes it."""
    beta1, beta2 = SAFE_BETAS
    eager_sam_perturb(x, grads, anchors, SAFE_RHO)
    gs = eager_restore_and_penalised_grads(x, grads, anchors, vs, keeps, SAFE_LAM)
    for p, G, m, s in zip(x, gs, exp_avgs, exp_avg_sqs):
        m.mul_(beta1).add_(G, alpha=1 - beta1)
        s.mul_(beta2).addcmul_(G, G, value=1 - beta2)
        denom = (s.sqrt() / math.sqrt(1 - beta2 ** step)).add_(SAFE_EPS)
        p.addcdiv_(m, denom, value=-SAFE_LR / (1 - beta1 ** step))


def optimizer_safe_step(x, grads, anchors, vs, keeps, optimizer):
    """SAFE's x-step with torch.optim: the eager ascent and penalty, G handed to the optimizer."""
    eager_sam_perturb(x, grads, anchors, SAFE_RHO)
    for p, G in zip(x, eager_restore_and_penalised_grads(x, grads, anchors, vs, keeps, SAFE_LAM)):
        p.grad = G
    optimizer.step()


def safe_block_cases(shapes, dtype, device):
    """One SAFE x-step (spec K4–K5) over all the weights of a block at once: pyprune's two
    multi-tensor ops against eager PyTorch and against torch.optim.AdamW (foreach and fused) fed the
    penalised gradient; the gradient at the perturbed point is the same g (no model here). Bytes
    for pyprune: the ascent reads g twice and x once and writes the anchor and x; the step reads
    the anchor, g, v, keep (1 byte), m and s and writes x, m and s."""
    g = torch.Generator(device="cpu").manual_seed(1)
    new = lambda make: [make(shape).to(device) for shape in shapes]  # noqa: E731
    x = new(lambda shape: torch.randn(shape, generator=g).to(dtype))
    grads = new(lambda shape: (torch.randn(shape, generator=g) * 1e-3).to(dtype))
    anchors = [torch.empty_like(p) for p in x]
    vs = new(lambda shape: torch.randn(shape, generator=g) * 0.1)
    keeps = new(lambda shape: torch.rand(shape, generator=g) < 0.5)
    exp_avgs = new(torch.zeros)
    exp_avg_sqs = new(torch.zeros)

    def ours():
        ops.sam_perturb_(x, grads, anchors, SAFE_RHO)
        ops.sam_adam_step_(x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr=SAFE_LR, betas=SAFE_BETAS,
                           eps=SAFE_EPS, lam=SAFE_LAM, step=10)

    def with_optimizer(**kind):
        optimizer = torch.optim.AdamW(x, lr=SAFE_LR, betas=SAFE_BETAS, eps=SAFE_EPS, weight_decay=0.0, **kind)
        return lambda: optimizer_safe_step(x, grads, anchors, vs, keeps, optimizer)

    numel = sum(p.numel() for p in x)
    nbytes = numel * (5 * x[0].element_size() + 3 * grads[0].element_size() + 4 * 5 + 1)
    out = [(SAFE_STEP, "eager: _foreach_norm + per-tensor add_, penalty, Adam math", ours,
            lambda: eager_safe_step(x, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, 10), nbytes)]
    for kind in ("foreach", "fused"):
        out.append((SAFE_STEP, f"eager ascent + penalty, AdamW({kind}=True)", ours, with_optimizer(**{kind: True}),
                    nbytes))
    return out


# ---- the cases -----------------------------------------------------------------------------

def byte_floor(source):
    """The least a mask op can cost: read its input once and write one byte per element (a
    comparison into a preallocated bool tensor, at the machine's streaming bandwidth)."""
    out = torch.empty(source.shape, dtype=torch.bool, device=source.device)
    return lambda: torch.ne(source, 0, out=out)


def cases(shape, dtype, device, quick):
    """(op, baseline name, pyprune call, baseline call, bytes moved by the op[, byte floor call])."""
    rows, cols = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype).to(device)
    scores = w.float().abs()
    sqnorm = (torch.rand(cols, generator=g) + 0.1).to(device)
    x = torch.randn(2048 if not quick else 256, cols, generator=g).to(dtype).to(device)
    el = w.element_size()
    mask24 = ops.score_nm_mask(w, 2, 4)
    values, meta = ops.nm_compress(w, mask24, 2, 4)
    out = []
    for n, m in ((2, 4), (4, 8)):
        out.append((f"nm_mask {n}:{m}", "python loop of topk+scatter_",
                    lambda n=n, m=m: ops.nm_mask(scores, n, m), lambda n=n, m=m: loop_nm_mask(scores, n, m),
                    scores.numel() * 5))
        out.append((f"nm_mask {n}:{m}", "vectorised torch.topk",
                    lambda n=n, m=m: ops.nm_mask(scores, n, m),
                    lambda n=n, m=m: vectorised_topk_nm_mask(scores, n, m), scores.numel() * 5,
                    byte_floor(scores)))
        out.append((f"score_nm_mask wanda {n}:{m}", "eager score + torch.topk",
                    lambda n=n, m=m: ops.score_nm_mask(w, n, m, sqnorm),
                    lambda n=n, m=m: eager_wanda_nm_mask(w, sqnorm, n, m), w.numel() * (el + 1), byte_floor(w)))
    out += [
        ("topk_mask row 50%", "torch.topk + scatter_", lambda: ops.topk_mask(scores, 0.5),
         lambda: eager_topk_row_mask(scores, 0.5), scores.numel() * 5, byte_floor(scores)),
        ("topk_mask tensor 50%", "torch.topk + scatter_ (flattened)",
         lambda: ops.topk_mask(scores, 0.5, "tensor"), lambda: eager_topk_tensor_mask(scores, 0.5),
         scores.numel() * 5, byte_floor(scores)),
        ("score_topk_mask wanda row 50%", "eager score + torch.topk + scatter_",
         lambda: ops.score_topk_mask(w, 0.5, "row", sqnorm), lambda: eager_wanda_topk_row_mask(w, sqnorm, 0.5),
         w.numel() * (el + 1), byte_floor(w)),
        ("soft_threshold", "eager sign·clamp in fp32", lambda: ops.soft_threshold(w, 0.5),
         lambda: (w.float().sign() * (w.float().abs() - 0.5).clamp_min(0)).to(w.dtype), w.numel() * el * 2),
        ("group_soft_threshold rows", "eager norm/clamp/mul",
         lambda: ops.group_soft_threshold(w, 1.0, 0), lambda: eager_group_soft_threshold(w, 1.0),
         w.numel() * el * 3),
        ("accumulate_sqnorm_", "eager pow+sum", lambda: ops.accumulate_sqnorm_(torch.zeros(cols, device=device), x),
         lambda: eager_sqnorm(torch.zeros(cols, device=device), x), x.numel() * x.element_size()),
        ("nm_compress 2:4", "boolean indexing", lambda: ops.nm_compress(w, mask24, 2, 4),
         lambda: eager_compress(w, mask24, 2, 4), w.numel() * (el + 1) + values.numel() * el),
        ("nm_linear 2:4 M=16", "dense F.linear", lambda: ops.nm_linear(x[:16], values, meta, 2, 4),
         lambda: F.linear(x[:16], w), values.numel() * el + meta.numel()),
    ]
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(device) >= (8, 0)):  # sparse tensor cores
        mma_meta = sparse24_mma_meta(meta, cols)
        out.append(("sparse24_linear M=16", "dense F.linear",
                    lambda: ops.sparse24_linear(x[:16], values, mma_meta), lambda: F.linear(x[:16], w),
                    values.numel() * el + mma_meta.numel() * mma_meta.element_size()))
        out.append(("sparse24_compress", "boolean indexing + sparse24_mma_meta",
                    lambda: ops.sparse24_compress(w, mask24),
                    lambda: (eager_compress(w, mask24, 2, 4), sparse24_mma_meta(meta, cols)),
                    w.numel() * (el + 1) + values.numel() * el + mma_meta.numel() * mma_meta.element_size()))
    out += score_cases(w, sqnorm)
    out.append(("nm_decompress 2:4", "unpack bits + boolean scatter",
                lambda: ops.nm_decompress(values, meta, 2, 4), lambda: eager_decompress(values, meta, 2, 4),
                w.numel() * el + values.numel() * el + meta.numel()))
    out += moreau_cases(w, g)
    in_index = torch.arange(0, cols, 2, device=device)
    out.append(("sliced_linear half inputs M=16", "index_select + F.linear",
                lambda: ops.sliced_linear(x[:16, :cols // 2], w, in_index=in_index),
                lambda: F.linear(x[:16, :cols // 2], w.index_select(1, in_index)), w.numel() * el // 2))
    out.append(abs_outer_case(shape, x, g))
    out += channel_penalty_cases(w, g)
    out += admm_cases(w, sqnorm, g)
    return out


def eager_admm_dual_update(v, keep, x, n=None, m=None, sparsity=None, act_sqnorm=None):
    """SAFE's dual update as eager PyTorch: v = x + v⊙¬keep, the score, the mask by torch.topk +
    scatter_ (per group of m, or per row), then ‖x − v⊙keep‖²."""
    v.copy_(x.float() + v * ~keep)
    scores = v.abs() if act_sqnorm is None else v.abs() * act_sqnorm.sqrt()
    keep.copy_(vectorised_topk_nm_mask(scores, n, m) if m else eager_topk_row_mask(scores, sparsity))
    return (x.float() - v * keep).square().sum()


def score_cases(w, sqnorm):
    """The per-element scores in fp32 (magnitude, Wanda, Taylor with a gradient of w's dtype).
    Bytes: the operands read once, the fp32 score written once."""
    grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(w.dtype).to(w.device)
    el = w.element_size()
    return [("magnitude_score", "w.float().abs()", lambda: ops.magnitude_score(w), lambda: w.float().abs(),
             w.numel() * (el + 4)),
            ("wanda_score", "eager |w|·sqrt(sqnorm)", lambda: ops.wanda_score(w, sqnorm),
             lambda: w.float().abs() * sqnorm.sqrt(), w.numel() * (el + 4)),
            ("taylor_score", "eager (w·grad).abs() in fp32", lambda: ops.taylor_score(w, grad),
             lambda: (w.float() * grad.float()).abs(), w.numel() * (2 * el + 4))]


def admm_cases(w, sqnorm, g):
    """admm_dual_update_ (SAFE's z- and u-step, x = w) at 2:4 by |v|, 2:4 by the Wanda score
    (SAFE⁺) and 50% per row, each op on its own (v, keep) state carried across the timed calls.
    Bytes: x read, v (fp32) and keep (1 byte) read and written, once each."""
    v = torch.randn(w.shape, generator=g).to(w.device) * 0.1
    keep = ops.score_nm_mask(v, 2, 4)
    ours_state, eager_state = (v.clone(), keep.clone()), (v.clone(), keep.clone())
    out = []
    for label, kwargs in (("2:4", dict(n=2, m=4)), ("wanda 2:4", dict(n=2, m=4, act_sqnorm=sqnorm)),
                          ("row 50%", dict(sparsity=0.5))):
        out.append((f"admm_dual_update_ {label}", "eager update + torch.topk + scatter_",
                    lambda kwargs=kwargs: ops.admm_dual_update_(*ours_state, w, **kwargs),
                    lambda kwargs=kwargs: eager_admm_dual_update(*eager_state, w, **kwargs),
                    w.numel() * (w.element_size() + 10)))
    return out


def channel_penalty_cases(w, g):
    """DReSS's penalty (λ = 1e-3) on the last quarter of the hidden dim, the shorter side of a
    LLaMA weight: input columns of q/k/v/gate/up ([4096, 4096], [11008, 4096]: dim 1), output rows
    of o/down ([4096, 11008]: dim 0). Bytes: the selected slices of W read and of grad read and
    written, once each (ℓ2 reads W twice; the second read is not counted)."""
    dim = 0 if w.shape[0] < w.shape[1] else 1
    hidden = w.shape[dim]
    channels = torch.arange(hidden - hidden // 4, hidden, device=w.device)
    grad = torch.randn(w.shape, generator=g).to(w.dtype).to(w.device)
    selected = channels.numel() * w.shape[1 - dim]
    return [(f"channel_penalty_ {norm} dim={dim}", "index_select + norm + index_add_",
             lambda norm=norm: ops.channel_penalty_(grad, w, channels, dim, 1e-3, norm),
             lambda norm=norm: eager_channel_penalty(grad, w, channels, dim, 1e-3, norm),
             selected * 3 * w.element_size()) for norm in ("l2", "l1")]


def abs_outer_case(shape, x, g):
    """COPAL's accumulation G [out, in] += 2·|DY|ᵀ|X| over the tokens of x, DY [tokens, out] in x's
    dtype. Bytes: DY and X read once, G read and written (a GEMM: 2·tokens·out·in FLOP)."""
    dy = torch.randn(x.shape[0], shape[0], generator=g).to(x.dtype).to(x.device)
    acc = torch.zeros(shape, device=x.device)
    return ("accumulate_abs_outer_", "eager abs().float() + addmm_",
            lambda: ops.accumulate_abs_outer_(acc, dy, x, alpha=2.0), lambda: eager_abs_outer(acc, dy, x),
            acc.numel() * 8 + (dy.numel() + x.numel()) * x.element_size())


def moreau_cases(w, g):
    """moreau_step_ with a perturbed write (γ = 2e-4, ρ = 0.2 as in the paper): plain, and -GS
    along rows and columns with the threshold at the median group norm of a first step from δ = 0.
    Bytes: δ read and written (fp32), g and W read, perturbed written, each once."""
    step_size, decay = 2e-4, 1 - 2e-4 / 0.2
    delta = torch.zeros(w.shape, device=w.device)
    grad = torch.randn(w.shape, generator=g).to(w.dtype).to(w.device)
    perturbed = torch.empty_like(w)
    out = [("moreau_perturb_", "eager W + δ + r·|W|·randn_like",
            lambda: ops.moreau_perturb_(perturbed, w, delta, noise_ratio=0.05, seed=1),
            lambda: perturbed.copy_(w.float() + delta + 0.05 * w.float().abs() * torch.randn_like(delta)),
            w.numel() * (4 + 2 * w.element_size()))]
    for label, group_dim, threshold in (("", 0, 0.0),
                                        (" GS rows", 0, step_size * w.shape[1] ** 0.5),
                                        (" GS columns", 1, step_size * w.shape[0] ** 0.5)):
        kwargs = dict(decay=decay, step_size=step_size, threshold=threshold, group_dim=group_dim,
                      noise_ratio=0.05)
        out.append((f"moreau_step_{label}", "eager PyTorch + randn_like",
                    lambda kwargs=kwargs: ops.moreau_step_(delta, grad, w, perturbed, seed=1, **kwargs),
                    lambda kwargs=kwargs: eager_moreau_step(delta, grad, w, perturbed, **kwargs),
                    w.numel() * (8 + 3 * w.element_size())))
    return out


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = QUICK_SHAPES if args.quick else LLAMA7B_SHAPES
    dtype = getattr(torch, args.dtype)
    env = environment(device)
    peaks = roofline(device)
    peak = peaks["bytes"] if peaks else None
    block = QUICK_BLOCK if args.quick else LLAMA7B_BLOCK
    selected = lambda op: not args.only or any(key in op for key in args.only)  # noqa: E731
    groups = ((list(shape), lambda shape=shape: cases(shape, dtype, device, args.quick)) for shape in shapes)
    if selected(SAFE_STEP):
        label = f"block of {len(block)}: {sum(r * c for r, c in block) / 1e6:.1f}M"
        groups = itertools.chain(groups, [(label, lambda: safe_block_cases(block, dtype, device))])
    rows = []
    for shape, make_cases in groups:
        for op, baseline, ours, theirs, nbytes, *floor in make_cases():
            if not selected(op):
                continue
            t_ours = timed(ours, device, args.repeat)
            t_base = timed(theirs, device, args.repeat)
            row = {"op": op, "shape": shape, "dtype": args.dtype, "baseline": baseline,
                   "pyprune_ms": round(t_ours * 1e3, 4), "baseline_ms": round(t_base * 1e3, 4),
                   "speedup": round(t_base / t_ours, 3), "pyprune_GBps": round(nbytes / t_ours / 1e9, 2)}
            if floor:  # a mask op: its time over reading the input and writing a byte per element
                t_floor = timed(floor[0], device, args.repeat)
                row["byte_floor_ms"] = round(t_floor * 1e3, 4)
                row["times_byte_floor"] = round(t_ours / t_floor, 2)
            if peak:
                row["pct_of_peak_bandwidth"] = round(100 * nbytes / t_ours / peak, 1)
            rows.append(row)
            print(f"{op:32s} {str(shape):14s} pyprune {row['pyprune_ms']:9.3f} ms  "
                  f"{baseline:30s} {row['baseline_ms']:9.3f} ms  x{row['speedup']}", flush=True)
    return {"environment": env, "results": rows}


def write(report, path):
    write_json(path, report)
    env = report["environment"]
    lines = [f"# pyprune ops on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['cpu_threads']} CPU threads, "
             f"native CPU kernels: {env['native_cpu_kernels']}, {env['timestamp']}", "",
             "Byte floor (mask ops): reading the op's input once and writing one byte per element "
             "(`torch.ne(input, 0, out=bool)`), timed in the same process.", "",
             "| op | shape | dtype | pyprune ms | baseline | baseline ms | speedup | GB/s | byte floor ms | × floor |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        shape = r["shape"] if isinstance(r["shape"], str) else "×".join(map(str, r["shape"]))
        lines.append(f"| {r['op']} | {shape} | {r['dtype']} | {r['pyprune_ms']} | "
                     f"{r['baseline']} | {r['baseline_ms']} | {r['speedup']}× | {r['pyprune_GBps']} | "
                     f"{r.get('byte_floor_ms', '')} | {str(r['times_byte_floor']) + '×' if 'times_byte_floor' in r else ''} |")
    write_atomic(os.path.splitext(path)[0] + ".md", "\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--only", nargs="*", help="run only ops whose name contains one of these")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/ops-<device>-<dtype>.json)")
    args = parser.parse_args(argv)
    report = run(args)
    device_tag = "cuda" if report["environment"]["device"] and not report["environment"]["device"].startswith("CPU") else "cpu"
    path = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                       f"ops-{device_tag}-{args.dtype}{'-quick' if args.quick else ''}.json")
    write(report, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
