"""ALPS against SparseGPT on the layer objective, on real SmolLM2-135M layers (ALPS's reconstruction-
error comparison, small).

For each chosen linear layer of block ``--block`` of the dense model: H from its inputs on the
calibration of benchmarks/safe_smollm2.py (64 x 256 random windows of Emma, seed 0), then the
relative layer error E(Ŵ)/E(0) = tr((Ŵ−W)H(Ŵ−W)ᵀ)/tr(WHWᵀ) (with the solver's 1% ridge, H
normalised as ALPS normalises it) of: magnitude on the normalised weights (ALPS's starting support,
|W_ij|·‖X_j‖), SparseGPT, ALPS's projected ADMM iterate, and ALPS after the PCG refit; per tensor at
unstructured patterns for both methods (their defaults). Every method sees the same dense inputs.
Results: benchmarks/results/alps-layers-smollm2-135m.{json,md}, rewritten after every row; a rerun
with the same settings resumes.

    python benchmarks/alps_layers_smollm2.py
"""
import argparse
import copy
import os
import sys
import time

import torch

from _common import environment, merge_rows, previous_result, write_atomic, write_json
import pyprune.methods
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.methods.sparsegpt import SparseGPT, _Hessian
from pyprune.patterns import parse, Unstructured
from pyprune.runtime import engine
from pyprune.runtime.layer_solver import admm_support, normalise, pcg_on_support, reconstruction_error

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PERCDAMP = 0.01


def hessians(model, calib, block, names, batch_size=8):
    """SparseGPT's H of each named linear of decoder block ``block``, on the dense model."""
    linears = engine.block_linears(engine.decoder_blocks(model)[block])
    stats = {name: _Hessian(linears[name].in_features, "cpu") for name in names}
    handles = [linears[name].register_forward_hook(lambda module, args, out, name=name: stats[name].add(args[0]))
               for name in names]
    try:
        with torch.no_grad():
            for start in range(0, calib.shape[0], batch_size):
                model(calib[start:start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return {name: linears[name] for name in names}, stats


def markdown(result) -> str:
    s, env = result["settings"], result["environment"]
    lines = ["# ALPS and SparseGPT on the layer objective, SmolLM2-135M", "",
             f"Block {s['block']} of the dense model; calibration {s['calibration']}; relative layer error "
             "E(Ŵ)/E(0) with a 1% ridge (lower is better); per tensor at unstructured patterns; "
             f"{env['device']}, {env['cpu_threads']} threads, torch {env['torch']}.", "",
             "| layer | pattern | magnitude ·‖X_j‖ | SparseGPT | ALPS ADMM (projected) | ALPS + PCG | ALPS / SparseGPT "
             "| ADMM iterations | ALPS time (s) | SparseGPT time (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['layer']} | {r['pattern']} | {r['magnitude']:.5f} | {r['sparsegpt']:.5f} | "
                     f"{r['alps_admm']:.5f} | {r['alps']:.5f} | {r['alps'] / r['sparsegpt']:.3f} | "
                     f"{r['iterations']} | {r['alps_s']:.1f} | {r['sparsegpt_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["0.5", "0.7", "2:4", "4:8"])
    parser.add_argument("--layers", nargs="+", default=["self_attn.q_proj", "mlp.up_proj", "mlp.down_proj"])
    parser.add_argument("--block", type=int, default=15)
    parser.add_argument("--output", default=os.path.join(RESULTS, "alps-layers-smollm2-135m.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=64, seqlen=256, seed=0)
    settings = {"calibration": "64 x 256 tokens of emma (seed 0)", "block": args.block}
    rows = (previous_result(args.output, settings) or {}).get("rows", [])
    linears, stats = hessians(model, calib, args.block, args.layers)

    def save():
        merge_rows(rows, (previous_result(args.output, settings) or {}).get("rows", []),
                   lambda r: (r["layer"], r["pattern"]))
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))

    for name in args.layers:
        W = linears[name].weight.detach().float()
        H, Wn, scale = normalise(stats[name].H, W, PERCDAMP)
        for spec in args.patterns:
            pattern = parse(spec)
            if isinstance(pattern, Unstructured):
                pattern = Unstructured(pattern.sparsity, "tensor")
            if any((r["layer"], r["pattern"]) == (name, str(pattern)) for r in rows):
                continue
            start = time.perf_counter()
            projected, keep, trace = admm_support(H, Wn, pattern)
            refit = pcg_on_support(H, Wn, projected, keep)
            alps_s = time.perf_counter() - start
            layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
            layer.weight.data.copy_(W)
            start = time.perf_counter()
            SparseGPT(percdamp=PERCDAMP).prune_layer(layer, copy.deepcopy(stats[name]), pattern)  # it damps H in place
            sparsegpt_s = time.perf_counter() - start
            rows.append({"layer": name, "pattern": str(pattern),
                         "magnitude": reconstruction_error(H, Wn, Wn * pattern.weight_mask(Wn)),
                         "sparsegpt": reconstruction_error(H, Wn, layer.weight.detach() * scale),
                         "alps_admm": reconstruction_error(H, Wn, projected),
                         "alps": reconstruction_error(H, Wn, refit), "iterations": trace.iterations,
                         "alps_s": alps_s, "sparsegpt_s": sparsegpt_s})
            save()
            print(name, pattern, {k: v for k, v in rows[-1].items() if k not in ("layer", "pattern")}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
