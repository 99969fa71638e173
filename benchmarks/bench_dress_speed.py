"""DReSS speed: prefill latency and decode tokens/s of a model whose hidden (residual-stream)
dimension was sliced, against the dense model, in the same process.

The sliced model is a copy of the dense one with the last 25% of the hidden channels removed by
``pyprune.nn.keep_hidden_channels_`` (DReSS's slice step; which channels go does not change the
speed). Every nn.Linear loses a quarter of one dimension, so the linear FLOPs per token fall to
3/4; attention scores/context and head count do not change.

Prefill: one sequence of ``--prefill-tokens`` with ``use_cache=False``. Decode: ``--batch``
sequences of a ``--prompt-tokens`` prompt, then ``--new-tokens`` greedy steps with the KV cache;
tokens/s = batch x new tokens / (generate time - prompt-only time). Dense and sliced runs
alternate, round by round, after one warm-up each; a time is the minimum over ``--repeat`` rounds
on a CPU, the median on a GPU.

Models: ``smollm2-135m`` (the real weights; speed does not depend on their values),
``llama-7b-shape`` (LLaMA-7B's per-layer shapes, random weights, ``--layers`` decoder layers
instead of 32 to fit a CPU's memory and time), ``tiny-llama-shape`` (for tests), or a model
directory. Default dtype on a CPU is float32: on this project's AVX2 machine (no AVX512-BF16) a
512x4096 by 4096x4096 bf16 matmul ran at 7.3 GFLOP/s against 45 GFLOP/s in fp32 (1 thread).

    python benchmarks/bench_dress_speed.py         # benchmarks/results/dress-speed-cpu.{json,md}
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
from _common import MODEL_SHAPES, build_model, default_device, environment, load_average, prefill

from pyprune.files import write_json, write_text as write_atomic

from pyprune.runtime.decode import greedy_generate
from pyprune.nn.measure import model_cost
from pyprune.nn import keep_hidden_channels_

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: DReSS's default: the last quarter of the hidden channels is removed.
SLICED_FRACTION = 0.25
#: The real model a random shape stands for, and its decoder layers.
REAL_MODEL = {"llama-7b-shape": ("LLaMA-7B", 32)}


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def sliced_copy(model):
    """A copy of ``model`` without the last ``SLICED_FRACTION`` of its hidden channels."""
    sliced = copy.deepcopy(model)
    keep = round(model.config.hidden_size * (1 - SLICED_FRACTION))
    keep_hidden_channels_(sliced, torch.arange(keep))
    return sliced


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_alternately(fns, device, repeat):
    """Seconds of every ``fns[label]()``: one warm-up each, then ``repeat`` rounds running each
    once in turn, so a load change on a shared machine hits all of them alike. Returns the
    minimum per label on a CPU, the median on a GPU, and every round's times."""
    for fn in fns.values():
        fn()
    runs = {label: [] for label in fns}
    for _ in range(repeat):
        for label, fn in fns.items():
            _synchronize(device)
            begin = time.perf_counter()
            fn()
            _synchronize(device)
            runs[label].append(time.perf_counter() - begin)
    pick = statistics.median if device.type == "cuda" else min
    return {label: pick(times) for label, times in runs.items()}, runs


def measure(name, args, device, dtype):
    dense = build_model(name, args.layers, dtype, device)
    sliced = sliced_copy(dense)
    vocab = dense.config.vocab_size
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens), generator=g).to(device)
    short_prompt = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=g).to(device)
    models = {"dense": dense, "sliced": sliced}
    fns = {}
    for label, model in models.items():
        fns[f"{label}_prefill"] = lambda model=model: prefill(model, long_prompt)
        fns[f"{label}_generate"] = lambda model=model: greedy_generate(model, short_prompt, args.new_tokens + 1)
        fns[f"{label}_prompt"] = lambda model=model: greedy_generate(model, short_prompt, 1)
    best, runs = timed_alternately(fns, device, args.repeat)

    row = {"model": name, "weights": "random" if name in MODEL_SHAPES else "loaded",
           "layers": dense.config.num_hidden_layers, "real_model": REAL_MODEL.get(name),
           "dtype": str(dtype).replace("torch.", ""),
           "hidden_size": {label: m.config.hidden_size for label, m in models.items()},
           "prefill_tokens": args.prefill_tokens, "batch": args.batch,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
           "cost": {label: model_cost(m, args.prefill_tokens) for label, m in models.items()},
           "times_s": {label: [round(t, 6) for t in times] for label, times in runs.items()}}
    for label in models:
        decode_s = max(best[f"{label}_generate"] - best[f"{label}_prompt"], 1e-9)
        row[f"{label}_prefill_ms"] = round(best[f"{label}_prefill"] * 1e3, 3)
        row[f"{label}_decode_tok_s"] = round(args.batch * args.new_tokens / decode_s, 2)
    row["prefill_speedup"] = round(row["dense_prefill_ms"] / row["sliced_prefill_ms"], 3)
    row["decode_speedup"] = round(row["sliced_decode_tok_s"] / row["dense_decode_tok_s"], 3)
    cost = row["cost"]
    row["parameter_ratio"] = round(cost["dense"]["parameters"] / cost["sliced"]["parameters"], 3)
    row["flops_ratio"] = round(cost["dense"]["flops_per_token"] / cost["sliced"]["flops_per_token"], 3)
    print({k: v for k, v in row.items() if k not in ("cost", "times_s")}, flush=True)
    return row


