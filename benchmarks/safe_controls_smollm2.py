"""The controls of the SAFE / SAFE⁺ study on SmolLM2-135M: is ADMM + SAM the cause of the gain over
the one-shot methods, or is plain block-wise reconstruction training? Is SAM's ascent of any size,
and are SAFE⁺'s weights flatter?

Arms (``--arms``), every one on the same calibration windows and, where it trains, with the same
budget (``--train-options``, applied to every training arm alike: steps, batch, Adam betas, lr and
schedule, relative loss, minibatch seed, sequential propagation):

* ``wanda``, ``sparsegpt``: the one-shot methods;
* ``safe+`` / ``safe``: SAFE⁺ / SAFE with their CPU defaults; ``safe+ rho=0``: without SAM;
  ``safe+ rho=5e-3``: ρ scaled 25x, as the learning rate was (paper 2e-4 → 5e-3); ``safe+ dual_init=box``:
  u₀ = x₀ − z₀ (the printed box's u-step at t = 0) instead of Algorithm 1's u₀ = 0;
* ``masked-recon wanda`` / ``magnitude`` / ``sparsegpt``: the control (:mod:`pyprune.methods.reconstruction`),
  each block pruned one-shot by the start (Wanda's mask is SAFE⁺'s z₀, magnitude's SAFE's), then
  its kept weights trained with the same budget, no ADMM, no SAM.

Texts: calibration = random windows of the first half of Emma (``emma:first_half``, seeds
``--seeds``); reported = perplexity on the first ``--eval-tokens`` tokens of the second half of
Pride and Prejudice (``pride_and_prejudice:second_half``), a text no setting was tuned on (the
SAFE defaults were chosen on the first 4096 tokens of Pride and Prejudice, in its first half, by
safe_sweep_smollm2.py) and no calibration window comes from. Flatness, at the final pruned
weights of the blocks ``--flat-blocks``, on the block's relative reconstruction error
f = ‖B(X) − B_dense(X)‖² / ‖B_dense(X)‖² over X = the pruned model's inputs to the block for the
first 4 evaluation windows: the mean increase of f under antithetic random perturbations of
‖ε_t‖ = r·‖w_t‖ per weight on its kept entries, over f, and the top eigenvalue of ∇²f on the kept
entries (power iteration, :mod:`pyprune.runtime.flatness`).

Perplexity is reported as mean ± std over the calibration seeds run, and as paired differences
between arms on the seeds both ran (``PAIRED``); ``--skip-flatness`` spares extra seeds the
flatness measure.

Results go to benchmarks/results/safe-controls-smollm2-135m.{json,md}, rewritten after every row;
rows with the same key are skipped on a rerun (same settings), and concurrent runs merge rows.

    python benchmarks/safe_controls_smollm2.py --patterns 0.5 --seeds 0 --arms sparsegpt "masked-recon wanda" safe+
"""
import argparse
import copy
import math
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from _common import environment, merge_rows, method_option, previous_result, write_atomic, write_json
import pyprune
import pyprune.methods
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.runtime import engine
from pyprune.runtime.flatness import perturbed_loss_increase, top_hessian_eigenvalue

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CALIBRATION_TEXT = "emma:first_half"
REPORT_TEXT = "pride_and_prejudice:second_half"
#: arm name → (method, options beyond the shared training options)
ARMS = {
    "wanda": ("wanda", {}),
    "sparsegpt": ("sparsegpt", {}),
    "safe+": ("safe+", {}),
    "masked-recon wanda": ("masked-recon", {"start": "wanda"}),
    "masked-recon sparsegpt": ("masked-recon", {"start": "sparsegpt"}),
    "safe": ("safe", {}),
    "masked-recon magnitude": ("masked-recon", {"start": "magnitude"}),
    "safe+ rho=0": ("safe+", {"rho": 0.0}),
    "safe+ rho=5e-3": ("safe+", {"rho": 5e-3}),
    "safe+ dual_init=box": ("safe+", {"dual_init": "box"}),
}
TRAINING = ("safe", "safe+", "masked-recon")
RELATIVE_NORMS = (0.01, 0.05)
#: (arm, against): perplexity differences on the calibration seeds both ran (the seed's windows cancel)
PAIRED = (("safe+", "masked-recon wanda"), ("safe+", "sparsegpt"), ("masked-recon wanda", "sparsegpt"),
          ("masked-recon sparsegpt", "sparsegpt"),
          ("safe+", "safe+ rho=0"), ("safe+", "safe+ rho=5e-3"), ("safe+", "safe+ dual_init=box"),
          ("safe", "masked-recon magnitude"))


