"""pyprune's ALPS against the authors' code (mazumder-lab/ALPS ``alps.py``) on real SmolLM2-135M layers.

Both sides prune copies of the same linear layer from the same calibration inputs (block
``--block`` of the dense model on 16 x 256 random windows of Emma, seed 0): the authors'
``ALPS_prune`` (imported read-only from ``--alps-repo``; it hard-codes ``cuda:0``, so its device
moves are mapped to the CPU while it runs) with ``ALPS_admm(rho=0.1)`` as their ``llama.py`` calls
it, and ``pyprune.methods.alps``. Reported per layer and pattern: the relative layer error
E(Ŵ)/E(0) of each (with the 1% ridge, normalised as both normalise), the fraction of weights on
which the two masks agree (each side's time is in the .json only: the CPU is shared, so it is no
speed comparison). Results: benchmarks/results/crosscheck-alps.{json,md}.

    git clone https://github.com/mazumder-lab/ALPS /tmp/ALPS
    python benchmarks/crosscheck_alps.py --alps-repo /tmp/ALPS
"""
import argparse
import contextlib
import copy
import importlib.util
import os
import sys
import time

import torch

from _common import environment, write_atomic, write_json
import pyprune.methods
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.methods.alps import Alps
from pyprune.methods.sparsegpt import _Hessian
from pyprune.patterns import NM, Unstructured
from pyprune.runtime import engine
from pyprune.runtime.layer_solver import normalise, reconstruction_error

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PATTERNS = (Unstructured(0.7, "tensor"), NM(2, 4))


class _Stop(Exception):
    pass


@contextlib.contextmanager
def cpu_for_cuda():
    """Map the authors' ``.to('cuda:0')`` to the CPU and make ``torch.cuda.synchronize`` a no-op."""
    original_to, original_sync = torch.Tensor.to, torch.cuda.synchronize

    def to(self, *args, **kwargs):
        args = tuple("cpu" if isinstance(a, str) and a.startswith("cuda") else a for a in args)
        return original_to(self, *args, **kwargs)

    torch.Tensor.to, torch.cuda.synchronize = to, lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.to, torch.cuda.synchronize = original_to, original_sync


def authors_module(repo):
    spec = importlib.util.spec_from_file_location("authors_alps", os.path.join(repo, "alps.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.dev = "cpu"
    return module


def layer_inputs(model, calib, block, names):
    """Every calibration input of the named linears of decoder block ``block`` (the forward stops there)."""
    blocks = engine.decoder_blocks(model)
    linears = engine.block_linears(blocks[block])
    inputs = {name: [] for name in names}
    handles = [linears[name].register_forward_hook(lambda m, args, out, name=name: inputs[name].append(args[0]))
               for name in names]

    def stop(module, args, out):
        raise _Stop

    handles.append(blocks[block].register_forward_hook(stop))
    try:
        with torch.no_grad():
            for start in range(0, calib.shape[0], 8):
                try:
                    model(calib[start:start + 8])
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: linears[name] for name in names}, inputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alps-repo", required=True, help="a checkout of github.com/mazumder-lab/ALPS")
    parser.add_argument("--block", type=int, default=15)
    parser.add_argument("--layers", nargs="+", default=["self_attn.q_proj", "mlp.up_proj"])
    parser.add_argument("--output", default=os.path.join(RESULTS, "crosscheck-alps.json"))
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.alps_repo, "alps.py")):
        print(f"--alps-repo must be a checkout of mazumder-lab/ALPS with alps.py; got {args.alps_repo!r}",
              file=sys.stderr)
        return 2
    authors = authors_module(args.alps_repo)
    model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, "emma", nsamples=16, seqlen=256, seed=0)
    linears, inputs = layer_inputs(model, calib, args.block, args.layers)
    rows = []
    for name in args.layers:
        dense = linears[name]
        stats = _Hessian(dense.in_features, "cpu")
        for x in inputs[name]:
            stats.add(x)
        H, Wn, scale = normalise(stats.H, dense.weight.detach(), 0.01)
        for pattern in PATTERNS:
            theirs = copy.deepcopy(dense)
            start = time.perf_counter()
            with cpu_for_cuda(), torch.no_grad():
                solver = authors.ALPS_prune(theirs, nsamples=calib.shape[0], seqlen=calib.shape[1])
                for x in inputs[name]:
                    solver.add_batch(x, theirs(x))
                nm = (pattern.n, pattern.m) if isinstance(pattern, NM) else (0, 0)
                solver.ALPS_admm(sp=pattern.sparsity, nm_n=nm[0], nm_m=nm[1], rho=0.1)
            theirs_s = time.perf_counter() - start
            ours = copy.deepcopy(dense)
            start = time.perf_counter()
            Alps().prune_layer(ours, copy.deepcopy(stats), pattern)
            ours_s = time.perf_counter() - start
            w_theirs, w_ours = theirs.weight.detach(), ours.weight.detach()
            rows.append({"layer": name, "pattern": str(pattern),
                         "error_authors": reconstruction_error(H, Wn, w_theirs * scale),
                         "error_pyprune": reconstruction_error(H, Wn, w_ours * scale),
                         "mask_agreement": float(((w_theirs != 0) == (w_ours != 0)).float().mean()),
                         "sparsity_authors": float((w_theirs == 0).float().mean()),
                         "sparsity_pyprune": float((w_ours == 0).float().mean()),
                         "authors_s": theirs_s, "pyprune_s": ours_s})
            print(rows[-1], flush=True)
    result = {"settings": {"calibration": "16 x 256 tokens of emma (seed 0)", "block": args.block},
              "environment": environment(torch.device("cpu")), "rows": rows}
    write_json(args.output, result)
    lines = ["# ALPS: pyprune against the authors' code (mazumder-lab/ALPS), SmolLM2-135M layers", "",
             f"Block {args.block} of the dense model, 16 x 256 Emma tokens; relative layer error E(Ŵ)/E(0) with the "
             "1% ridge (lower is better); per tensor at 70%.", "",
             "| layer | pattern | error, authors | error, pyprune | masks agree | sparsity authors / pyprune |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['layer']} | {r['pattern']} | {r['error_authors']:.5f} | {r['error_pyprune']:.5f} | "
              f"{r['mask_agreement']:.4f} | {r['sparsity_authors']:.4f} / {r['sparsity_pyprune']:.4f} |" for r in rows]
    write_atomic(os.path.splitext(args.output)[0] + ".md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
