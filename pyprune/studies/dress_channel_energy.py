"""Where the residual-stream energy sits (study ``dress-channel-energy``): each hidden channel's
share of Σx², averaged over the hidden states the model returns with ``output_hidden_states`` (the
embedding output, the outputs of the blocks but the last and the final norm's output;
:meth:`pyprune.methods.dress.DReSS.channel_energy`, the ranking behind DReSS's ``channels="quiet"``),
on the windows DReSS ranks with: the first ``DReSS.energy_windows`` of study ``dress``'s Emma
calibration windows. Also per hidden state, the share of the top channel, and where the top
channels fall among the paper's positional choices. One measurement: a rerun of the same settings
keeps it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..inputs import data
from ..inputs.models import load_model
from ..methods.dress import DReSS
from ..methods.options import at_least_one, fraction, option
from ..nn.dispatch import environment_record
from .dress import CHANNELS, DEFAULT_MODEL
from .study import Arm, Study, model_label

#: the channels the measurement lists, by share
TOP = 8


@torch.no_grad()
def energy_per_state(model: nn.Module, windows: Tensor, batch_size: int) -> Tensor:
    """[states, channels]: each hidden state's (embedding output, every block's output) channel
    shares of Σx² over ``windows``."""
    total = None
    for batch in windows.split(batch_size):
        states = model(input_ids=batch, output_hidden_states=True, use_cache=False).hidden_states
        sums = torch.stack([h.float().pow(2).sum((0, 1)) for h in states])
        total = sums if total is None else total + sums
    return total / total.sum(1, keepdim=True)


def measure(model: nn.Module, windows: Tensor, ratio: float) -> dict:
    """The shares of ``model``'s hidden channels on ``windows``: the :data:`TOP` channels, how many
    channels hold 50/90/99% of the energy, the top channel's share per hidden state, and the share
    (and top channels) each positional choice of DReSS removes at ``ratio``."""
    energy = DReSS.channel_energy(model, windows, batch_size=8)
    per_state = energy_per_state(model, windows, batch_size=8)
    order = energy.argsort(descending=True)
    top = [{"channel": int(c), "share": float(energy[c])} for c in order[:TOP]]
    cumulative = energy[order].cumsum(0)
    removed = {choice: DReSS(channels=choice).pruned_channels(model.config, ratio, energy).tolist()
               for choice in CHANNELS}
    return {"environment": environment_record(torch.device("cpu")), "top": top,
            "channels_for_share": {str(q): int((cumulative < q).sum()) + 1 for q in (0.5, 0.9, 0.99)},
            "top_channel_share_per_state": [float(row[order[0]]) for row in per_state],
            "removed_share": {choice: float(energy[index].sum()) for choice, index in removed.items()},
            "top_channels_removed_by": {choice: [t["channel"] for t in top if t["channel"] in index]
                                        for choice, index in removed.items()}}


def markdown(result: dict) -> str:
    settings, top = result["settings"], result["top"]
    lines = [f"# Residual-stream energy per hidden channel, {model_label(settings)}", "",
             f"{settings['windows']}; share of Σx², averaged over the {len(result['top_channel_share_per_state'])} "
             "hidden states of output_hidden_states (each weighs the same).", "",
             "| channel | share |", "|---:|---:|"] + [f"| {t['channel']} | {t['share']:.4f} |" for t in top]
    lines += ["", "Channels needed for a share of the energy: " + ", ".join(
        f"{float(q):.0%}: {n}" for q, n in result["channels_for_share"].items()) + ".", "",
        f"Channel {top[0]['channel']}'s share per hidden state (the embedding output, the outputs of blocks 1..29, "
        "the final norm's output): " + ", ".join(f"{v:.3f}" for v in result["top_channel_share_per_state"]) + ".", "",
        f"| choice (ratio {settings['ratio']}) | energy share removed | top-8 channels removed |", "|---|---:|---|"]
    lines += [f"| {k} | {result['removed_share'][k]:.4f} | {', '.join(map(str, v)) or '–'} |"
              for k, v in result["top_channels_removed_by"].items()]
    return "\n".join(lines) + "\n"


class DressChannelEnergy(Study):
    """Each hidden channel's share of the residual stream's energy on DReSS's ranking windows, and
    what each of DReSS's channel choices removes; see :mod:`pyprune.studies.dress_channel_energy`."""

    name = "dress-channel-energy"
    summary = "each hidden channel's share of the residual-stream energy, and what each DReSS channel choice removes"
    results = "dress-channel-energy-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    nsamples: int = option(DReSS.calibration[0], "calibration windows drawn (as study dress); the first "
                           f"{DReSS.energy_windows} are measured", at_least_one)
    seqlen: int = option(DReSS.calibration[1], "calibration window length", at_least_one)
    ratio: float = option(0.25, "share of the hidden channels each choice removes", fraction)

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        windows = data.calibration_samples(tokenizer, "emma", nsamples=self.nsamples, seqlen=self.seqlen, seed=0)
        return {"model": model, "windows": windows[:DReSS.energy_windows]}

    def protocol(self, context):
        settings = {"windows": f"first {DReSS.energy_windows} of {self.nsamples} x {self.seqlen} Emma windows "
                               "(seed 0)", "ratio": self.ratio}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def start(self, settings, context):
        return {"settings": settings}

    def arms(self, context):
        return [Arm("energy", "channel energy")]

    def done(self, result, arm):
        return "top" in result

    def find(self, result, key):
        return None  # one measurement, never partial

    def record(self, result, arm, row):
        result.update(row)

    def merge(self, result, on_disk):
        """Nothing: a concurrent run of the same settings measured the same."""

    def run_arm(self, context, arm, row, checkpoint):
        return measure(context["model"], context["windows"], self.ratio)

    def describe(self, row):
        top = row["top"][0]
        return f"channel {top['channel']} holds {top['share']:.3f} of the energy"

    def markdown(self, result):
        return markdown(result)
