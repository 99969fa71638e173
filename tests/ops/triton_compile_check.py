"""Compile every Triton kernel pyprune launches to cubin for sm_80 and sm_90, without a GPU.

Run as a script with TRITON_INTERPRET unset (tests/test_triton_compile.py does): the kernel
wrappers in pyprune.ops.kernels are called on small CPU tensors with KernelInterface.__getitem__
patched to record each launch (kernel, arguments, autotune configs) instead of running it. Each
recorded launch is then specialised exactly as JITFunction.run would specialise it on a GPU
(Triton's own argument binder: integers divisible by 16 or equal to 1, 16-byte aligned
pointers, constexprs, options), and every distinct variant is built with triton.compile for each
target. Every wrapper is called in fp32, fp16 and bf16 on shapes whose sizes are all multiples of
16, on shapes with none, and on inputs that do not start on a 16-byte boundary; the score kinds,
N:M patterns (power-of-two m, and 3:6 whose m is padded to a power of two) and optional
arguments are rotated over that grid so that each meets every dtype and every layout (except COPAL's
abs-outer GEMM, costly to compile: four launches, its three dtypes and a mixed pair, over the
three layouts). This
catches what the CPU interpreter cannot: code that does not lower to GPU code for the launches
we make.

Of the distinct specialisations that grid yields, only representatives are compiled (see
:func:`representatives`): for each kernel and target, the fewest variants that between them show
the compiler every argument dtype, every constexpr value, each integer and pointer argument both
divisible by 16 and not, every (num_warps, num_stages) pair, and, on sm_80 and for every kernel
that calls ``tl.dot``, each dtype combination both with all pointers 16-byte aligned and without.
The rest differ from a compiled one only in a combination of those that no kernel branches on.
Prints one line per failing variant and a summary; exits non-zero if any variant fails.
"""
import argparse
import multiprocessing
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import KernelInterface, create_function_from_signature  # noqa: E402

TARGETS = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: How the tensors sit in memory: every size (and rows·cols) a multiple of 16, none of them, and
#: none of them with the inputs one element past a 16-byte boundary.
LAYOUTS = ("multiple of 16", "not a multiple of 16", "unaligned")
#: N:M groups: power-of-two m (unrolled), and 3:6 (m padded to 8 inside the tile)
NM = ((2, 4), (4, 8), (1, 2), (3, 6))
#: nm_linear needs a power-of-two m (pyprune.ops routes other m through decompress + F.linear)
NM_LINEAR = ((2, 4), (4, 8), (1, 2))
GIVEN, MAGNITUDE, WANDA, TAYLOR = 0, 1, 2, 3
MASK_KINDS = (GIVEN, MAGNITUDE, WANDA)
launches = []
VARIANTS = []


def _record(self, grid):
    return lambda *args, **kwargs: launches.append((self, args, kwargs))


