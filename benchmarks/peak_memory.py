"""Peak resident memory of block-wise pruning with the weights in memory and offloaded to disk
(``load_model(..., offload_dir=DIR)``, :mod:`pyprune.io.offload`), in bf16.

Every configuration runs in a fresh child process that loads the model, prunes it and saves the
result with ``pyprune.save``; its peak resident set size is the kernel's high-water mark
(``VmHWM`` of /proc/self/status, file-backed pages of memory-mapped safetensors included). Next
to it stands pyprune's own estimate (:func:`pyprune.io.memory.prune_need`), the one a run is refused
by before it starts.

Models: SmolLM2-135M (calibration: windows of Emma), and a LLaMA-7B-shaped model of random bf16
weights (32 blocks, hidden 4096, MLP 11008, 32 heads, vocabulary 32000; 13.5 GB), written under
``--work`` tensor by tensor, one safetensors shard per block, so that making it needs ~1 GB of
memory (calibration: random token ids; the tokenizer files are SmolLM2's, present only because
``load_model`` loads one). A configuration without offload whose estimate exceeds the available
memory is not run (recorded as skipped). The 7B model and every output are deleted afterwards.

    nice -n 15 python benchmarks/peak_memory.py [--models smollm2 llama7b] [--methods wanda sparsegpt]
        [--work /tmp/peak-memory]

Writes benchmarks/results/peak-memory-<model>.{json,md}, rewritten after every configuration.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from _common import environment

from pyprune.files import write_json, write_text as write_atomic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: LLaMA-7B's shapes (Touvron et al., 2023, Table 2)
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"])

CHILD = r"""
import json, os, sys, time, torch
import pyprune
from pyprune import methods
from pyprune.inputs import data
from pyprune.runtime import memory
from pyprune.inputs.models import load_model
cfg = json.loads(sys.argv[1])
def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))
start = time.perf_counter()
offload_dir = os.path.join(cfg["work"], "offload") if cfg["offload"] else None
model, tokenizer = load_model(cfg["path"], dtype=torch.bfloat16, offload_dir=offload_dir)
loaded_rss = status("VmRSS")
if cfg["calib"] == "random":
    calib = torch.randint(0, model.config.vocab_size, (cfg["nsamples"], cfg["seqlen"]),
                          generator=torch.Generator().manual_seed(0))
else:
    calib = data.calibration_samples(tokenizer, cfg["calib"], nsamples=cfg["nsamples"], seqlen=cfg["seqlen"])
need = memory.prune_need(model, methods.get(cfg["method"]), cfg["nsamples"], cfg["seqlen"], cfg["batch_size"])
report = pyprune.prune(model, cfg["method"], cfg["pattern"], calib, batch_size=cfg["batch_size"], progress=False)
pyprune.save(model, tokenizer, os.path.join(cfg["work"], "pruned"), report=report)
print(json.dumps({"peak_rss": status("VmHWM"), "rss_after_load": loaded_rss, "estimate": need.total,
                  "estimate_parts": {"weights": need.weights, "activations": need.activations,
                                     "method": need.method, "runtime": need.runtime},
                  "sparsity": report["sparsity"], "seconds": round(time.perf_counter() - start, 1)}))
