"""SparseLinear against dense F.linear, per implementation, shape, token count M, dtype and N:M pattern.

Every case (dtype, shape, pattern, M) has one benchmark of the dense ``F.linear`` on the masked
weight (cuBLAS on a GPU, MKL/oneDNN on a CPU; ``implementation`` ``F.linear``) and one per
SparseLinear backend (pyprune.nn.dispatch.BACKENDS) on the same weight, grouped by the case. A
backend's benchmark first checks its output against an fp32 dense reference (largest error relative
to the largest |output|, TOLERANCE by dtype); a backend this layer does not support for the input is
skipped with the layer's reason.

On a CPU every call takes the next of enough copies of the layer that their dense weights fill twice
the last-level cache (the ``full`` preset; ``tiny``: one copy; or ``--fill-bytes``), so each call reads
its weight from memory as a layer does inside a model's forward; a lone small layer called again and
again would run from cache and favour whichever side does more arithmetic per byte.

Recorded per benchmark: shape, M, dtype, pattern, implementation, device, the weight copies cycled, the
bytes it moves (the weight as that backend stores it, plus x and y), the dense-equivalent FLOPs
2·M·N·K, the largest relative error and the load average. ``benchmarks/report.py`` turns a run into
``sparse-linear-<device>.{json,md}`` and one ``.svg`` per dtype (speedup over dense, TFLOP/s, GB/s and,
on H100/H200, the share of the roofline), and with ``--write-dispatch`` into the dispatch table's
block of the run's environment.

    pytest benchmarks/test_sparse_linear.py --benchmark-only --size full --benchmark-json run.json
    pytest benchmarks/test_sparse_linear.py --benchmark-only --size full --shapes 4096x4096 --tokens 1 16
"""
import copy
import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from _common import default_device, load_average, synchronized

from pyprune import ops
from pyprune.nn import SparseLinear, dispatch
from pyprune.nn.tuning import last_level_cache_bytes

SHAPES = {
    "full": {"cuda": [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)],
             # LLaMA-7B's linears: 64-180 MB in fp32, larger than a CPU's last-level cache, as in real decoding
             "cpu": [(4096, 4096), (11008, 4096), (4096, 11008)]},
    "tiny": {"cuda": [(64, 128)], "cpu": [(64, 128)]},
}
TOKENS = {
    # the CPU dispatch table's token buckets (pyprune.nn.dispatch.TOKEN_BUCKETS) and a prefill past them
    "full": {"cuda": [1, 4, 16, 64, 256, 1024, 4096], "cpu": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]},
    "tiny": {"cuda": [1, 300], "cpu": [1, 300]},  # a token bucket of one and "many"
}
DTYPES = {"cuda": ["bfloat16", "float16"], "cpu": ["float32", "bfloat16"]}
PATTERNS = [(2, 4), (4, 8)]
#: Largest error allowed, relative to the largest |output| of the fp32 reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
#: The dense baseline's name among the implementations.
DENSE = "F.linear"


def fill_bytes(size, device, asked=None):
    """Bytes of weights to cycle through per case: ``asked`` (``--fill-bytes``), else twice the last-level
    cache on a CPU at full size, else 0."""
    if asked is not None:
        return asked
    return 2 * last_level_cache_bytes() if size == "full" and device.type == "cpu" else 0


def cold_copies(weight, device, fill):
    """How many copies of a layer to cycle through: on a CPU enough that their dense weights fill
    ``fill`` bytes (1 for a weight that does alone), on a GPU 1."""
    if device.type != "cpu":
        return 1
    return max(1, math.ceil(fill / (weight.numel() * weight.element_size())))


@functools.lru_cache(maxsize=1)  # a case's dense layers, kept while its implementations run
def dense_layers(shape, dtype, pattern, device, fill):
    out_features, in_features = shape
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    dense = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(w * ops.score_nm_mask(w, *pattern))
    return [dense] + [copy.deepcopy(dense) for _ in range(cold_copies(dense.weight, device, fill) - 1)]


@functools.lru_cache(maxsize=1)
def sparse_layers(shape, dtype, pattern, device, fill, backend):
    return [SparseLinear.from_dense(d, pattern, backend=backend)
            for d in dense_layers(shape, dtype, pattern, device, fill)]


def parse_shape(text):
    out_features, in_features = (int(v) for v in text.split("x"))
    return out_features, in_features


def pytest_generate_tests(metafunc):
    if "implementation" not in metafunc.fixturenames:
        return
    config = metafunc.config
    size, device = config.getoption("size"), default_device(config.getoption("device"))
    shapes = [parse_shape(s) for s in config.getoption("shapes") or []] or SHAPES[size][device.type]
    tokens = config.getoption("tokens") or TOKENS[size][device.type]
    params = [pytest.param(dtype, shape, pattern, implementation, M,
                           id=f"{dtype}-{shape[0]}x{shape[1]}-{pattern[0]}:{pattern[1]}-{implementation}-M{M}")
              for dtype in config.getoption("dtype") or DTYPES[device.type] for shape in shapes
              for pattern in PATTERNS for implementation in (DENSE, *dispatch.BACKENDS) for M in tokens]
    metafunc.parametrize(("dtype_name", "shape", "pattern", "implementation", "M"), params)


def test_sparse_linear(benchmark, request, dtype_name, shape, pattern, implementation, M, device, size):
    dtype, (out_features, in_features) = getattr(torch, dtype_name), shape
    fill = fill_bytes(size, device, request.config.getoption("fill_bytes"))
    denses = dense_layers(shape, dtype, pattern, device, fill)
    x = torch.randn(M, in_features, generator=torch.Generator().manual_seed(M)).to(dtype).to(device)
    moved = (x.numel() + M * out_features) * x.element_size()
    info = dict(suite="sparse_linear", shape=list(shape), M=M, dtype=dtype_name, pattern=f"{pattern[0]}:{pattern[1]}",
                implementation=implementation, device=str(device), weight_copies=len(denses),
                flops=2.0 * M * out_features * in_features)
    with torch.no_grad():
        if implementation == DENSE:
            turn = itertools.cycle([d.weight for d in denses])
            call = lambda: F.linear(x, next(turn))  # noqa: E731
            moved += denses[0].weight.numel() * denses[0].weight.element_size()
        else:
            layers = sparse_layers(shape, dtype, pattern, device, fill, implementation)
            reason = layers[0].unsupported_reason(implementation, x)
            if reason is not None:
                pytest.skip(f"{implementation} unavailable: {reason}")
            reference = F.linear(x.float(), denses[0].weight.float())
            scale = reference.abs().max().item() or 1.0
            info["max_rel_error"] = (layers[0](x).float() - reference).abs().max().item() / scale
            assert info["max_rel_error"] <= TOLERANCE[dtype], f"{implementation}: wrong result"
            for layer in layers:  # each copy's caches (the dense copy, a library's handle) before timing
                layer(x)
            turn = itertools.cycle(layers)
            call = lambda: next(turn)(x)  # noqa: E731
            moved += layers[0].values.numel() * layers[0].values.element_size() + layers[0].meta.numel()
        benchmark.group = f"{shape[0]}x{shape[1]} M={M} {dtype_name} {info['pattern']}"
        benchmark.extra_info.update(info, bytes=moved, load_average=load_average())
        timed = synchronized(call, device)
        if benchmark.enabled:  # one untimed warm-up call: first-call costs (library set-up, allocations)
            timed()
        benchmark(timed)