def depth_note(row):
    """Why a random-weight stand-in has fewer layers than the model whose shapes it has, or ''."""
    if row["real_model"] is None or row["layers"] >= row["real_model"][1]:
        return ""
    real, depth = row["real_model"]
    return (f"{row['model']}: per-layer shapes are {real}'s (hidden {row['hidden_size']['dense']}, random "
            f"weights), but depth is reduced to {row['layers']} of {depth} decoder layers to fit "
            f"this machine's memory and time; the embedding and lm_head therefore weigh more in the totals "
            f"than in the full model.")


def _averages(load):
    return ", ".join(f"{x:.2f}" for x in load)


def markdown(report):
    env, s = report["environment"], report["settings"]
    lines = [f"# DReSS: hidden-sliced vs dense model speed on {env['device']}", "",
             (f"torch {env['torch']}, {env['cpu_threads']} CPU threads, {env['timestamp']}; load average "
              f"(1, 5, 15 min) {_averages(s['load_average_before'])} before and "
              f"{_averages(s['load_average_after'])} after the run (other jobs share the machine)."), "",
             (f"Sliced = the last {SLICED_FRACTION:.0%} of the hidden channels removed "
              f"(`keep_hidden_channels_`). Prefill: 1 sequence of {s['prefill_tokens']} tokens, no KV cache. "
              f"Decode: batch {s['batch']}, {s['prompt_tokens']}-token prompt, {s['new_tokens']} greedy tokens "
              f"with the KV cache (prompt time subtracted). Dense and sliced alternate in one process; "
              f"{s['statistic']} of {s['repeat']} rounds. Ratio = dense time / sliced time; parameter ratio = "
              f"dense / sliced parameters (the bound for a speedup proportional to the weights)."), "",
             ("| shape | layers | dtype | hidden | prefill dense ms | prefill sliced ms | prefill ratio "
              "| decode dense tok/s | decode sliced tok/s | decode ratio | parameters | parameter ratio "
              f"| FLOPs/token ratio ({s['prefill_tokens']} keys) |"),
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in report["results"]:
        cost = r["cost"]
        lines.append(f"| {r['model']} ({r['weights']} weights) | {r['layers']} | {r['dtype']} | "
                     f"{r['hidden_size']['dense']} → {r['hidden_size']['sliced']} | {r['dense_prefill_ms']} | "
                     f"{r['sliced_prefill_ms']} | {r['prefill_speedup']}× | {r['dense_decode_tok_s']} | "
                     f"{r['sliced_decode_tok_s']} | {r['decode_speedup']}× | "
                     f"{cost['dense']['parameters']:,} → {cost['sliced']['parameters']:,} | "
                     f"{r['parameter_ratio']}× | {r['flops_ratio']}× |")
    return "\n".join(lines + ([""] + report["notes"] if report["notes"] else [])) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-7b-shape"],
                        help=f"smollm2-135m, {', '.join(MODEL_SHAPES)}, or a model directory")
    parser.add_argument("--layers", type=positive_int, default=2,
                        help="decoder layers of the random-weight shapes (LLaMA-7B has 32)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512)
    parser.add_argument("--prompt-tokens", type=positive_int, default=16)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--name", default=None, help="output file stem (default: dress-speed-cpu|cuda)")
    args = parser.parse_args(argv)
    device = default_device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    settings = {"prefill_tokens": args.prefill_tokens, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "batch": args.batch, "repeat": args.repeat,
                "layers_of_random_shapes": args.layers, "sliced_fraction": SLICED_FRACTION,
                "statistic": "median" if device.type == "cuda" else "minimum",
                "load_average_before": load_average()}
    results = [measure(name, args, device, dtype) for name in args.models]
    settings["load_average_after"] = load_average()
    report = {"environment": environment(device), "settings": settings, "results": results,
              "notes": [note for note in map(depth_note, results) if note]}
    stem = args.name or f"dress-speed-{device.type}"
    write_json(os.path.join(args.output_dir, stem + ".json"), report)
    write_atomic(os.path.join(args.output_dir, stem + ".md"), markdown(report))
    print(f"wrote {os.path.join(args.output_dir, stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