"""


def make_random_llama(directory, tokenizer_dir, seed=0):
    """A LLaMA-7B-shaped model of random bf16 weights (std 0.02, norms 1), written one tensor at a
    time: one safetensors shard per block and one for the embeddings, final norm and head."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_7B)
    os.makedirs(directory)
    config.save_pretrained(directory)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), directory)
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)

    block = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden, hidden),
             "self_attn.v_proj.weight": (hidden, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
             "mlp.down_proj.weight": (hidden, inner)}
    shards = config.num_hidden_layers + 1
    weight_map, total = {}, 0
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        tensors = {prefix + name: normal(*shape) for name, shape in block.items()}
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            tensors[prefix + norm] = torch.ones(hidden, dtype=torch.bfloat16)
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, os.path.join(directory, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
    rest = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    shard = f"model-{shards:05d}-of-{shards:05d}.safetensors"
    save_file(rest, os.path.join(directory, shard), metadata={"format": "pt"})
    weight_map.update({name: shard for name in rest})
    total += sum(t.numel() * 2 for t in rest.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=1)
    return total


def run_child(cfg):
    load_before = os.getloadavg()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cfg['model']} offload={cfg['offload']} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["load_average_before"] = [round(x, 2) for x in load_before]
    row["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return row


def gib(nbytes):
    return round(nbytes / 2 ** 30, 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "llama7b"], choices=["smollm2", "llama7b"])
    parser.add_argument("--methods", nargs="+", default=["wanda", "sparsegpt"],
                        help="methods on SmolLM2 (the 7B model gets the first, the others would take hours)")
    parser.add_argument("--work", default="/tmp/peak-memory", help="where the 7B model and outputs go (deleted)")
    parser.add_argument("--results", default=RESULTS, help="directory of the results files")
    args = parser.parse_args(argv)

    from pyprune.runtime import memory
    from pyprune import methods
    from pyprune.inputs.models import resolve_model_dir
    from pyprune.io.offload import skeleton

    smollm2 = resolve_model_dir("smollm2-135m")
    settings = {
        "smollm2": dict(path=smollm2, calib="emma", nsamples=8, seqlen=128, batch_size=8),
        "llama7b": dict(path=os.path.join(args.work, "llama-7b-random"), calib="random", nsamples=2, seqlen=32,
                        batch_size=2),
    }
    os.makedirs(args.work, exist_ok=True)
    try:
        for model in args.models:
            setting = settings[model]
            output, rows = os.path.join(args.results, f"peak-memory-{model}.json"), []
            if model == "llama7b":
                started = time.perf_counter()
                size = make_random_llama(setting["path"], smollm2)
                print(f"wrote the random LLaMA-7B ({gib(size)} GiB) in {time.perf_counter() - started:.0f} s",
                      flush=True)
            for method in args.methods[:1] if model == "llama7b" else args.methods:
                for offload in (True, False):
                    cfg = dict(setting, model=model, method=method, pattern="0.5", offload=offload, work=args.work)
                    row = {key: cfg[key] for key in ("model", "method", "pattern", "offload", "calib", "nsamples",
                                                     "seqlen", "batch_size")}
                    if not offload:
                        need = memory.prune_need(skeleton(cfg["path"], torch.bfloat16), methods.get(method),
                                                 cfg["nsamples"], cfg["seqlen"], cfg["batch_size"], offloaded=False)
                        if need.total > memory.available_bytes():
                            row["skipped"] = (f"estimated {gib(need.total)} GiB > "
                                              f"{gib(memory.available_bytes())} GiB available")
                            rows.append(row)
                            write_results(output, rows)
                            continue
                    row.update(run_child(cfg))
                    shutil.rmtree(os.path.join(args.work, "pruned"), ignore_errors=True)
                    shutil.rmtree(os.path.join(args.work, "offload"), ignore_errors=True)
                    rows.append(row)
                    write_results(output, rows)
            if model == "llama7b":
                shutil.rmtree(setting["path"], ignore_errors=True)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


def write_results(output, rows):
    """The JSON rows and the Markdown table (rewritten after every configuration)."""
    write_json(output, {"environment": environment(torch.device("cpu")), "dtype": "bfloat16", "rows": rows})
    lines = ["| model | method | offload | calibration | peak RSS (GiB) | estimate (GiB) | time (s) | load avg |",
             "|---|---|---|---|---:|---:|---:|---|"]
    names = {"smollm2": "SmolLM2-135M", "llama7b": "LLaMA-7B-shaped, random"}
    for row in rows:
        calib = f"{row['nsamples']} x {row['seqlen']} ({row['calib']})"
        if "skipped" in row:
            lines.append(f"| {names[row['model']]} | {row['method']} | {'yes' if row['offload'] else 'no'} | "
                         f"{calib} | skipped: {row['skipped']} | | | |")
            continue
        lines.append(f"| {names[row['model']]} | {row['method']} | {'yes' if row['offload'] else 'no'} | {calib} | "
                     f"{gib(row['peak_rss']):.2f} | {gib(row['estimate']):.2f} | {row['seconds']:.0f} | "
                     f"{row['load_average_before'][0]:.1f} |")
    write_atomic(os.path.splitext(output)[0] + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
