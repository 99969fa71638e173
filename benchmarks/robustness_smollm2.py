"""MoreauPruner's robustness claim (Table 1) on SmolLM2-135M, with its controls.

For every method, arithmetic, layer protocol, ratio and calibration seed: prune SmolLM2-135M with
its weights in bf16 and in fp16 (:func:`pyprune.studies.robustness.study`) and record the bf16/fp16
agreement of the pruned groups, the rank correlation of all group scores per layer (Spearman), both
pruned models' perplexities in fp32 (the common format) and the 2 x 2 pruned-in x evaluated-in.
Controls: the Monte-Carlo floor (a second noise seed in bf16, for the methods with noise) and the
calibration floor (agreement and rank correlation between the bf16 runs of two calibration seeds).
MoreauPruner's diagnostics (‖δ_T‖/‖σ|w|‖, decay, -GS shrinkage) are in each run. ``--eta-sweep``
runs instead a MoreauPruner-GS η sweep against η = 0 (bf16, rounding, the first seed and ratio;
results in ``-eta-sweep.{json,md}`` beside the output).

Layers: ``all`` prunes every layer at the ratio; ``middle`` is the v2 paper's protocol (App. E.2:
layers 4..29 of LLaMA-7B's 32, 25% of them for 20% overall) scaled to the model: the same
proportion of the first and last layers stays dense (SmolLM2's 30: layers 4..27) and the layers
in between lose ratio · layers / pruned layers each, so the ratio is the share of all blocks.

Structure: ``groups`` (default) removes each pruned layer's heads and MLP channels; ``hidden`` is
LLM-Pruner's channel-wise protocol, the one of the paper's perturbation table: hidden channels,
the same in every layer (embedding, norms and LM head included), ranked over the whole model
(every layer, so ``--layers all``); agreement and rank correlation are then over hidden channels.

Calibration: ``--nsamples`` x ``--seqlen`` random windows of Emma (default 10 x 128, the paper's
batch), one draw per seed; evaluation: the first ``--eval-tokens`` tokens of Pride and Prejudice
in 128-token windows. The paper's hyperparameters are every method's defaults.

Results go to benchmarks/results/robustness-smollm2-135m.{json,md}, rewritten atomically after
every run; the per-run group scores (for the calibration floor) go to the ``.scores`` directory
beside them (safetensors, not committed). A rerun skips the runs already there, so a stopped run
resumes; seeds are the outer loop, so every setting gets its first seed before any its second.

    python benchmarks/robustness_smollm2.py                                   # the README table
    python benchmarks/robustness_smollm2.py --methods moreau-gs smoothgrad --seeds 0 --layers middle \\
        --ratios 0.1 0.2                                                      # the second stage
    python benchmarks/robustness_smollm2.py --eta-sweep 1e-3 1e-2 1e-1      # where -GS starts to act
    python benchmarks/robustness_smollm2.py --methods smoothgrad-gradients --arithmetic fp32-accumulate \
        --no-noise-floor                                                      # the attribution control
    python benchmarks/robustness_smollm2.py --structure hidden --seeds 0 --arithmetic rounding \
        --ratios 0.2 0.1 0.05                                                 # the channel-wise protocol
    python benchmarks/robustness_smollm2.py --nsamples 2 --eval-tokens 1024 --seeds 0 --no-noise-floor \
        --output benchmarks/results/robustness-smollm2-135m-cut.json --methods moreau-gs-released moreau-gs taylor \
        --arithmetic rounding                                                 # the released -GS loop, cut for CPU

Other settings than the table's need their own ``--output`` (a file's rows share its settings).
"""
import argparse
import itertools
import os
import statistics
import sys
import time

import torch
from safetensors.torch import load_file, save_file

from _common import environment, mean_std, merge_rows, previous_result, write_atomic, write_json
from pyprune.inputs import data
from pyprune.studies import robustness
from pyprune.inputs.models import load_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: the table's rows: a name -> (pyprune method, its options)
VARIANTS = {
    "taylor": ("taylor", {}),
    "smoothgrad": ("smoothgrad", {}),  # averages the scores (v2 paper)
    "smoothgrad-gradients": ("smoothgrad", {"average": "gradients"}),  # averages the gradients (v1 paper)
    "moreau": ("moreau", {}),
    "moreau-gs": ("moreau-gs", {}),
    # the authors' released loop (spec Appendix X): no decay, mean δ of the last 5 steps, per-row RMS operator,
    # every parameter smoothed
    "moreau-gs-released": ("moreau-gs", {"operator": "released", "decay": False, "average_last": 5, "smooth": "all"}),
}
METHODS = tuple(VARIANTS)
PAPER_LAYERS, PAPER_FIRST, PAPER_END = 32, 4, 30  # LLaMA-7B: layers 4..29 pruned (range(4, 30))


