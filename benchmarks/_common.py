"""What the speed and memory benchmarks share: the model stand-ins, the device and GPU-synchronised
calls, the machine record without when (for pytest-benchmark's JSON) and rooflines. The machine
record itself (:func:`pyprune.nn.dispatch.environment_record`), atomic writes and the SVG plot are
the package's; the studies live in :mod:`pyprune.studies`."""
import os

import torch

from pyprune.nn.dispatch import environment_record as environment

#: Dense bf16/fp16 tensor-core FLOP/s and HBM bytes/s (kernel-landscape.md §1), by a substring of
#: torch.cuda.get_device_name, most specific first; other devices get no roofline.
ROOFLINES = [("H100 PCIe", {"flops": 756e12, "bytes": 2.0e12}),
             ("H100 80GB HBM3", {"flops": 989.4e12, "bytes": 3.35e12}),
             ("H200", {"flops": 989.4e12, "bytes": 4.8e12})]


#: Random-weight stand-ins with real models' per-layer shapes (speed depends on shapes, not weights):
#: LLaMA-7B, SmolLM2-135M (all 30 layers) for machines without its cache (a GPU lease carries 64 MiB),
#: and a tiny one for tests. The depth of the others is the run's choice.
MODEL_SHAPES = {
    "llama-7b-shape": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                           num_attention_heads=32, num_key_value_heads=32),
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                               tie_word_embeddings=True),
    "tiny-llama-shape": dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2),
}


def default_device(name=None):
    """The device ``name`` (cpu, cuda), else cuda where available, else cpu."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def synchronized(fn, device):
    """``fn``, followed on a GPU by a synchronize: a wall-clock timer then times the kernels it launched."""
    if device.type != "cuda":
        return fn

    def call(*args):
        out = fn(*args)
        torch.cuda.synchronize(device)
        return out
    return call


def random_model(name, layers, dtype, device):
    """A LlamaForCausalLM of ``MODEL_SHAPES[name]`` with ``layers`` decoder layers, random weights (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = dict(num_hidden_layers=layers, max_position_embeddings=4096)
    fields.update(MODEL_SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**fields)).to(dtype).eval()


def build_model(name, layers, dtype, device):
    """A MODEL_SHAPES stand-in, else the model ``name`` (an alias or a directory) loaded."""
    if name in MODEL_SHAPES:
        return random_model(name, layers, dtype, device)
    from pyprune.inputs.models import load_model
    model, _ = load_model(name, dtype=dtype, device=str(device))
    return model


@torch.no_grad()
def prefill(model, tokens):
    """One forward over ``tokens`` without a KV cache: the logits."""
    return model(input_ids=tokens, use_cache=False).logits


def load_average():
    """The 1, 5 and 15 minute load averages (None where the OS does not say)."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_record(device):
    """The machine and library versions of :func:`environment` without when (its timestamp, the load
    average): what stays the same between runs on one machine, so pytest-benchmark's JSON keeps it as
    ``machine_info["pyprune"]`` and ``--benchmark-compare`` finds two runs of a machine alike."""
    info = environment(device)
    del info["timestamp"]
    if "cpu" in info:
        info["cpu"] = {key: value for key, value in info["cpu"].items() if key != "load_average"}
    return info


def roofline(device):
    """{"flops", "bytes"} peaks of ``device`` when known (NVIDIA H100/H200), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks for key, peaks in ROOFLINES if key in name), None)
