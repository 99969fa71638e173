"""``pyprune tune``: measure, ahead of time, SparseLinear's kernel against dense for every N:M layer
shape of a model on this CPU, print the machine, its environment and the table with where each
answer came from, and keep the measurements in the per-user cache that
``SparseLinear(implementation="auto")``, ``sparsify_(faster_at=...)`` and ``pyprune generate`` read
(otherwise each case is measured the first time a layer meets it)."""
from __future__ import annotations

import os

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError

COMMAND = "tune"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    parser.add_argument("--model", required=True, help=flags.MODEL_HELP + "; SparseLinear layers included")
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help="token counts per forward to measure (default: every token bucket, "
                             "1 2 4 ... 256; batch size for decode, prompt length for prefill)")
    flags.add_dtype_flag(parser, "the model when it runs")  # the answers are kept per dtype and --threads
    parser.add_argument("--force", action="store_true", help="measure again the cases the cache already has")
    parser.set_defaults(run=run, device="cpu")


def run(args) -> int:
    """Measure every (dtype, pattern, shape bucket, token bucket) of --model's N:M layers this
    environment has no answer for (:func:`dispatch.answer`; all with --force), on the first layer
    of each, and print them all with their source: cache, prior or measured (a row names every
    layer shape its case answers for)."""
    import torch

    from ..files import ensure_cache_dir
    from ..nn import SparseLinear, detect_pattern, dispatch, tuning
    tokens = sorted(set(args.tokens or dispatch.TOKEN_BUCKETS))
    if tokens[0] < 1:
        raise UsageError(f"--tokens must be token counts >= 1; got {tokens[0]}")
    ensure_cache_dir(os.path.dirname(dispatch.cache_path(torch.device("cpu"))))  # where the answers go, first
    checks.check_model(args.model)
    model, _ = steps.load(args)
    groups = {}  # (pattern, shape bucket) -> [representative layer, pattern, {shape: number of layers}]
    for module in model.modules():
        if isinstance(module, SparseLinear):
            pattern, layer = module.pattern, module
        elif type(module) is torch.nn.Linear and (pattern := detect_pattern(module.weight.detach())) is not None:
            layer = module
        else:
            continue
        shape = (layer.out_features, layer.in_features)
        group = groups.setdefault((str(pattern), dispatch.shape_bucket(*shape)), [layer, pattern, {}])
        group[2][shape] = group[2].get(shape, 0) + 1
    if not groups:
        raise UsageError(f"--model {args.model} has no N:M sparse linear layers (prune it with --pattern 2:4 "
                         "or 4:8 first)")
    device, dtype = torch.device("cpu"), flags.DTYPES[args.dtype]
    env = dispatch.environment(device)
    print(f"machine {dispatch.device_key(device)}")
    print(f"environment: flags {' '.join(env['machine']['flags']) or 'none'}; last-level cache "
          f"{env['machine']['llc_bytes']} bytes; {env['threads']} threads; torch {env['torch']}; "
          f"pyprune {env['pyprune']}; native kernels {env['native_kernels']}")
    cases, seconds = tuning.COST["cases"], tuning.COST["seconds"]
    print("| layers | shape (out×in) | dtype | pattern | tokens | kernel ms | dense ms | kernel speedup | "
          "implementation | source |")
    print("|---:|---|---|---|---:|---:|---:|---:|---|---|")
    for layer, pattern, shapes in groups.values():
        sparse = layer if isinstance(layer, SparseLinear) else SparseLinear.from_dense(layer, pattern)
        count, named = sum(shapes.values()), ", ".join(f"{out}×{in_}" for out, in_ in shapes)
        for count_tokens in tokens:
            found = None if args.force else dispatch.answer(device, dtype, str(pattern), sparse.out_features,
                                                            sparse.in_features, count_tokens)
            entry, source = found or (sparse.tune(count_tokens)[0], "measured")
            speedup = entry.get("sparse_speedup_vs_dense", entry.get("sparse_geomean_speedup_vs_dense", ""))
            print(f"| {count} | {named} | {args.dtype} | {pattern} | "
                  f"{count_tokens} | {entry.get('kernel_ms', '')} | {entry.get('dense_ms', '')} | "
                  f"{speedup} | {dispatch.entry_implementation(entry)} | {source} |")
    print(f"[{tuning.COST['cases'] - cases} cases measured in {tuning.COST['seconds'] - seconds:.2f} s, "
          f"{torch.get_num_threads()} threads; cache {dispatch.cache_path(device)}]")
    return 0
