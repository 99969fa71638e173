"""End to end: prefill latency and decode tokens/s of an N:M-pruned model (2:4, 4:8), sparse vs dense.

Both models hold the same pruned weights (magnitude N:M on every decoder linear: the pattern, not
the mask's quality, sets the speed); the sparse one has its pruned linears replaced by
SparseLinear (``pyprune.nn.sparsify_``, backend from this environment's measurements, see
pyprune.nn.dispatch, unless ``--backend``).
Prefill: one forward over ``--prefill`` tokens. Decode: ``--decode`` greedy new tokens with the KV
cache after an 8-token prompt (pyprune.runtime.decode.greedy_generate, as ``pyprune generate``). Dense
and sparse run in turn ``--repeat`` times in one process; medians are reported, with the weight
memory of each model and whether both generated the same tokens. Recorded with them: the machine as
the dispatch keys it (CPU model, family / model / stepping, ISA flags, cache sizes), the load
average, and where each layer's decode and prefill backends came from (cache, prior, measured,
fallback).

    python benchmarks/bench_e2e.py                          # GPU: SmolLM2-135M and a LLaMA-7B-shaped model
    python benchmarks/bench_e2e.py --device cpu --models smollm2-135m
"""
import argparse
import copy
import os
import statistics
import sys
import time
from collections import Counter

import torch
from _common import environment, write_atomic, write_json

import pyprune
from pyprune.runtime.decode import greedy_generate
from pyprune.inputs.models import load_model
from pyprune.nn import SparseLinear, dispatch, sparsify_, tuning

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


#: Random-weight stand-ins with the real models' shapes (speed depends on shapes, not weights):
#: LLaMA-7B, and SmolLM2-135M for machines without the SmolLM2 cache (a GPU lease carries 64 MiB).
SHAPES = {
    "llama-7b-shape": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                           num_attention_heads=32, num_key_value_heads=32),
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                               tie_word_embeddings=True),
}


def random_model(name, layers, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = dict(num_hidden_layers=layers, max_position_embeddings=4096)
    fields.update(SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**fields)).to(dtype).eval()


def build(name, layers, dtype, device):
    if name in SHAPES:
        return random_model(name, layers, dtype, device)
    model, _ = load_model(name, dtype=dtype, device=str(device))
    return model


@torch.no_grad()
def prefill(model, tokens):
    return model(input_ids=tokens, use_cache=False).logits


