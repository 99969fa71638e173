"""Where SmolLM2-135M's residual-stream energy sits: each hidden channel's share of Σx², averaged
over the hidden states the model returns with ``output_hidden_states`` (the embedding output, the
outputs of blocks 1..29 and the final norm's output; :meth:`pyprune.methods.dress.DReSS.channel_energy`,
the ranking behind DReSS's ``channels="quiet"``), on the windows DReSS ranks with: the first
``DReSS.energy_windows`` of the benchmark's Emma calibration windows. Also per layer, the share of
the top channel, and where the top channels fall among the paper's positional choices.
Results: benchmarks/results/dress-channel-energy-smollm2-135m.{json,md}; a rerun with the same
settings only rewrites the markdown from the JSON.

    python benchmarks/dress_channel_energy.py
"""
import argparse
import os
import sys

import torch

from _common import environment, previous_result, write_atomic, write_json
from pyprune.inputs import data
from pyprune.methods.dress import DReSS
from pyprune.inputs.models import load_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@torch.no_grad()
def energy_per_state(model, windows, batch_size):
    """[states, channels]: each hidden state's (embedding output, every block's output) channel
    shares of Σx² over ``windows``."""
    total = None
    for batch in windows.split(batch_size):
        states = model(input_ids=batch, output_hidden_states=True, use_cache=False).hidden_states
        sums = torch.stack([h.float().pow(2).sum((0, 1)) for h in states])
        total = sums if total is None else total + sums
    return total / total.sum(1, keepdim=True)


def measure(args, settings):
    """Measure on the model and write the JSON; returns the result."""
    model, tokenizer = load_model("smollm2-135m")
    windows = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen,
                                       seed=0)[:DReSS.energy_windows]
    energy = DReSS.channel_energy(model, windows, batch_size=8)
    per_state = energy_per_state(model, windows, batch_size=8)
    order = energy.argsort(descending=True)
    top = [{"channel": int(c), "share": float(energy[c])} for c in order[:8]]
    cumulative = energy[order].cumsum(0)
    removed = {choice: DReSS(channels=choice).pruned_channels(model.config, args.ratio, energy).tolist()
               for choice in ("quiet", "last", "first", "spread")}
    result = {"settings": settings, "environment": environment(torch.device("cpu")), "top": top,
              "channels_for_share": {str(q): int((cumulative < q).sum()) + 1 for q in (0.5, 0.9, 0.99)},
              "top_channel_share_per_state": [float(row[order[0]]) for row in per_state],
              "removed_share": {choice: float(energy[index].sum()) for choice, index in removed.items()},
              "top_channels_removed_by": {choice: [t["channel"] for t in top if t["channel"] in index]
                                          for choice, index in removed.items()}}
    write_json(args.output, result)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsamples", type=int, default=DReSS.calibration[0])
    parser.add_argument("--seqlen", type=int, default=DReSS.calibration[1])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--top", type=int, default=8, help="channels listed (at most the 8 a measurement stores)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "dress-channel-energy-smollm2-135m.json"))
    args = parser.parse_args(argv)

    settings = {"windows": f"first {DReSS.energy_windows} of {args.nsamples} x {args.seqlen} Emma windows (seed 0)",
                "ratio": args.ratio}
    result = previous_result(args.output, settings) or measure(args, settings)
    top, c = result["top"][:args.top], result["top"][0]["channel"]
    lines = ["# Residual-stream energy per hidden channel, SmolLM2-135M", "",
             f"{settings['windows']}; share of Σx², averaged over the {len(result['top_channel_share_per_state'])} "
             "hidden states of output_hidden_states (each weighs the same).", "",
             "| channel | share |", "|---:|---:|"] + [f"| {t['channel']} | {t['share']:.4f} |" for t in top]
    lines += ["", "Channels needed for a share of the energy: " + ", ".join(
        f"{float(q):.0%}: {n}" for q, n in result["channels_for_share"].items()) + ".", "",
        f"Channel {c}'s share per hidden state (the embedding output, the outputs of blocks 1..29, the final "
        "norm's output): " + ", ".join(f"{v:.3f}" for v in result["top_channel_share_per_state"]) + ".", "",
        f"| choice (ratio {args.ratio}) | energy share removed | top-8 channels removed |", "|---|---:|---|"]
    lines += [f"| {k} | {result['removed_share'][k]:.4f} | {', '.join(map(str, v)) or '–'} |"
              for k, v in result["top_channels_removed_by"].items()]
    write_atomic(os.path.splitext(args.output)[0] + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