def flatness(model, dense, windows, blocks, pairs, iterations):
    """Per block of ``blocks``: the flatness of its relative reconstruction error at its pruned
    weights (kept entries only), on the pruned model's inputs to it for ``windows``."""
    with torch.no_grad():
        hidden = model(input_ids=windows, output_hidden_states=True, use_cache=False).hidden_states
    arguments = engine.capture_block_arguments(model, windows)
    out = {}
    for index in blocks:
        block, dense_block = engine.decoder_blocks(model)[index], engine.decoder_blocks(dense)[index]
        inputs, kwargs = hidden[index], arguments[index]
        with torch.no_grad():
            wanted = engine.first_tensor(dense_block(inputs, **kwargs)).float()
        scale = wanted.square().sum()
        weights = [linear.weight for linear in engine.block_linears(block).values()]
        masks = {w: w.detach() != 0 for w in weights}

        def loss():
            return (engine.first_tensor(block(inputs, **kwargs)).float() - wanted).square().sum() / scale

        row = {}
        for r in RELATIVE_NORMS:
            measured = perturbed_loss_increase(loss, weights, relative_norm=r, pairs=pairs, masks=masks)
            row["loss"] = measured["loss"]
            row[f"increase_r{r}"] = measured["relative_increase"]
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention has no double backward
            row["top_eigenvalue"] = top_hessian_eigenvalue(loss, weights, iterations=iterations, masks=masks)
        out[str(index)] = row
    return out


def summary(blocks):
    """Means over blocks of the per-block diagnostics a training arm reports."""
    if not blocks:
        return {}
    out = {"loss_last": sum(b["loss_last"] for b in blocks) / len(blocks)}
    for key in ("mask_moved", "sam_relative", "sam_per_weight", "step_over_sam"):
        values = [b[key] for b in blocks if b.get(key) is not None]
        if values:
            out[key] = sum(values) / len(values)
    if "residuals" in blocks[0]:
        out["residual_last_max"] = max(b["residuals"][-1] for b in blocks)
    return out


