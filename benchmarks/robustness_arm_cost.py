"""CPU time of the robustness study's arms, measured at a small setting and scaled to the full one.

An arm of ``pyprune study robustness`` (a method variant, an arithmetic, a ratio, a calibration
seed) prunes the model in bf16 and in fp16 and, for a method with noise, once more in each of
``--noise-formats`` at the next noise seed, and evaluates each pruned model once, in fp32. Its time
is the sum of those prunes and evaluations. This script measures the CPU time (the process's, all
threads; ``time.process_time``, which a shared machine's load does not inflate as it does the wall
time, also recorded) of each prune and of one evaluation at a small setting, through the study's
own code (``robustness.prune_copy``, ``robustness.perplexity_in``): one gradient pass per prune
(Taylor; MoreauPruner with one step; SmoothGrad with one pass) at ``--nsamples`` and at twice
``--nsamples`` windows of ``--seqlen`` tokens, and ``--eval-tokens`` evaluation tokens. The two
prunes split a prune's time into a part that grows with the calibration tokens (their difference:
the gradient pass) and a fixed part (copy, format, cut). It then scales them to the full setting: a
prune is its fixed part plus ``passes`` gradient passes (Taylor 1, MoreauPruner T = 10, SmoothGrad
K = ``--smoothgrad-passes``), each linear in the calibration tokens; an evaluation is linear in
its tokens. A pass's own fixed cost is counted as the prune's, once, so a many-pass estimate errs short by it.
An arm at a further ratio of the same seed cuts the scores its first ratio kept
(``robustness.ScoreStore``) and costs its evaluations alone.

    python benchmarks/robustness_arm_cost.py [--arithmetic fp32-accumulate native] [--structure hidden]

Writes benchmarks/results/robustness-smollm2-135m-arm-cost.{json,md}.
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
    """The small setting's prune and evaluation times, each scaled to the full setting."""
    calibs = [data.calibration_samples(tokenizer, "emma", nsamples=n, seqlen=args.seqlen, seed=0)
              for n in (args.nsamples, 2 * args.nsamples)]
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    token_scale = (args.full_nsamples * args.full_seqlen) / (args.nsamples * args.seqlen)
    eval_scale = args.full_eval_tokens / tokens.numel()
    prunes, evals = [], []
    for arithmetic in args.arithmetic:
        pruned = None
        for name in robustness.FORMATS:
            for variant in args.methods:
                method, options = robustness.VARIANTS[variant]
                option, count = passes(method, args.smoothgrad_passes)
                options = {**options, "structure": args.structure, "loss_scaling": arithmetic != "rounding",
                           **({option: 1} if option else {})}
                measured = []
                for calib in calibs:
                    with timed() as seconds:
                        pruned, _, _ = robustness.prune_copy(model, name, arithmetic, method, Structured(args.ratio),
                                                              calib, 8, False, options)
                    measured.append(seconds)
                one, two = (m["measured_s"] for m in measured)
                per_pass = max(two - one, 0.0)
                fixed = max(one - per_pass, 0.0)
                prunes.append({"arithmetic": arithmetic, "format": name, "method": variant, "measured_s": one,
                               "measured_2x_s": two, "wall_s": [m["wall_s"] for m in measured], "fixed_s": fixed,
                               "pass_s": per_pass, "passes": count, "full_s": fixed + per_pass * count * token_scale})
                print(f"{arithmetic} {name} {variant}: {one:.1f} / {two:.1f} CPU s for one pass at "
                      f"{args.nsamples} / {2 * args.nsamples} windows", flush=True)
        with timed() as seconds:
            robustness.perplexity_in(pruned, "float32", arithmetic, tokens, args.eval_seqlen, 8, False)
        evals.append({"arithmetic": arithmetic, **seconds, "full_s": seconds["measured_s"] * eval_scale})
    return prunes, evals, token_scale, eval_scale


@contextlib.contextmanager
def timed():
    """A dict filled on exit with the block's CPU seconds (``measured_s``) and wall seconds (``wall_s``)."""
    seconds, cpu, wall = {}, time.process_time(), time.perf_counter()
    yield seconds
    seconds.update(measured_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)


def arms(prunes, evals, args):
    """Per arithmetic and variant: the full setting's arm at its first ratio (scored) and at a
    further ratio (cut from the kept scores), and the command over all ratios and seeds."""
    rows = []
    for arithmetic in args.arithmetic:
        evaluation = next(e["full_s"] for e in evals if e["arithmetic"] == arithmetic)
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
             f"torch {result['environment']['torch']}, load average "
             f"{', '.join(map(str, result['load_average']))} at the start. CPU time (all threads of the process; "
             f"wall time in the JSON). Measured: one gradient pass per prune at {s['nsamples']} and at "
             f"{2 * s['nsamples']} x {s['seqlen']} calibration tokens (their difference: the pass; the rest: the "
             f"prune's fixed part), one evaluation of {s['eval_tokens']} tokens; scaled to {s['full_nsamples']} x "
             f"{s['full_seqlen']} calibration tokens (the pass x{result['token_scale']:g}) times the method's "
             f"passes, and to {s['full_eval_tokens']} evaluation tokens (x{result['eval_scale']:g}).", "",
             f"| arithmetic | format | method | prune at {s['nsamples']} / {2 * s['nsamples']} windows (CPU s) | "
             "fixed (CPU s) | passes | full prune (CPU s) |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {p['arithmetic']} | {p['format']} | {p['method']} | {p['measured_s']:.1f} / {p['measured_2x_s']:.1f} | "
              f"{p['fixed_s']:.1f} | {p['passes']} | {p['full_s']:.0f} |" for p in result["prunes"]]
    lines += ["", "| arithmetic | evaluation, measured (CPU s) | full evaluation (CPU s) |", "|---|---:|---:|"]
    lines += [f"| {e['arithmetic']} | {e['measured_s']:.1f} | {e['full_s']:.0f} |" for e in result["evaluations"]]
    lines += ["", f"Per arm at the full setting (noise formats {', '.join(s['noise_formats'])}; a further ratio "
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
    parser.add_argument("--nsamples", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=512)
    parser.add_argument("--eval-seqlen", type=int, default=128)
    parser.add_argument("--full-nsamples", type=int, default=10)
    parser.add_argument("--full-seqlen", type=int, default=128)
    parser.add_argument("--full-eval-tokens", type=int, default=4096)
    parser.add_argument("--smoothgrad-passes", type=int, default=10)
    parser.add_argument("--noise-formats", nargs="+", default=list(robustness.FORMATS), choices=robustness.FORMATS)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output", default=os.path.join(RESULTS, "robustness-smollm2-135m-arm-cost.json"))
    args = parser.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    model, tokenizer = load_model(args.model)
    prunes, evals, token_scale, eval_scale = measure(model, tokenizer, args)
    settings = {key: getattr(args, key) for key in ("model", "methods", "arithmetic", "structure", "ratio", "nsamples",
                                                     "seqlen", "eval_tokens", "full_nsamples", "full_seqlen",
                                                     "full_eval_tokens", "smoothgrad_passes", "noise_formats",
                                                     "ratios", "seeds")}
    result = {"settings": settings, "environment": environment(torch.device("cpu")), "load_average": load,
              "token_scale": token_scale, "eval_scale": eval_scale, "prunes": prunes, "evaluations": evals,
              "arms": arms(prunes, evals, args)}
    write_json(args.output, result)
    text = markdown(result)
    write_text(os.path.splitext(args.output)[0] + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
