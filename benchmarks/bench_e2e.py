"""End to end: prefill latency and decode tokens/s of a 2:4-pruned model, sparse vs dense.

Both models hold the same pruned weights (magnitude 2:4 on every decoder linear: the pattern, not
the mask's quality, sets the speed); the sparse one has its pruned linears replaced by
SparseLinear (``pyprune.nn.sparsify_``, backend from the dispatch table unless ``--backend``).
Prefill: one forward over ``--prefill`` tokens. Decode: ``--decode`` greedy steps with the KV
cache after a short prompt. Both are timed in the same process, dense first.

    python benchmarks/bench_e2e.py                          # GPU: SmolLM2-135M and a LLaMA-7B-shaped model
    python benchmarks/bench_e2e.py --device cpu --models smollm2-135m
"""
import argparse
import copy
import os
import sys

import torch
from _common import environment, timed, write_atomic, write_json

import pyprune
from pyprune.models import load_model
from pyprune.nn import SparseLinear, sparsify_

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


@torch.no_grad()
def decode(model, prompt, steps):
    out = model(input_ids=prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return token


def measure(name, args, device, dtype):
    dense = build(name, args.layers, dtype, device)
    pyprune.prune(dense, "magnitude", "2:4", progress=False)
    sparse = copy.deepcopy(dense)
    replaced = sparsify_(sparse, "2:4", backend=args.backend)
    vocab = dense.config.vocab_size
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    short_prompt = long_prompt[:, :8]
    with torch.no_grad():
        agreement = (prefill(dense, long_prompt).argmax(-1) == prefill(sparse, long_prompt).argmax(-1)).float().mean()
        layers = [m for m in sparse.modules() if isinstance(m, SparseLinear)]
        backends = {klass: sorted({m.choose_backend(torch.zeros(tokens, m.in_features, dtype=dtype, device=device))
                                   for m in layers})
                    for klass, tokens in (("decode", 1), ("prefill", args.prefill))}
    row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "sparse_layers": len(replaced),
           "backends": backends,
           "prefill_tokens": args.prefill, "decode_steps": args.decode,
           "top1_agreement_sparse_vs_dense": round(float(agreement), 4)}
    for label, model in (("dense", dense), ("sparse", sparse)):
        t_prefill = timed(lambda: prefill(model, long_prompt), device, args.repeat)
        t_decode = timed(lambda: decode(model, short_prompt, args.decode), device, args.repeat)
        t_prompt = timed(lambda: decode(model, short_prompt, 0), device, args.repeat)
        row[f"{label}_prefill_ms"] = round(t_prefill * 1e3, 3)
        row[f"{label}_decode_tok_s"] = round(args.decode / max(t_decode - t_prompt, 1e-9), 2)
    row["prefill_speedup"] = round(row["dense_prefill_ms"] / row["sparse_prefill_ms"], 3)
    row["decode_speedup"] = round(row["sparse_decode_tok_s"] / row["dense_decode_tok_s"], 3)
    print(row, flush=True)
    return row


def markdown(report):
    env = report["environment"]
    lines = [f"# End to end, 2:4 sparse vs dense, on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda')}, "
             f"{env['cpu_threads']} CPU threads, {env['timestamp']}.", "",
             "| model | dtype | sparse layers | backends | prefill tokens | dense prefill ms | sparse prefill ms "
             "| prefill speedup | dense decode tok/s | sparse decode tok/s | decode speedup | top-1 agreement |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['sparse_layers']} | {', '.join(r['backends'])} | "
                     f"{r['prefill_tokens']} | {r['dense_prefill_ms']} | {r['sparse_prefill_ms']} | "
                     f"{r['prefill_speedup']}× | {r['dense_decode_tok_s']} | {r['sparse_decode_tok_s']} | "
                     f"{r['decode_speedup']}× | {r['top1_agreement_sparse_vs_dense']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--models", nargs="*", default=None,
                        help="smollm2-135m, llama-7b-shape, smollm2-135m-shape, or a model directory")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of llama-7b-shape")
    parser.add_argument("--prefill", type=int, default=None)
    parser.add_argument("--decode", type=int, default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    args.layers = args.layers or (32 if on_gpu else 1)
    args.prefill = args.prefill or (2048 if on_gpu else 128)
    args.decode = args.decode or (128 if on_gpu else 8)
    models = args.models or (["smollm2-135m", "llama-7b-shape"] if on_gpu else ["smollm2-135m"])
    report = {"environment": environment(device),
              "settings": {"layers_of_llama_7b_shape": args.layers, "backend": args.backend},
              "results": [measure(name, args, device, dtype) for name in models]}
    stem = args.name or f"e2e-{'cuda' if on_gpu else 'cpu'}"
    write_json(os.path.join(args.output_dir, stem + ".json"), report)
    write_atomic(os.path.join(args.output_dir, stem + ".md"), markdown(report))
    print(f"wrote {os.path.join(args.output_dir, stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