def layer_protocol(layers: str, ratio: float, n_layers: int):
    """(first_layer, last_layer, per-layer ratio) of protocol ``layers`` at overall ``ratio``."""
    if layers == "all":
        return 0, n_layers - 1, ratio
    first = round(PAPER_FIRST * n_layers / PAPER_LAYERS)
    last = round(PAPER_END * n_layers / PAPER_LAYERS) - 1
    return first, last, ratio * n_layers / (last - first + 1)


def _key(run):
    return (run["method"], run["arithmetic"], run["layers"], run["overall_ratio"], run.get("structure", "groups"))


def _run_key(run):
    return (*_key(run), run["seed"])


def _scores_path(directory, run, seed):
    method, arithmetic, layers, ratio, structure = _key(run)
    hidden = "-hidden" if structure == "hidden" else ""
    return os.path.join(directory, f"{method}-{arithmetic}-{layers}{hidden}-{ratio}-seed{seed}.safetensors")


def save_scores(path, report):
    """The bf16 run's group scores and pruned groups (safetensors, atomically)."""
    tensors = {}
    for layer, scores in report["scores"]["bfloat16"].items():
        for kind, values in scores.items():
            tensors[f"{layer}.{kind}"] = values.float().contiguous()
    for layer, kind, index in report["groups"]["bfloat16"]:
        tensors.setdefault(f"{layer}.pruned_{kind}s", [])
        tensors[f"{layer}.pruned_{kind}s"].append(index)
    tensors = {k: (torch.tensor(sorted(v)) if isinstance(v, list) else v) for k, v in tensors.items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, temporary)
    os.replace(temporary, path)


def load_scores(path):
    """(layer scores, pruned groups) of a file :func:`save_scores` wrote."""
    tensors = load_file(path)
    scores, groups = {}, set()
    for name, values in tensors.items():
        layer, kind = name.split(".", 1)
        if kind.startswith("pruned_"):
            groups.update((int(layer), kind[len("pruned_"):-1], int(i)) for i in values.tolist())
        else:
            scores.setdefault(int(layer), {})[kind] = values
    return scores, groups


def _floor_key(key):
    """A setting's key in ``calibration_floor`` (the structure only when not the default)."""
    return "|".join(map(str, key if key[4] != "groups" else key[:4]))


def calibration_floor(runs, directory, previous=None):
    """Per setting: mean agreement and rank correlation of the bf16 runs over pairs of seeds; a
    ``previous`` floor stays when its runs' score files are not here (another machine's)."""
    keys = {_key(r) for r in runs}
    floors = {k: v for k, v in (previous or {}).items() if k in {_floor_key(key) for key in keys}}
    for key in keys:
        seeds = sorted(r["seed"] for r in runs if _key(r) == key)
        paths = {s: _scores_path(directory, next(r for r in runs if _key(r) == key), s) for s in seeds}
        if len(seeds) < 2 or not all(os.path.exists(p) for p in paths.values()):
            continue
        loaded = {s: load_scores(p) for s, p in paths.items()}
        pairs = list(itertools.combinations(seeds, 2))
        agreements = [robustness.agreement(loaded[a][1], loaded[b][1]) for a, b in pairs]
        correlations = [robustness.rank_correlation(loaded[a][0], loaded[b][0]) for a, b in pairs]
        floors[_floor_key(key)] = {
            "pairs": [list(p) for p in pairs], "agreement": statistics.fmean(agreements),
            "spearman": {kind: statistics.fmean(c[kind] for c in correlations) for kind in correlations[0]}}
    return floors


def _rho_channels(spearman):
    """The channels' rank correlation: of the MLP channels, or of the hidden channels (structure hidden)."""
    return spearman["channels"] if "channels" in spearman else spearman["hidden"]


