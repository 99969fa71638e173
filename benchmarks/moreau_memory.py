"""Peak memory of MoreauPruner's inner loop on SmolLM2-135M against Taylor's single gradient pass.

Each method runs in a fresh child process (bf16 weights, fp32-accumulated linears, 10 x 128 Emma
tokens, every layer pruned at 20%); the child's peak resident set size is read from the kernel
(``ru_maxrss``). The inner loop keeps, per pruned parameter, the original weights (model dtype),
δ (fp32) and one gradient (model dtype) beside the model itself; the expected extra bytes over
Taylor are therefore (original + δ) = (2 + 4) bytes per pruned bf16 element.

    python benchmarks/moreau_memory.py [--steps 2]

Writes benchmarks/results/moreau-memory-smollm2-135m.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

from _common import environment

from pyprune.files import write_json, write_text as write_atomic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CHILD = r"""
import json, resource, sys, torch
import pyprune
from pyprune.inputs import data
from pyprune.runtime import engine
from pyprune.studies import robustness
from pyprune.inputs.models import load_model
method, steps = sys.argv[1], int(sys.argv[2])
model, tokenizer = load_model("smollm2-135m")
model = model.to(torch.bfloat16)
calib = data.calibration_samples(tokenizer, "emma", nsamples=10, seqlen=128)
pruned = sum(p.numel() for block in engine.decoder_blocks(model)
             for linear in engine.block_linears(block).values() for p in linear.parameters())
total = sum(p.numel() for p in model.parameters())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
options = {"steps": steps} if method.startswith("moreau") else {}
with robustness.linear_arithmetic("fp32-accumulate"):
    pyprune.prune(model, method, pyprune.patterns.Structured(0.2), calib, progress=False, **options)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"method": method, "pruned_elements": pruned, "model_elements": total,
                  "rss_before_kib": before, "peak_rss_kib": after}))
"""


def run_child(method, steps):
    out = subprocess.run([sys.executable, "-c", CHILD, method, str(steps)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="Moreau steps (the peak is reached in the first)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "moreau-memory-smollm2-135m.json"))
    args = parser.parse_args(argv)
    rows = [run_child(method, args.steps) for method in ("taylor", "moreau", "moreau-gs")]
    pruned = rows[0]["pruned_elements"]
    expected_extra_mib = pruned * (2 + 4) / 2 ** 20
    for row in rows:
        row["peak_rss_mib"] = round(row["peak_rss_kib"] / 1024, 1)
        row["extra_over_taylor_mib"] = round((row["peak_rss_kib"] - rows[0]["peak_rss_kib"]) / 1024, 1)
    result = {"environment": environment(torch.device("cpu")), "steps": args.steps,
              "expected_extra_mib": round(expected_extra_mib, 1), "rows": rows}
    write_json(args.output, result)
    lines = [f"SmolLM2-135M in bf16, {pruned:,} pruned linear elements of {rows[0]['model_elements']:,}; "
             f"expected extra for originals + fp32 δ: {expected_extra_mib:.0f} MiB.", "",
             "| method | peak RSS (MiB) | over Taylor (MiB) |", "|---|---:|---:|"]
    lines += [f"| {r['method']} | {r['peak_rss_mib']:.0f} | {r['extra_over_taylor_mib']:.0f} |" for r in rows]
    write_atomic(os.path.splitext(args.output)[0] + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
