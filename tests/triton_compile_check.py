"""Compile every Triton kernel pyprune launches to cubin for sm_80 and sm_90, without a GPU.

Run as a script with TRITON_INTERPRET unset (tests/test_triton_compile.py does): the kernel
wrappers in pyprune.kernels are called on small CPU tensors with KernelInterface.__getitem__
patched to record each launch (kernel, arguments, autotune configs) instead of running it; every
distinct launch is then built with triton.compile for each target. This catches what the CPU
interpreter cannot: code that does not lower to GPU code for the dtypes and block sizes we use.
Prints one line per compiled variant and exits non-zero on the first failure.
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

TARGETS = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.uint64: "u64"}
launches = []


def _record(self, grid):
    return lambda *args, **kwargs: launches.append((self, args, kwargs))


def call_wrappers():
    """Launch every kernel the way pyprune does. Score, mask and prox kernels differ across dtypes
    only in their loads, so they are built for bf16; the matmul kernels for every dtype."""
    from pyprune import reference
    from pyprune.kernels import linear, masks, nm_format, prox, scores

    w = torch.randn(64, 128).to(torch.bfloat16)
    act = torch.rand(128)
    for kind, aux in ((1, None), (2, act), (3, w)):
        scores.score(w, aux, kind)
    for kind, aux in ((0, None), (2, act)):
        masks.nm_mask(w, aux, 2, 4, kind)
        masks.nm_mask(w, aux, 3, 6, kind)
        masks.topk_mask(w, aux, 10, True, kind)
    scores.accumulate_sqnorm_(torch.zeros(128), w)
    prox.soft_threshold(w, 0.5)
    prox.group_soft_threshold(w, 0.5, 0)
    prox.group_soft_threshold(w, 0.5, 1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = torch.randn(64, 128).to(dtype)
        for n, m in ((2, 4), (4, 8)):
            mask = reference.nm_mask(w.float().abs(), n, m)
            values, meta = reference.nm_compress(w, mask, n, m)
            if dtype == torch.bfloat16:
                nm_format.nm_compress(w, mask, n, m)
                nm_format.nm_decompress(values, meta, n, m)
            for rows in (1, 40):
                x = torch.randn(rows, 128).to(dtype)
                linear.nm_linear(x, values, meta, n, m, torch.randn(64).to(dtype), False)
        index = torch.arange(0, 128, 2)
        linear.sliced_linear(torch.randn(3, 64).to(dtype), w, None, index, index[:20], False)


def _arg_type(value):
    if isinstance(value, torch.Tensor):
        return "*" + POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type argument {value!r}")


def variants():
    """(jit function, signature, constexprs, options) of every distinct recorded launch."""
    seen = {}
    for kernel, args, kwargs in launches:
        configs = [None]
        if isinstance(kernel, Autotuner):
            nargs = dict(zip(kernel.fn.arg_names, args))
            pool = kernel.early_config_prune(kernel.configs, nargs, **kwargs) \
                if kernel.early_config_prune else kernel.configs
            configs = [pool[0], pool[-1]]  # the smallest and the largest tiles
            kernel = kernel.fn
        for config in configs:
            values = dict(zip(kernel.arg_names, args), **kwargs, **(config.kwargs if config else {}))
            signature, constexprs = {}, {}
            for param in kernel.params:
                value = values[param.name]
                if param.is_constexpr:
                    signature[param.name], constexprs[param.name] = "constexpr", value
                else:
                    signature[param.name] = _arg_type(value)
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
            key = (kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
                   tuple(sorted(options.items())))
            seen.setdefault(key, (kernel, signature, constexprs, options))
    return list(seen.values())


def main():
    KernelInterface.__getitem__ = _record
    call_wrappers()
    built = 0
    for kernel, signature, constexprs, options in variants():
        for target in TARGETS:
            try:
                triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
            except Exception as exc:  # report which variant failed, then fail
                print(f"FAIL {kernel.__name__} sm_{target.arch} {constexprs} {options}: {exc}")
                return 1
            built += 1
    names = sorted({kernel.__name__ for kernel, *_ in variants()})
    print(f"compiled {built} variants of {len(names)} kernels: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