def markdown(result) -> str:
    settings, runs = result["settings"], result["runs"]
    lines = [f"SmolLM2-135M; calibration {settings['calibration']}, evaluation {settings['evaluation']}; "
             f"{result['environment']['device']}, {result['environment']['cpu_threads']} threads, torch "
             f"{result['environment']['torch']}. Perplexities of both pruned models in fp32 (the common format). "
             "Mean ± std over the calibration seeds; noise floor: bf16 runs of noise seeds 0 and 1; "
             "calibration floor: bf16 runs of two calibration seeds (mean over pairs). Variants: "
             + "; ".join(f"{name} = {method} {options}" for name, (method, options) in VARIANTS.items()
                         if name != method) + ". Structure: groups = each layer's heads and MLP channels; hidden = "
             "hidden channels in every layer (LLM-Pruner's channel-wise protocol), ρ channels then over hidden "
             "channels.", "",
             "| method | arithmetic | structure | layers | ratio | seeds | agreement bf16/fp16 | ρ channels | ρ heads | "
             "noise floor agr. | noise floor ρ ch. | calib. floor agr. | calib. floor ρ ch. | ppl bf16 | ppl fp16 | "
             "ppl_diff | ‖δ‖/‖σ\\|w\\|‖ | decay | GS rows shrunk >1% |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in sorted({_key(r) for r in runs}, key=lambda k: (k[4], k[2], k[3], METHODS.index(k[0]), k[1])):
        rows = [r for r in runs if _key(r) == key]
        floor = result["calibration_floor"].get(_floor_key(key))
        noise = [r["noise_floor"] for r in rows if r["noise_floor"]]
        moreau = [r["runs"]["bfloat16"].get("moreau") or {} for r in rows]
        ppl = [mean_std([r[k] for r in rows], ".2f") for k in ("ppl_bf16", "ppl_fp16", "ppl_diff")]
        cells = [key[0], key[1], key[4], key[2], f"{key[3]:g}", str(len(rows)),
                 mean_std([r["agreement"] for r in rows]),
                 mean_std([_rho_channels(r["spearman"]) for r in rows], ".5f"),
                 mean_std([r["spearman"].get("heads") for r in rows]),
                 mean_std([n["agreement"] for n in noise]),
                 mean_std([_rho_channels(n["spearman"]) for n in noise], ".5f"),
                 f"{floor['agreement']:.4f}" if floor else "–",
                 f"{_rho_channels(floor['spearman']):.5f}" if floor else "–",
                 *ppl,
                 mean_std([m.get("delta_to_noise") for m in moreau], ".2e"),
                 mean_std([m.get("decay") for m in moreau], ".3f"),
                 mean_std([m.get("gs_shrunk_1pct") for m in moreau])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per run (perplexity: pruned in → evaluated in; fp32 is the common format):", "",
              "| method | arithmetic | structure | layers | ratio | seed | agreement | ρ ch. | ρ heads | ppl fp32 bf16-run | "
              "ppl fp32 fp16-run | bf16→bf16 | bf16→fp16 | fp16→bf16 | fp16→fp16 | loss-scale backoffs | "
              "prune s (bf16, fp16) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cross = r["ppl_cross"]
        backoffs = [r["runs"][f].get("loss_scale", {}).get("backoffs") for f in ("bfloat16", "float16")]
        lines.append(
            f"| {r['method']} | {r['arithmetic']} | {r.get('structure', 'groups')} | {r['layers']} | "
            f"{r['overall_ratio']:g} | {r['seed']} | {r['agreement']:.4f} | {_rho_channels(r['spearman']):.5f} | "
            f"{mean_std([r['spearman'].get('heads')])} | "
            f"{r['ppl_bf16']:.2f} | {r['ppl_fp16']:.2f} | {cross['bfloat16']['bfloat16']:.2f} | "
            f"{cross['bfloat16']['float16']:.2f} | {cross['float16']['bfloat16']:.2f} | "
            f"{cross['float16']['float16']:.2f} | {', '.join('–' if b is None else str(b) for b in backoffs)} | "
            f"{r['runs']['bfloat16']['time_s']:.0f}, {r['runs']['float16']['time_s']:.0f} |")
    if not runs:
        lines = lines[:1]
    sweep = result.get("eta_sweep")
    if sweep:
        lines += ["", f"MoreauPruner-GS η sweep ({sweep['format']}, {sweep['arithmetic']}, ratio {sweep['ratio']:g}, "
                  f"calibration seed {sweep['seed']}): selection against η = 0 (same ρ = {sweep['options']['rho']}, "
                  f"γ = {sweep['options']['gamma']}, noise).", "",
                  "| η | threshold γη | agreement with η = 0 | ρ channels | rows zeroed | rows shrunk >1% | "
                  "median shrink |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in sweep["rows"]:
            m = row["moreau"]
            lines.append(f"| {row['eta']:g} | {row['threshold']:.3g} | {row['agreement']:.4f} | "
                         f"{row['spearman']['channels']:.4f} | {m['gs_zeroed']:.4f} | {m['gs_shrunk_1pct']:.4f} | "
                         f"{'–' if m['gs_shrink_median'] is None else format(m['gs_shrink_median'], '.3g')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["taylor", "moreau"], choices=METHODS)
    parser.add_argument("--arithmetic", nargs="+", default=["rounding", "fp32-accumulate"],
                        choices=robustness.ARITHMETIC)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="calibration seeds")
    parser.add_argument("--layers", choices=("all", "middle"), default="all")
    parser.add_argument("--structure", choices=("groups", "hidden"), default="groups",
                        help="what is removed: each layer's heads and MLP channels, or hidden channels (every layer)")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.2], help="share of all blocks' groups")
    parser.add_argument("--nsamples", type=int, default=10)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seqlen", type=int, default=128)
    parser.add_argument("--smoothgrad-passes", type=int, default=10, help="SmoothGrad's K (paper: 100)")
    parser.add_argument("--noise-floor", action=argparse.BooleanOptionalAction, default=True,
                        help="prune once more in bf16 with the next noise seed (methods with noise; +50%% time)")
    parser.add_argument("--eta-sweep", nargs="*", type=float, default=None,
                        help="only a MoreauPruner-GS η sweep: these η against η = 0 (bf16, rounding, first seed)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "robustness-smollm2-135m.json"))
    args = parser.parse_args(argv)
    if args.structure == "hidden" and (args.layers != "all" or args.eta_sweep is not None):
        parser.error("--structure hidden removes hidden channels in every layer: it takes --layers all and no "
                     "--eta-sweep")

    model, tokenizer = load_model("smollm2-135m")
    n_layers = model.config.num_hidden_layers
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=args.eval_tokens)
    settings = {"calibration": f"{args.nsamples} x {args.seqlen} tokens of emma",
                "evaluation": f"first {tokens.numel() // args.eval_seqlen * args.eval_seqlen} tokens of "
                              f"pride_and_prejudice, {args.eval_seqlen}-token windows",
                "smoothgrad_passes": args.smoothgrad_passes}
    scores_dir = os.path.splitext(args.output)[0] + ".scores"
    os.makedirs(scores_dir, exist_ok=True)
    write_atomic(os.path.join(scores_dir, ".gitignore"), "*\n")
    if args.eta_sweep is not None:
        args.output = os.path.splitext(args.output)[0] + "-eta-sweep.json"
        settings.update(eta_sweep=args.eta_sweep, seed=args.seeds[0], layers=args.layers, ratio=args.ratios[0])
    previous = previous_result(args.output, settings)
    result = previous or {"settings": settings, "runs": []}
    runs = result["runs"]

    def save():
        merge_rows(runs, (previous_result(args.output, settings) or {}).get("runs", []), _run_key)
        runs.sort(key=lambda run: run["seed"])  # stable: each seed's runs in the order they were made
        result["environment"] = environment(torch.device("cpu"))
        result["calibration_floor"] = calibration_floor(runs, scores_dir, result.get("calibration_floor"))
        write_json(args.output, result)
        write_atomic(os.path.splitext(args.output)[0] + ".md", markdown(result))

    for seed in ([] if args.eta_sweep is not None else args.seeds):
        calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=seed)
        for ratio, arithmetic, method in itertools.product(args.ratios, args.arithmetic, args.methods):
            run = {"method": method, "arithmetic": arithmetic, "layers": args.layers, "overall_ratio": ratio,
                   "seed": seed, "structure": args.structure}
            if any(_run_key(r) == _run_key(run) for r in runs):
                continue
            first, last, layer_ratio = layer_protocol(args.layers, ratio, n_layers)
            name, options = VARIANTS[method]
            options = {**options, "first_layer": first, "last_layer": last} if args.structure == "groups" \
                else {**options, "structure": "hidden"}
            if name == "smoothgrad":
                options["passes"] = args.smoothgrad_passes
            start = time.perf_counter()
            report = robustness.study(model, name, layer_ratio, calib, tokens, eval_seqlen=args.eval_seqlen,
                                      arithmetic=arithmetic, keep_scores=True, noise_control=args.noise_floor,
                                      progress=False, **options)
            report["method"] = method
            save_scores(_scores_path(scores_dir, run, seed), report)
            del report["scores"], report["groups"]
            run.update(report, wall_s=round(time.perf_counter() - start, 1))
            runs.append(run)
            floor = run["noise_floor"]
            print(f"{method} {arithmetic} {args.structure} {args.layers} {ratio:g} seed {seed}: agreement "
                  f"{run['agreement']:.4f}" + (f" (noise floor {floor['agreement']:.4f})" if floor else ""),
                  f"rho {_rho_channels(run['spearman']):.4f}, ppl {run['ppl_bf16']:.2f} / {run['ppl_fp16']:.2f} "
                  f"({run['wall_s']} s)", flush=True)
            save()
    if args.eta_sweep is not None and not result.get("eta_sweep"):  # one run, not resumed
        seed = args.seeds[0]
        calib = data.calibration_samples(tokenizer, "emma", nsamples=args.nsamples, seqlen=args.seqlen, seed=seed)
        first, last, layer_ratio = layer_protocol(args.layers, args.ratios[0], n_layers)
        sweep = robustness.eta_sweep(model, args.eta_sweep, layer_ratio, calib, first_layer=first, last_layer=last)
        result["eta_sweep"] = {**sweep, "seed": seed, "layers": args.layers}
        print("eta sweep:", [(row["eta"], row["agreement"]) for row in sweep["rows"]], flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
