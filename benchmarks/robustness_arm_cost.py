"""CPU time of the robustness study's arms, measured at the study's calibration and counted over its passes.

An arm of ``pyprune study robustness`` (a method variant, an arithmetic, a ratio, a calibration
seed) prunes the model in bf16 and in fp16 and, for a method with noise, once more in each of
``--noise-formats`` at the next noise seed, and evaluates each pruned model once, in fp32. Its time
is the sum of those prunes and evaluations. This script measures the CPU time (the process's, all
threads; ``time.process_time``, which a shared machine's load does not inflate as it does the wall
time, also recorded) of each prune and of one evaluation through the study's own code
(``robustness.prune_copy``, ``robustness.perplexity_in``) on the study's calibration (``--nsamples``
windows of ``--seqlen`` tokens, in its batches of ``robustness.BATCH_SIZE``) and evaluation tokens: a
prune with one gradient pass and, for a method of several (MoreauPruner's T = 10 steps, SmoothGrad's
K = ``--smoothgrad-passes``), with two. Their difference is a pass; the rest is the prune's fixed part
(copy, format, cut). A prune at the study's setting is its fixed part plus its passes; Taylor's one
pass is measured whole. Nothing is scaled in tokens: a 16-bit pass on a CPU without that format's
instructions is not linear in its windows (an earlier version, which scaled from one and two
windows, overestimated native fp16 MoreauPruner prunes threefold). An arm at a further ratio of the
same seed cuts the scores its first ratio kept (``robustness.ScoreStore``) and costs its evaluations
alone.

    python benchmarks/robustness_arm_cost.py [--arithmetic fp32-accumulate native] [--methods ...] [--output ...]

Writes benchmarks/results/robustness-smollm2-135m-arm-cost.{json,md} unless told otherwise.
"""
import argparse
import contextlib
import os
import sys
import time

import torch

from _common import environment

from pyprune.files import write_json, write_text
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.patterns import Structured
from pyprune.studies import robustness

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: the option that sets a variant's gradient passes, and its value in the study
PASSES = {"taylor": (None, 1), "moreau": ("steps", 10), "moreau-gs": ("steps", 10), "smoothgrad": ("passes", None)}


def passes(method, smoothgrad_passes):
    """(option, passes in the study) of a pyprune structured method: Taylor's one gradient pass,
    MoreauPruner's T steps, SmoothGrad's K passes."""
    name, count = PASSES[method]
    return name, smoothgrad_passes if method == "smoothgrad" else count


def measure(model, tokenizer, args):
    """Each prune with one and (several passes) two gradient passes, and one evaluation, at the study's setting."""
    calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    prunes, evals = [], []
    for arithmetic in args.arithmetic:
        pruned = None
        for name in robustness.FORMATS:
            for variant in args.methods:
                method, options = robustness.VARIANTS[variant]
                option, count = passes(method, args.smoothgrad_passes)
                options = robustness.method_options(arithmetic, {**options, "structure": args.structure})
                measured = []
                for passes_run in (1, 2) if option else (1,):
                    with timed() as seconds:
                        pruned, _, _ = robustness.prune_copy(
                            model, name, arithmetic, method, Structured(args.ratio), calib, robustness.BATCH_SIZE,
                            False, {**options, **({option: passes_run} if option else {})})
                    measured.append(seconds)
                one, two = measured[0]["measured_s"], measured[-1]["measured_s"]
                per_pass = max(two - one, 0.0) if option else one
                fixed = max(one - per_pass, 0.0)
                prunes.append({"arithmetic": arithmetic, "format": name, "method": variant, "measured_s": one,
                               "measured_2_passes_s": two if option else None,
                               "wall_s": [m["wall_s"] for m in measured], "fixed_s": fixed, "pass_s": per_pass,
                               "passes": count, "full_s": fixed + per_pass * count})
                print(f"{arithmetic} {name} {variant}: {one:.1f}" + (f" / {two:.1f}" if option else "")
                      + f" CPU s for {'one / two passes' if option else 'its pass'}", flush=True)
        with timed() as seconds:
            robustness.perplexity_in(pruned, "float32", arithmetic, tokens, args.eval_seqlen, robustness.BATCH_SIZE,
                                     False)
        evals.append({"arithmetic": arithmetic, **seconds})
    return prunes, evals


@contextlib.contextmanager
def timed():
    """A dict filled on exit with the block's CPU seconds (``measured_s``) and wall seconds (``wall_s``)."""
    seconds, cpu, wall = {}, time.process_time(), time.perf_counter()
    yield seconds
    seconds.update(measured_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)