def _mean_std(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")
    return mean, std


def markdown(result) -> str:
    s, env = result["settings"], result["environment"]
    lines = ["# SAFE / SAFE⁺ controls on SmolLM2-135M", "",
             f"Calibration: {s['calibration']}. Reported: {s['evaluation']}. Tuning: {s['tuning']}. "
             f"Training arms: {s['training']}. Protocol cut: {s['protocol_cut']}. "
             f"{env['device']}, {env['cpu_threads']} threads, torch {env['torch']}.", "",
             f"Dense perplexity: {result['dense']:.3f}", "",
             "Perplexity, mean ± std over the calibration seeds run (each seed's value in the seeds column); block "
             f"diagnostics are means over blocks and seeds. Flatness, per block ({' / '.join(s['flat_blocks'])}, "
             "means over the seeds that measured it; a seed run without it, `--skip-flatness`, is marked ° in the "
             "seeds column) on held-out windows: f = the block's relative reconstruction error at the final "
             "weights, Δf/f = its relative increase under random perturbations of relative norm r on the kept "
             "weights (antithetic pairs), and the top eigenvalue of ∇²f on the kept weights.", "",
             "| pattern | arm | perplexity | seeds | mean last training loss (calibration; SAFE: at x before "
             "its final projection) | f (held-out, final weights) | "
             + " | ".join(f"Δf/f at r={r}" for r in RELATIVE_NORMS) + " | top eigenvalue of ∇²f | prune time (s) |",
             "|---|---|---:|---|---:|---:|" + "---:|" * len(RELATIVE_NORMS) + "---:|---:|"]
    groups = {}
    for row in result["rows"]:
        groups.setdefault((row["pattern"], row["arm"]), []).append(row)
    for (pattern, arm), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        mean, std = _mean_std([r["perplexity"] for r in rows])
        ppl = f"{mean:.3f}" + (f" ± {std:.3f}" if len(rows) > 1 else "")
        seeds = ", ".join(f"{r['seed']}{'' if r['flatness'] else '°'}: {r['perplexity']:.3f}" for r in rows)
        loss_last = [r["summary"]["loss_last"] for r in rows if r["summary"]]
        def avg(key, fmt):  # per flatness block (mean over seeds), "first / second / …"
            per_block = [[r["flatness"][b][key] for r in rows if b in r["flatness"]] for b in s["flat_blocks"]]
            return " / ".join(format(sum(v) / len(v), fmt) for v in per_block if v) or "–"

        lines.append(f"| {pattern} | {arm} | {ppl} | {seeds} | "
                     + (f"{sum(loss_last) / len(loss_last):.4f}" if loss_last else "–")
                     + f" | {avg('loss', '.2g')} | "
                     + " | ".join(avg(f"increase_r{r}", ".3f") for r in RELATIVE_NORMS)
                     + f" | {avg('top_eigenvalue', '.3g')} | {sum(r['time_s'] for r in rows) / len(rows):.0f} |")
    paired = []
    for pattern in dict.fromkeys(pattern for pattern, _ in groups):
        for arm, against in PAIRED:
            ours = {r["seed"]: r["perplexity"] for r in groups.get((pattern, arm), [])}
            theirs = {r["seed"]: r["perplexity"] for r in groups.get((pattern, against), [])}
            differences = [(seed, ours[seed] - theirs[seed]) for seed in sorted(ours.keys() & theirs.keys())]
            if differences:
                mean, std = _mean_std([d for _, d in differences])
                paired.append(f"| {pattern} | {arm} − {against} | {mean:+.3f}" + (f" ± {std:.3f}" if len(
                    differences) > 1 else "") + " | " + ", ".join(f"{seed}: {d:+.3f}" for seed, d in differences)
                    + " |")
    if paired:
        lines += ["", "Paired perplexity differences, arm − the arm it is set against, on the calibration seeds both "
                  "ran (mean ± std over those seeds; negative = the first arm is better):", "",
                  "| pattern | difference | mean ± std | per seed |", "|---|---|---:|---|", *paired]
    sam = [(pattern, arm, rows) for (pattern, arm), rows in groups.items()
           if rows[0]["summary"].get("sam_relative") is not None]
    if sam:
        lines += ["", "SAFE's ascent and ADMM (means over blocks and seeds): ‖ε‖/‖w‖ = ρ over the norm of a "
                  "block's 7 final weights; per-weight ascent = ρ/√n (RMS); Adam step = the mean norm of a step's "
                  "Adam move (before the decoupled penalty's own step) in units of ρ; mask moved = fraction of z₀'s "
                  "kept entries pruned at the end; last residual = worst block's ‖x − z‖/‖x‖ at the last dual "
                  "update.", "",
                  "| pattern | arm | ρ | ‖ε‖/‖w‖ | per-weight ascent | Adam step / ‖ε‖ | mask moved from z₀ | "
                  "worst last residual |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for pattern, arm, rows in sam:
            def avg(key):
                values = [r["summary"][key] for r in rows if r["summary"].get(key) is not None]
                return sum(values) / len(values) if values else None
            step = avg("step_over_sam")
            lines.append(f"| {pattern} | {arm} | {rows[0]['options']['rho']:g} | {avg('sam_relative'):.2e} | "
                         f"{avg('sam_per_weight'):.2e} | " + (f"{step:.0f}" if step is not None else "– (ρ = 0)")
                         + f" | {100 * avg('mask_moved'):.4f}% | "
                         + f"{max(r['summary']['residual_last_max'] for r in rows):.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", nargs="+", default=["0.5"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--train-options", nargs="*", type=method_option, default=[("epochs", 3)],
                        help="NAME=VALUE options of every training arm alike (default epochs=3: 24 steps per "
                             "block at 16 windows, batch 2)")
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--flat-blocks", nargs="*", type=int, default=[2, 15, 28])
    parser.add_argument("--flat-pairs", type=int, default=2)
    parser.add_argument("--flat-iterations", type=int, default=6)
    parser.add_argument("--skip-flatness", action="store_true",
                        help="rows of this run skip the flatness measure (for extra seeds; the table marks them)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "safe-controls-smollm2-135m.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    training = dict(args.train_options)
    for arm in args.arms:  # a bad option fails before the model loads
        method, options = ARMS[arm]
        pyprune.methods.get(method, **(options | (training if method in TRAINING else {})))
    dense_model, tokenizer = load_model("smollm2-135m")
    bos = data.window_bos(tokenizer)
    tokens = data.eval_tokens(tokenizer, REPORT_TEXT, max_tokens=args.eval_tokens)
    flat_windows = data.windows(tokens, args.eval_seqlen)[:4]
    probe = pyprune.methods.get("masked-recon", **training)
    steps, batch = probe.schedule(args.nsamples)[0], probe.train_batch
    settings = {
        "calibration": f"{args.nsamples} x {args.seqlen} random windows of {CALIBRATION_TEXT}",
        "evaluation": f"perplexity on the first {args.eval_tokens} tokens of {REPORT_TEXT} in {args.eval_seqlen}-"
                      "token windows (never tuned on, disjoint from calibration)",
        "tuning": "the SAFE defaults (decoupled penalty, λ 100, K 8, lr 5e-3, 64 windows) were chosen by "
                  "safe_sweep_smollm2.py on the first 4096 tokens of pride_and_prejudice (its first half); nothing "
                  "in this file was tuned",
        "training": training,
        "protocol_cut": f"{args.nsamples} x {args.seqlen} calibration windows instead of the table's 64 x 256, "
                        f"{steps} steps per block of {batch} x {args.seqlen} tokens (the table: 96 steps of 2 x 256), "
                        f"{args.eval_tokens} evaluation tokens, for the CPU time a core shared by ~10 jobs allows; "
                        "identical for every arm",
        "flat_blocks": [str(b) for b in args.flat_blocks],
        "flat": {"relative_norms": list(RELATIVE_NORMS), "pairs": args.flat_pairs,
                 "iterations": args.flat_iterations, "windows": f"first 4 evaluation windows"},
    }
    keep = previous_result(args.output, settings)
    rows = keep["rows"] if keep else []
    dense = keep["dense"] if keep else perplexity(dense_model, tokens, args.eval_seqlen, progress=False,
                                                  bos_token_id=bos)

    def save():
        merge_rows(rows, (previous_result(args.output, settings) or {}).get("rows", []), _row_key)
        rows.sort(key=lambda r: (":" in r["pattern"], r["pattern"], list(ARMS).index(r["arm"]), r["seed"]))
        result = {"settings": settings, "environment": environment(torch.device("cpu")), "dense": dense,
                  "rows": rows}
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))

    save()
    for seed in args.seeds:
        calib = data.calibration_samples(tokenizer, CALIBRATION_TEXT, nsamples=args.nsamples, seqlen=args.seqlen,
                                         seed=seed)
        for spec in args.patterns:
            pattern = pyprune.patterns.parse(spec)
            for arm in args.arms:
                if any(_row_key(r) == (str(pattern), arm, seed) for r in rows):
                    continue
                method, options = ARMS[arm]
                options = options | (training if method in TRAINING else {})
                model = copy.deepcopy(dense_model)
                started = time.time()
                report = pyprune.prune(model, method, pattern, calib, progress=False, **options)
                row = {"pattern": str(pattern), "arm": arm, "seed": seed, "options": report["options"],
                       "perplexity": perplexity(model, tokens, args.eval_seqlen, progress=False, bos_token_id=bos),
                       "sparsity": report["sparsity"], "time_s": report["time_s"],
                       "load_avg": os.getloadavg()[0], "summary": summary(report.get("blocks"))}
                row["flatness"] = {} if args.skip_flatness else flatness(
                    model, dense_model, flat_windows, args.flat_blocks, args.flat_pairs, args.flat_iterations)
                row["blocks"] = report.get("blocks")
                rows.append(row)
                save()
                print(f"{pattern} {arm} seed {seed}: perplexity {row['perplexity']:.3f} "
                      f"({time.time() - started:.0f} s in all)", flush=True)
    return 0


def _row_key(row):
    return row["pattern"], row["arm"], row["seed"]


if __name__ == "__main__":
    sys.exit(main())