def unaligned(t):
    """A copy of ``t`` whose data starts one element past a 16-byte boundary."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


def _tensor(shape, dtype, layout, rand=torch.randn):
    t = rand(shape).to(dtype)
    return unaligned(t) if layout == "unaligned" else t


def _rotate(options, d, l, count=1):
    """``count`` of ``options`` for the d-th dtype and l-th layout, rotated (a Latin square) so
    that across the DTYPES × LAYOUTS grid every option meets every dtype and every layout."""
    return [options[(d + l + j * len(options) // count) % len(options)] for j in range(count)]


def call_wrappers():
    """Launch every kernel the way pyprune.ops does: every kernel in every dtype and layout; the
    score kinds, N:M patterns and optional arguments rotated over that grid."""
    from pyprune.ops import reference
    from pyprune.ops.kernels import admm, linear, masks, moreau, nm_format, penalty, prox, sam, scores

    for d, dtype in enumerate(DTYPES):
        for l, layout in enumerate(LAYOUTS):
            rows, cols = (64, 96) if layout == "multiple of 16" else (37, 120)
            w = _tensor((rows, cols), dtype, layout)
            act = torch.rand(cols) + 0.1
            for kind, aux in ((MAGNITUDE, None), (WANDA, act), (TAYLOR, _tensor((rows, cols), dtype, layout))):
                scores.score(w, aux, kind)
            for j, (n, m) in enumerate(NM):
                kind = MASK_KINDS[(d + l + j) % len(MASK_KINDS)]
                masks.nm_mask(w, act if kind == WANDA else None, n, m, kind)
            [kind] = _rotate(MASK_KINDS, d, l)
            masks.topk_mask(w, act if kind == WANDA else None, cols // 3, True, kind)
            masks.topk_mask(w, act if kind == WANDA else None, w.numel() // 2, False, kind)
            scores.accumulate_sqnorm_(torch.zeros(cols), w)
            prox.soft_threshold(w, 0.5)
            prox.group_soft_threshold(w, 0.5, 0)
            prox.group_soft_threshold(w, 0.5, 1)
            delta, grad = _tensor((rows, cols), torch.float32, layout), _tensor((rows, cols), dtype, layout)
            perturbed, seed = _tensor((rows, cols), dtype, layout), 7 if l % 2 == 0 else 2 ** 40 + 3
            for threshold, group_dim, with_perturbed in ((0.0, 0, l != 1), (0.1, 0, True), (0.1, 1, l != 2)):
                moreau.moreau_step_(delta, grad, w, perturbed if with_perturbed else None, 0.99, 0.1,
                                    threshold, group_dim, 0.05, seed, False)
            moreau.moreau_perturb_(perturbed, w, delta, 0.05, seed, False)
            # SAFE's dual update: x in this dtype and layout, fp32 v, bool keep; two N:M patterns
            # and a top-k scope, by |v| or by the Wanda score, rotated
            v = _tensor((rows, cols), torch.float32, layout)
            keep = _tensor((rows, cols), torch.bool, layout, rand=lambda shape: torch.rand(shape) < 0.5)
            for j, (n, m) in enumerate(_rotate(NM, d, l, count=2)):
                admm.admm_dual_update_(v, keep, w, act if (d + l + j) % 2 else None, n, m, 0, True)
            [per_row] = _rotate((True, False), d, l)
            admm.admm_dual_update_(v, keep, w, act if (d + l) % 3 else None, 0, 0,
                                   cols // 2 if per_row else w.numel() // 3, per_row)
            for n, m in _rotate(NM, d, l, count=2):
                mask = reference.nm_mask(w.float().abs(), n, m)
                values, meta = reference.nm_compress(w, mask, n, m)
                nm_format.nm_compress(w, mask, n, m)
                nm_format.nm_decompress(values, meta, n, m)
            [(n, m)] = _rotate(NM_LINEAR, d, l)
            values, meta = reference.nm_compress(w, reference.nm_mask(w.float().abs(), n, m), n, m)
            bias = torch.randn(rows).to(dtype)
            for tokens, with_bias in ((1, True), (5, False), (40, l % 2 == 0)):  # GEMV, GEMV, tl.dot
                linear.nm_linear(_tensor((tokens, cols), dtype, layout), values, meta, n, m,
                                 bias if with_bias else None, False)
            [(tokens, in_index, out_index, with_bias)] = _rotate(
                [(3, torch.arange(0, cols, 3), torch.arange(rows - 1, 0, -2), True),
                 (40, torch.arange(0, cols, 2), None, False), (40, None, None, True)], d, l)
            x = _tensor((tokens, cols if in_index is None else in_index.numel()), dtype, layout)
            linear.sliced_linear(x, w, bias if with_bias else None, in_index, out_index, False)
            # SAFE's multi-tensor x-step: x of this dtype, g of a rotated one; with every size a multiple
            # of 16 and every tensor aligned the launch is ALIGNED (16-byte vector accesses)
            shapes = [(rows, cols), (16 if layout == "multiple of 16" else 1,), (cols,)]
            [g_dtype] = _rotate(DTYPES, d, l)
            xs = [_tensor(s, dtype, layout) for s in shapes]
            gs = [_tensor(s, g_dtype, layout) for s in shapes]
            anchors = [_tensor(s, dtype, layout) for s in shapes]
            moments = [[_tensor(s, torch.float32, layout) for s in shapes] for _ in range(3)]
            keeps = [_tensor(s, torch.bool, layout, rand=torch.rand) for s in shapes]
            sam.sam_perturb_(xs, gs, anchors, 0.05, False)
            sam.sam_adam_step_(xs, gs, anchors, moments[0], keeps, moments[1], moments[2], 0.01, 0.9, 0.95,
                               1e-8, 0.1, 0.3, 3, False)
    moreau.philox_uint32(2 ** 40 + 3, torch.arange(100))  # int64 only: one launch
    # COPAL's |a|ᵀ|b| GEMM (each autotune config it keeps is a full compile, so a handful of launches):
    # one 16-bit dtype fed to tl.dot as it is, fp32, and mixed dtypes (upcast), across the layouts
    for a_dtype, b_dtype, layout in ((torch.float16, torch.float16, "not a multiple of 16"),
                                     (torch.bfloat16, torch.bfloat16, "unaligned"),
                                     (torch.float32, torch.float32, "multiple of 16"),
                                     (torch.float16, torch.bfloat16, "multiple of 16")):
        tokens, M, D = (64, 48, 96) if layout == "multiple of 16" else (37, 33, 120)
        scores.accumulate_abs_outer_(_tensor((M, D), torch.float32, layout),
                                     _tensor((tokens, M), a_dtype, layout),
                                     _tensor((tokens, D), b_dtype, layout), 2.0, False)
    # DReSS's channel penalty (autotuned too): rows and columns, ℓ1 and ℓ2, a range and a spread
    # selection, grad in the weight's dtype or another, and a 1-D weight (one row)
    for (rows, cols), dim, l1, w_dtype, g_dtype, layout, spread in (
            ((37, 120), 0, False, torch.bfloat16, torch.float32, "not a multiple of 16", False),
            ((37, 120), 1, True, torch.float16, torch.float16, "unaligned", True),
            ((64, 96), 1, False, torch.float32, torch.bfloat16, "multiple of 16", False),
            ((1, 100), 1, False, torch.float32, torch.float32, "not a multiple of 16", True)):
        extent = (rows, cols)[dim]
        channels = torch.randperm(extent)[:extent // 3] if spread else torch.arange(extent - extent // 4, extent)
        penalty.channel_penalty_(_tensor((rows, cols), g_dtype, layout), _tensor((rows, cols), w_dtype, layout),
                                 channels, dim, 0.1, l1, False)


def _launch_options(kernel, args, kwargs):
    """(jit function, [launch kwargs]) of a recorded launch: one per autotune config compiled
    (the smallest and the largest tiles the pruning leaves)."""
    if not isinstance(kernel, Autotuner):
        return kernel, [kwargs]
    pool = kernel.configs
    if kernel.early_config_prune:
        pool = kernel.early_config_prune(kernel.configs, dict(zip(kernel.fn.arg_names, args)), **kwargs)
    return kernel.fn, [dict(kwargs, **config.all_kwargs()) for config in (pool[0], pool[-1])]


def variants():
    """[(name, target, ASTSource, options)] of every distinct specialised launch and target."""
    binders, seen = {}, {}
    for kernel, args, kwargs in launches:
        fn, all_kwargs = _launch_options(kernel, args, kwargs)
        for target in TARGETS:
            backend = make_backend(target)
            key = (fn, target.arch)
            if key not in binders:
                binders[key] = create_function_from_signature(fn.signature, fn.params, backend)
            for launch_kwargs in all_kwargs:
                bound, specialization, options = binders[key](*args, **launch_kwargs)
                options, signature, constexprs, attrs = fn._pack_args(backend, launch_kwargs, bound,
                                                                      specialization, options)
                ident = (fn.__name__, target.arch, tuple(signature.items()), tuple(sorted(constexprs.items())),
                         repr(sorted(attrs.items())), repr(options))
                seen.setdefault(ident, (fn.__name__, target, ASTSource(fn, signature, constexprs, attrs),
                                        options.__dict__))
    return list(seen.values())


def _features(source, options, with_pairs):
    """What the compiler sees of one variant, as a set of facts (see the module docstring)."""
    names = list(source.signature)
    runtime = [k for k, kind in source.signature.items() if kind != "constexpr"]
    facts = {("dtype", k, source.signature[k]) for k in runtime}
    facts |= {("constexpr", names[i], repr(value)) for (i,), value in source.constants.items()}
    facts |= {("divisible by 16", k, bool(source.attrs.get((names.index(k),)))) for k in runtime}
    facts.add(("launch", options["num_warps"], options["num_stages"]))
    if with_pairs:
        pointers = [k for k in runtime if source.signature[k].startswith("*")]
        facts.add(("dtypes x aligned", tuple(source.signature[k] for k in pointers),
                   all(source.attrs.get((names.index(k),)) for k in pointers)))
    return facts


def representatives(all_variants):
    """A greedy cover: per kernel and target, variants are taken (in recording order, the one that
    adds most facts first) until every fact of :func:`_features` that any variant shows is shown."""
    groups = {}
    for variant in all_variants:
        groups.setdefault((variant[0], variant[1].arch), []).append(variant)
    chosen = []
    for (name, arch), group in groups.items():
        uses_dot = "dot(" in group[0][2].fn.src  # tl.dot, or kernels/linear.py's _dot helper
        facts = [_features(source, options, arch == 80 or uses_dot) for _, _, source, options in group]
        missing = set().union(*facts)
        while missing:
            best = max(range(len(group)), key=lambda j: (len(facts[j] & missing), -j))
            chosen.append(group[best])
            missing -= facts[best]
    return chosen


def _compile(index):
    """Build variant ``index`` of VARIANTS (by index: forked workers inherit the list)."""
    name, target, source, options = VARIANTS[index]
    try:
        triton.compile(source, target=target, options=options)
    except Exception as exc:  # report the failing variant, keep building the others
        return f"FAIL {name} sm_{target.arch} {source.constants} {source.attrs}: {exc}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    jobs = parser.parse_args().jobs
    KernelInterface.__getitem__ = _record
    call_wrappers()
    distinct = variants()
    VARIANTS.extend(representatives(distinct))
    start = time.perf_counter()
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            failures = [f for f in pool.imap_unordered(_compile, range(len(VARIANTS))) if f]
    else:
        failures = [f for f in map(_compile, range(len(VARIANTS))) if f]
    for failure in failures:
        print(failure)
    names = sorted({name for name, *_ in VARIANTS})
    print(f"compiled {len(VARIANTS) - len(failures)} of {len(VARIANTS)} representative variants (of {len(distinct)} "
          f"distinct, from {len(launches)} launches recorded) "
          f"of {len(names)} kernels in {time.perf_counter() - start:.0f} s: {', '.join(names)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