def weight_bytes(model):
    """Bytes of parameters and buffers, plus the dense copies SparseLinear layers cached for a
    dense fallback (those are memory the sparse model really holds)."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for module in model.modules():
        if isinstance(module, SparseLinear):
            total += sum(v.numel() * v.element_size() for _, v in module._cache.values()
                         if isinstance(v, torch.Tensor))
    return total


def measure(name, pattern, where, args, device, dtype):
    dense = build(name, args.layers, dtype, device)
    pyprune.prune(dense, "magnitude", pattern, progress=False)
    sparse = copy.deepcopy(dense)
    cost_before = dict(tuning.COST)
    # "faster": as `pyprune generate` does by default, only the layers measured faster sparse at one
    # token in this environment (greedy decode) become SparseLinear; "all": every N:M linear
    replaced = sparsify_(sparse, pattern, implementation=args.backend,
                         faster_at=1 if where == "faster" else None)
    vocab = dense.config.vocab_size
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    short_prompt = long_prompt[:, :8]
    with torch.no_grad():
        agreement = (prefill(dense, long_prompt).argmax(-1) == prefill(sparse, long_prompt).argmax(-1)).float().mean()
        layers = [m for m in sparse.modules() if isinstance(m, SparseLinear)]
        backends = {klass: sorted({m.choose_implementation(torch.zeros(tokens, m.in_features, dtype=dtype, device=device))
                                   for m in layers})
                    for klass, tokens in (("decode", 1), ("prefill", args.prefill))}
    # where each converted layer's decode and prefill backends came from (pyprune.nn.dispatch.SOURCES),
    # counted and per layer, and what tuning on first use measured in this row (those answers then
    # read back as "cache")
    buckets = ("1", dispatch.token_bucket(args.prefill))
    sources = {bucket: dict(Counter(m.decisions[bucket][1] for m in layers if bucket in m.decisions))
               for bucket in buckets}
    decisions = {name: {bucket: list(m.decisions[bucket]) for bucket in buckets if bucket in m.decisions}
                 for name, m in sparse.named_modules() if isinstance(m, SparseLinear)}
    tuned = {"cases": tuning.COST["cases"] - cost_before["cases"],
             "seconds": round(tuning.COST["seconds"] - cost_before["seconds"], 3)}
    row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "pattern": pattern,
           "sparse_where": where, "sparse_layers": len(replaced), "backends": backends,
           "decision_sources": sources, "decisions": decisions, "tuned_on_first_use": tuned,
           "prefill_tokens": args.prefill, "new_tokens": args.decode, "repeats": args.repeat,
           "top1_agreement_sparse_vs_dense": round(float(agreement), 4)}
    models = {"dense": dense, "sparse": sparse}
    samples = {label: {"prefill": [], "decode": []} for label in models}
    generated = {}
    for label, model in models.items():  # warm-up (and the sparse model's caches)
        prefill(model, long_prompt)
        generated[label] = greedy_generate(model, short_prompt, 2).tokens
    for _ in range(args.repeat):  # dense and sparse in turn, so a neighbour's load hits both
        for label, model in models.items():
            begin = time.perf_counter()
            prefill(model, long_prompt)
            samples[label]["prefill"].append(time.perf_counter() - begin)
            run = greedy_generate(model, short_prompt, args.decode)
            samples[label]["decode"].append(run.decode_tokens_per_s)
            generated[label] = run.tokens
    for label, model in models.items():
        row[f"{label}_prefill_ms"] = round(statistics.median(samples[label]["prefill"]) * 1e3, 3)
        row[f"{label}_decode_tok_s"] = round(statistics.median(samples[label]["decode"]), 2)
        row[f"{label}_weight_bytes"] = weight_bytes(model)
        row[f"{label}_weight_mb"] = round(row[f"{label}_weight_bytes"] / 2**20, 1)
    row["same_generated_tokens"] = bool(torch.equal(generated["dense"], generated["sparse"]))
    row["same_new_tokens_before_divergence"] = _agreeing_new_tokens(generated)
    row["prefill_speedup"] = round(row["dense_prefill_ms"] / row["sparse_prefill_ms"], 3)
    row["decode_speedup"] = round(row["sparse_decode_tok_s"] / row["dense_decode_tok_s"], 3)
    row["load_average"] = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    print({key: value for key, value in row.items() if key != "decisions"}, flush=True)
    return row


def _agreeing_new_tokens(generated):
    """How many new tokens the sparse model generated before its first departure from the dense one."""
    dense, sparse = (generated[label][0] for label in ("dense", "sparse"))
    differ = (dense != sparse).nonzero()
    return int(differ[0, 0]) if len(differ) else int(dense.numel())


def markdown(report):
    env = report["environment"]
    cpu = env.get("cpu")
    lines = [f"# End to end, N:M sparse vs dense, on {env['device']}", "",
             f"torch {env['torch']}, {env['cpu_threads']} CPU threads, {env['timestamp']}"
             + (f"; CPU {cpu['model']}, dispatch key `{env['dispatch_device']}` ({' '.join(cpu['flags'])}; "
                f"{', '.join(f'{k} {v >> 10} KiB' for k, v in cpu['caches'].items())}; load average at the start "
                f"{cpu.get('load_average')})" if cpu else "") + ". Medians of repeats that run dense and sparse in turn; decode "
             "tokens/s over the new tokens after the first; weight memory includes any dense copy a "
             "SparseLinear caches for its dense fallback.", "",
             "| model | dtype | pattern | sparse where | sparse layers | decode / prefill backends | prefill tokens | dense prefill ms "
             "| sparse prefill ms | prefill speedup | new tokens | dense decode tok/s | sparse decode tok/s "
             "| decode speedup | same tokens (new tokens before they part) | dense MB | sparse MB | backends from (decode; prefill) "
             "| tuned here | load (1/5/15 min) |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['pattern']} | {r.get('sparse_where', 'all')} | "
                     f"{r['sparse_layers']} | "
                     f"{'+'.join(r['backends']['decode'])} / {'+'.join(r['backends']['prefill'])} | "
                     f"{r['prefill_tokens']} | {r['dense_prefill_ms']} | {r['sparse_prefill_ms']} | "
                     f"{r['prefill_speedup']}× | {r['new_tokens']} | {r['dense_decode_tok_s']} | "
                     f"{r['sparse_decode_tok_s']} | {r['decode_speedup']}× | {r['same_generated_tokens']} "
                     f"({r.get('same_new_tokens_before_divergence', '–')}) | "
                     f"{r['dense_weight_mb']} | {r['sparse_weight_mb']} | {_sources(r)} | {_tuned(r)} | "
                     f"{' '.join(str(v) for v in r.get('load_average') or [])} |")
    return "\n".join(lines) + "\n"


def _sources(row):
    """"cache 90; cache 90"-style counts of where the decode and prefill backends came from."""
    if "decision_sources" not in row:
        return "–"
    return "; ".join(", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "–"
                     for counts in row["decision_sources"].values())


def _tuned(row):
    tuned = row.get("tuned_on_first_use")
    return "–" if tuned is None else f"{tuned['cases']} cases, {tuned['seconds']} s"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--models", nargs="*", default=None,
                        help="smollm2-135m, llama-7b-shape, smollm2-135m-shape, or a model directory")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of llama-7b-shape")
    parser.add_argument("--prefill", type=int, default=None)
    parser.add_argument("--decode", type=int, default=None)
    parser.add_argument("--patterns", nargs="*", default=["2:4", "4:8"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--sparse-where", nargs="*", default=["faster"], choices=["faster", "all"],
                        help="faster (default, as pyprune generate): only the linears this environment "
                             "measured faster sparse at 1 token become SparseLinear; all: every N:M "
                             "linear; both: a row of each")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    args.layers = args.layers or (32 if on_gpu else 2)
    args.prefill = args.prefill or (2048 if on_gpu else 128)
    args.decode = args.decode or (128 if on_gpu else 64)
    models = args.models or ["smollm2-135m", "llama-7b-shape"]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"environment": environment(device),
              "settings": {"layers_of_llama_7b_shape": args.layers, "backend": args.backend,
                           "sparse_where": args.sparse_where},
              "results": [measure(name, pattern, where, args, device, dtype)
                          for name in models for pattern in args.patterns for where in args.sparse_where]}
    stem = args.name or f"e2e-{'cuda' if on_gpu else 'cpu'}"
    write_json(os.path.join(args.output_dir, stem + ".json"), report)
    write_atomic(os.path.join(args.output_dir, stem + ".md"), markdown(report))
    print(f"wrote {os.path.join(args.output_dir, stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