def arms(prunes, evals, args):
    """Per arithmetic and variant: the study's arm at its first ratio (scored) and at a
    further ratio (cut from the kept scores), and the command over all ratios and seeds."""
    rows = []
    for arithmetic in args.arithmetic:
        evaluation = next(e["measured_s"] for e in evals if e["arithmetic"] == arithmetic)
        for variant in args.methods:
            full = {p["format"]: p["full_s"] for p in prunes if (p["arithmetic"], p["method"]) == (arithmetic, variant)}
            noisy = robustness.VARIANTS[variant][0] != "taylor"
            again = [name for name in args.noise_formats] if noisy else []
            count = 2 + len(again)
            first = sum(full.values()) + sum(full[name] for name in again) + count * evaluation
            further = count * evaluation
            rows.append({"arithmetic": arithmetic, "method": variant, "prunes": count, "evaluations": count,
                         "first_ratio_s": first, "further_ratio_s": further,
                         "command_s": len(args.seeds) * (first + (len(args.ratios) - 1) * further)})
    return rows


def markdown(result):
    s, rows = result["settings"], result["arms"]
    threads = result["environment"]["cpu_threads"]
    lines = [f"{s['model']}, structure {s['structure']}; {result['environment']['device']}, {threads} threads, "
             f"torch {result['environment']['torch']}, CPU flags {' '.join(result['environment']['cpu']['flags'])}, "
             f"load average {', '.join(map(str, result['load_average']))} at the start. CPU time (all threads of the "
             f"process; wall time in the JSON). Measured at the study's setting ({s['nsamples']} x {s['seqlen']} "
             f"calibration tokens in batches of {result['batch_size']}, {s['eval_tokens']} evaluation tokens): "
             "each prune with one gradient pass and, for a method of several, with two (their difference: a pass; "
             "the rest: the prune's fixed part); a prune at the study's setting is its fixed part plus its passes.",
             "", "| arithmetic | format | method | prune, one / two passes (CPU s) | fixed (CPU s) | passes | "
             "study's prune (CPU s) |", "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {p['arithmetic']} | {p['format']} | {p['method']} | {p['measured_s']:.1f}"
              + (f" / {p['measured_2_passes_s']:.1f}" if p["measured_2_passes_s"] is not None else "")
              + f" | {p['fixed_s']:.1f} | {p['passes']} | {p['full_s']:.0f} |" for p in result["prunes"]]
    lines += ["", "| arithmetic | evaluation (CPU s) |", "|---|---:|"]
    lines += [f"| {e['arithmetic']} | {e['measured_s']:.1f} |" for e in result["evaluations"]]
    lines += ["", f"Per arm at the study's setting (noise formats {', '.join(s['noise_formats'])}; a further ratio "
              f"cuts the kept scores) and per command ({len(s['seeds'])} seeds x ratios "
              f"{', '.join(map(str, s['ratios']))}):", "",
              "| arithmetic | method | prunes | evaluations | arm, first ratio (CPU h) | arm, further ratio (CPU h) | "
              "command (CPU h) |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['arithmetic']} | {r['method']} | {r['prunes']} | {r['evaluations']} | "
              f"{r['first_ratio_s'] / 3600:.2f} | {r['further_ratio_s'] / 3600:.2f} | {r['command_s'] / 3600:.2f} |"
              for r in rows]
    totals = {a: sum(r["command_s"] for r in rows if r["arithmetic"] == a) for a in s["arithmetic"]}
    lines += ["", "Per command, all methods: " + "; ".join(f"{a} {t / 3600:.1f} CPU hours" for a, t in totals.items())
              + f"; with its {threads} threads fully used, the wall time is the CPU time over {threads}, more on a "
              "loaded machine."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=robustness.DEFAULT_MODEL)
    parser.add_argument("--methods", nargs="+", default=["taylor", "moreau", "smoothgrad-gradients"],
                        choices=robustness.VARIANT_NAMES)
    parser.add_argument("--arithmetic", nargs="+", default=["fp32-accumulate", "native"], choices=robustness.ARITHMETIC)
    parser.add_argument("--structure", default="hidden", choices=("groups", "hidden"))
    parser.add_argument("--ratio", type=float, default=0.1, help="the measured prunes' ratio")
    parser.add_argument("--nsamples", type=int, default=10, help="calibration windows (the study's 10)")
    parser.add_argument("--seqlen", type=int, default=128, help="calibration window length (the study's 128)")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="evaluation tokens (the study's 4096)")
    parser.add_argument("--eval-seqlen", type=int, default=128)
    parser.add_argument("--smoothgrad-passes", type=int, default=10)
    parser.add_argument("--noise-formats", nargs="+", default=list(robustness.FORMATS), choices=robustness.FORMATS)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output", default=os.path.join(RESULTS, "robustness-smollm2-135m-arm-cost.json"))
    args = parser.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    model, tokenizer = load_model(args.model)
    prunes, evals = measure(model, tokenizer, args)
    settings = {key: getattr(args, key) for key in ("model", "methods", "arithmetic", "structure", "ratio", "nsamples",
                                                     "seqlen", "eval_tokens", "eval_seqlen", "smoothgrad_passes",
                                                     "noise_formats",
                                                     "ratios", "seeds")}
    result = {"settings": settings, "environment": environment(torch.device("cpu")), "load_average": load,
              "batch_size": robustness.BATCH_SIZE, "prunes": prunes, "evaluations": evals,
              "arms": arms(prunes, evals, args)}
    write_json(args.output, result)
    text = markdown(result)
    write_text(os.path.splitext(args.output)[0] + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
