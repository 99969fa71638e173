"""Data-parallel pruning speed on one CPU machine: ``pyprune prune`` in 1 process × 2 threads against
``torchrun`` 2 ranks × 1 thread, in one run, beside what the time model of docs/distributed.md
(``time_model.py``) predicts from rates measured here, and what it predicts for GPUs.

Each configuration runs the same command line (``--method``, ``--pattern``, ``--calib``, ``--nsamples``,
``--seqlen``, ``--batch-size``) as a fresh process, alternating configuration by configuration; a time
is the prune's own (the report's ``time_s``: loading and start-up excluded) and the wall time of the
command. The machine is shared, so the load average before and after is recorded (``uptime``).

The time model covers SparseGPT (forward, Hessians, solves, communication per block) and the
block-training methods (forward, training steps, gradient all-reduces); its rates here are measured on
this machine with one thread: a float32 GEMM of a block's shapes (forward and Hessians), SparseGPT's
solve of the model's largest layer, a gloo all-reduce between two local processes, and one training
step of the model's first block on the whole minibatch and on one rank's share of it (the difference
of two prunes of that block alone, 8 and 24 epochs of one step). "1 process × 2 threads" is
predicted as one rank at twice the one-thread rates (perfect thread scaling, an assumption).

    python benchmarks/bench_distributed.py      # benchmarks/results/distributed-speed-cpu.{json,md}
    python benchmarks/bench_distributed.py --predict-from benchmarks/results/distributed-speed-cpu.json
        # the predictions again, from rates measured now, beside that file's timed prunes
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _common import environment, load_average
from time_model import GPU_RATES, LINKS, block_parts, dense, training_parts

from pyprune.files import write_json, write_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
#: (label, ranks, threads per rank)
CONFIGS = (("1 process × 2 threads", 1, 2), ("2 ranks × 1 thread", 2, 1))


def _pyprune(ranks):
    """The command that starts ``pyprune`` on ``ranks`` local processes."""
    if ranks == 1:
        return [sys.executable, "-m", "pyprune"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "pyprune"]


def run_prune(args, method, pattern, ranks, threads, report_path):
    """(wall seconds, the report) of one ``pyprune prune`` run."""
    command = _pyprune(ranks) + [
        "prune", "--model", args.model, "--method", method, "--pattern", pattern, "--calib", args.calib,
        "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--batch-size", str(args.batch_size),
        "--threads", str(threads), "--quiet", "--report", report_path, *args.extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(threads))
    begin = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(report_path) as file:
        return wall, json.load(file)


def _best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return min(times)


def measured_rates(config, tokens):
    """One-thread FLOP/s of a float32 GEMM of the block's shapes and of SparseGPT's solve of the largest layer."""
    from pyprune.methods.sparsegpt import SparseGPT, _Hessian
    from pyprune.patterns import NM
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h, i = config.hidden_size, config.intermediate_size
        rows = min(tokens, 2048)
        x, w = torch.randn(rows, h), torch.randn(h, i)
        gemm = 2 * rows * h * i / _best(lambda: x @ w)
        layer = nn.Linear(i, h, bias=False)
        stats = _Hessian(i, "cpu")
        stats.add(torch.randn(rows, i))
        method = SparseGPT()
        solve_s = _best(lambda: method.prune_layer(nn.Linear(i, h, bias=False), stats, NM(2, 4)), repeat=2)
        del layer
        return {"fwd": gemm, "fp32": gemm, "solve": (i ** 3 + 2 * h * i * i) / solve_s}
    finally:
        torch.set_num_threads(before)


def _link_worker(rank, rendezvous, size, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        tensor = torch.ones(size // 8, dtype=torch.float64)
        dist.all_reduce(tensor)
        seconds = _best(lambda: dist.all_reduce(tensor), repeat=5)
        if rank == 0:
            torch.save(seconds, out)
    finally:
        dist.destroy_process_group()


def measured_link(size=1 << 24):
    """Bytes/s of a gloo all-reduce of ``size`` bytes between two local processes (the time model's B)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "seconds.pt")
        mp.spawn(_link_worker, args=(os.path.join(scratch, "rendezvous"), size, out), nprocs=2)
        return size / torch.load(out)


def _block_layers(config, tokens):
    return dense(config.hidden_size, config.intermediate_size,
                 config.hidden_size * config.num_key_value_heads // config.num_attention_heads, tokens)


def measured_training_steps(args, method, pattern):
    """Seconds of one ``method`` training step (its default options) of the model's first block on one thread, on the whole
    minibatch (``train_batch`` windows: one process) and on one rank's share of it (2 ranks): the
    difference of two prunes of that block alone, 8 and 24 epochs over one minibatch (one step each, so
    that both include dual updates at the default interval of 8)."""
    import pyprune
    from pyprune.inputs.data import calibration_samples
    from pyprune.inputs.models import load_model
    from pyprune.nn.anatomy import decoder_blocks
    train_batch = pyprune.methods.get(method).train_batch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for key, windows in (("whole", train_batch), ("share", max(1, train_batch // 2))):
            times = {}
            for epochs in (8, 24):
                model, tokenizer = load_model(args.model)
                del decoder_blocks(model)[1:]
                model.config.num_hidden_layers = 1
                calib = calibration_samples(tokenizer, args.calib, nsamples=windows, seqlen=args.seqlen)
                begin = time.perf_counter()
                pyprune.prune(model, method, pattern, calib, batch_size=windows, progress=False,
                              epochs=epochs, train_batch=windows)
                times[epochs] = time.perf_counter() - begin
            seconds[key] = (times[24] - times[8]) / 16
        return {"train_batch": train_batch, "step_s": seconds}
    finally:
        torch.set_num_threads(before)


def training_predictions(config, tokens, rates, link, measured, steps_per_block, step_tokens):
    """Seconds of a block-training prune by the time model: this CPU (one process: the whole
    minibatch's measured step at twice the one-thread rate; 2 ranks: a share's step each, plus the
    gradient all-reduces) and GPUs (FLOPs at the docs' assumed rates, NVLink)."""
    layers, blocks = _block_layers(config, tokens), config.num_hidden_layers
    step_s = measured["step_s"]

    def total(n, scale, rates, link, step_seconds):
        parts = training_parts(layers, n, {k: v * scale for k, v in rates.items()}, link, steps=steps_per_block,
                               step_tokens=step_tokens, step_seconds=step_seconds)
        return {k: round(blocks * v, 6) for k, v in parts.items()} | {"total": round(blocks * sum(parts.values()), 6)}
    cpu_steps = {1: step_s["whole"] / 2, 2: step_s["share"]}
    return {"cpu": {label: total(ranks, threads, rates, link, cpu_steps[ranks]) for label, ranks, threads in CONFIGS},
            "gpu": {f"{n} GPU{'s' if n > 1 else ''}": total(n, 1.0, GPU_RATES, LINKS["nvlink"], None)
                    for n in (1, 2, 8)}}


def predictions(config, tokens, rates, link):
    """Seconds of a SparseGPT prune by the time model: this CPU (1 rank at twice the one-thread rates;
    2 ranks at one thread each) and GPUs (the docs' assumed rates, NVLink)."""
    layers, blocks = _block_layers(config, tokens), config.num_hidden_layers

    def total(n, scale, rates, link):
        parts = block_parts(layers, n, {k: v * scale for k, v in rates.items()}, link)
        return {k: round(blocks * v, 6) for k, v in parts.items()} | {"total": round(blocks * sum(parts.values()), 6)}
    return {"cpu": {label: total(ranks, threads, rates, link) for label, ranks, threads in CONFIGS},
            "gpu": {f"{n} GPU{'s' if n > 1 else ''}": total(n, 1.0, GPU_RATES, LINKS["nvlink"]) for n in (1, 2, 8)}}


def markdown(report):
    s, env = report["settings"], report["environment"]
    load = lambda values: ", ".join(str(v) for v in values) if values else "n/a"  # noqa: E731
    lines = [f"# Data-parallel pruning on one CPU machine: 1 process × 2 threads vs 2 ranks × 1 thread", "",
             f"{s['model']}, calibration {s['nsamples']} × {s['seqlen']} tokens of {s['calib']} (batch "
             f"{s['batch_size']}); torch {env.get('torch')}, {env.get('cpu_threads')} CPU threads on the machine, "
             f"CPU {env.get('cpu', {}).get('model', 'unknown')}, flags {', '.join(env.get('cpu', {}).get('flags', [])) or 'n/a'}; "
             f"{s['started']}. The machine is shared with other jobs: load average (1, 5, 15 min) "
             f"{load(s['load_average_before'])} before and {load(s['load_average_after'])} after "
             f"(`uptime`: {s['uptime_before']} / {s['uptime_after']}), so the times are noisy.", "",
             "Prune time = the report's `time_s` (loading and start-up excluded); wall = the whole command. "
             "Predicted = the time model of docs/distributed.md with this machine's one-thread rates "
             f"(GEMM {report['rates']['fwd'] / 1e9:.1f} GFLOP/s, SparseGPT solve {report['rates']['solve'] / 1e9:.1f} "
             f"GFLOP/s, gloo all-reduce {report['link'] / 1e9:.2f} GB/s"
             + "".join(f"; one {row['method']} step of the first block on one thread: "
                       f"{row['training_step']['step_s']['whole']:.3f} s on the whole minibatch of "
                       f"{row['training_step']['train_batch']} windows, {row['training_step']['step_s']['share']:.3f} s "
                       f"on one rank's share, {row['steps_per_block']} steps a block"
                       for row in report["results"] if "training_step" in row)
             + "); 1 process × 2 threads assumes twice the one-thread rates."
             + (f" The rates and the predictions were measured at {s['predicted_at']} (`uptime`: "
                f"{s['predicted_uptime']}), after the timed prunes." if "predicted_at" in s else ""), "",
             "| method | pattern | configuration | prune time (s) | wall (s) | predicted (s) | measured speed-up over 1 process | predicted speed-up |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        for label, _, _ in CONFIGS:
            run = row["runs"][label]
            predicted = row.get("predicted", {}).get("cpu", {}).get(label, {}).get("total")
            base = row["runs"][CONFIGS[0][0]]["prune_s"]
            speedup = round(base / run["prune_s"], 3)
            if predicted is not None:
                pbase = row["predicted"]["cpu"][CONFIGS[0][0]]["total"]
                pred_speedup = f"{round(pbase / predicted, 3)}×"
            else:
                pred_speedup = "–"
            lines.append(f"| {row['method']} | {row['pattern']} | {label} | {run['prune_s']} | {run['wall_s']} | "
                         f"{f'{predicted:.1f}' if predicted is not None else '– (no time model)'} | {speedup}× | {pred_speedup} |")
    lines += ["", "The time model's prediction on GPUs for the same prune (assumed rates of docs/distributed.md, "
              "NVLink), seconds:", "",
              "| method | GPUs | forward | Hessians | solves | training | communication | total |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        for label, parts in row.get("predicted", {}).get("gpu", {}).items():
            lines.append(f"| {row['method']} | {label} | " + " | ".join(
                f"{parts[key]:.3g}" if key in parts else "–"
                for key in ("forward", "hessians", "solves", "training", "communication", "total")) + " |")
    lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "n/a"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib", default="emma:first_half")
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--runs", nargs="+", default=["sparsegpt:2:4", "safe+:2:4"],
                        help="METHOD:PATTERN of every prune to time")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further flags of every prune")
    parser.add_argument("--output-dir", default=RESULTS)
    parser.add_argument("--name", default="distributed-speed-cpu")
    parser.add_argument("--note", action="append", default=[], help="a line for the results file")
    parser.add_argument("--predict-from", metavar="JSON",
                        help="time no prune: keep this results file's timed prunes and settings, measure the rates "
                             "now and write the predictions beside them")
    args = parser.parse_args(argv)
    import pyprune
    from pyprune.inputs.models import resolve_model_dir
    from transformers import AutoConfig
    previous = None
    if args.predict_from:
        with open(args.predict_from) as file:
            previous = json.load(file)
        for key in ("model", "calib", "nsamples", "seqlen", "batch_size", "extra"):
            setattr(args, key, previous["settings"][key])
        args.runs = [f"{row['method']}:{row['pattern']}" for row in previous["results"]]
    config = AutoConfig.from_pretrained(resolve_model_dir(args.model))
    settings = previous["settings"] if previous else {
        "model": args.model, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
        "batch_size": args.batch_size, "extra": args.extra, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_before": load_average(), "uptime_before": _uptime()}
    tokens = args.nsamples * args.seqlen
    rates, link = measured_rates(config, tokens), measured_link()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, run in enumerate(args.runs):
            method, pattern = run.split(":", 1)
            row = previous["results"][index] if previous else {"method": method, "pattern": pattern, "runs": {}}
            for label, ranks, threads in CONFIGS if not previous else ():
                wall, report = run_prune(args, method, pattern, ranks, threads, os.path.join(scratch, "report.json"))
                row["runs"][label] = {"ranks": ranks, "threads": threads, "prune_s": round(report["time_s"], 3),
                                      "wall_s": round(wall, 3), "sparsity": report["sparsity"]}
                print(method, pattern, label, row["runs"][label], flush=True)
            trains = hasattr(pyprune.methods.get(method), "schedule")
            if trains:
                trainer = pyprune.methods.get(method)
                steps_per_block = trainer.schedule(args.nsamples)[0]
                row["training_step"] = measured_training_steps(args, method, pattern)
                row["steps_per_block"] = steps_per_block
                row["predicted"] = training_predictions(config, tokens, rates, link, row["training_step"],
                                                        steps_per_block, trainer.train_batch * args.seqlen)
            elif method == "sparsegpt":
                row["predicted"] = predictions(config, tokens, rates, link)
            results.append(row)
    if previous:
        settings["predicted_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        settings["predicted_uptime"] = _uptime()
    else:
        settings["load_average_after"], settings["uptime_after"] = load_average(), _uptime()
    report = {"environment": previous["environment"] if previous else environment(torch.device("cpu")),
              "settings": settings, "rates": rates, "link": link, "results": results,
              "notes": (previous["notes"] if previous else []) + args.note}
    os.makedirs(args.output_dir, exist_ok=True)
    write_json(os.path.join(args.output_dir, args.name + ".json"), report)
    write_text(os.path.join(args.output_dir, args.name + ".md"), markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
