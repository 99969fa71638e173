"""The benchmark harnesses run on CPU in CI (tiny shapes), so they never rot: the speed suites' results
files come out of a pytest-benchmark run in their format, rows carry the measured numbers, the dispatch
table they build is one SparseLinear reads, and the scripts write every file they promise."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyprune.nn import SparseLinear, dispatch
from pyprune.studies import robustness

from tests.helpers import tiny_llama, tiny_tokenizer

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "benchmarks")))

import bench_distributed  # noqa: E402
import bench_dress_speed  # noqa: E402
import report  # noqa: E402
import robustness_arm_cost  # noqa: E402
import test_e2e as e2e_suite  # noqa: E402
import test_ops as ops_suite  # noqa: E402
import test_sparse_linear as sparse_linear_suite  # noqa: E402

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def _run(*benchmarks):
    """A pytest-benchmark JSON of the suites on this CPU: ``benchmarks`` are (extra_info, seconds)."""
    from _common import machine_record
    return {"machine_info": {"pyprune": dict(machine_record(CPU), roofline=None)},
            "datetime": "2026-01-02T03:04:05.678901+00:00",
            "benchmarks": [{"extra_info": dict(info, load_average=[1.0, 2.0, 3.0]),
                            "stats": {"min": seconds, "median": 2 * seconds, "rounds": 3}}
                           for info, seconds in benchmarks]}


def _op(op, role, baseline=None, shape=(64, 128), **info):
    return dict(suite="ops", op=op, shape=list(shape) if isinstance(shape, tuple) else shape, dtype="float32",
                device="cpu", role=role, baseline=baseline, **info)


def test_machine_record_is_the_dispatch_identity_and_the_environment_adds_when():
    from _common import environment, machine_record
    record = machine_record(CPU)
    assert record["dispatch_device"] == dispatch.device_key(CPU)
    assert record["dispatch_environment"] == dispatch.environment(CPU)
    cpu = record["cpu"]  # the machine as the dispatch keys it and every cache level
    assert {k: cpu[k] for k in dispatch.this_cpu()} == dispatch.this_cpu() and cpu["model"]
    assert cpu["caches"] == dispatch.cpu_caches() and "load_average" not in cpu and "timestamp" not in record
    env = environment(CPU)  # what the scripts write: the same record, with when
    assert {k: v for k, v in env.items() if k not in ("timestamp", "cpu")} == \
        {k: v for k, v in record.items() if k != "cpu"}
    assert len(env["cpu"]["load_average"]) == 3 and env["timestamp"].startswith("20")


def test_ops_report_pairs_each_baseline_with_pyprune_and_the_byte_floor(tmp_path):
    run = _run((_op("topk_mask row 50%", "pyprune", bytes=4e6), 2e-3),
               (_op("topk_mask row 50%", "eager", "torch.topk + scatter_"), 5e-3),
               (_op("topk_mask row 50%", "floor"), 1e-3),
               (_op("nm_linear 2:4 M=16", "pyprune", bytes=1e6), 1e-3),
               (_op("nm_linear 2:4 M=16", "dense", "dense F.linear"), 3e-3),
               (_op(ops_suite.SAFE_STEP, "pyprune", shape="block of 7: 0.0M", bytes=1e6), 4e-3),
               *[(_op(ops_suite.SAFE_STEP, role, name, shape="block of 7: 0.0M"), 8e-3)
                 for role, name in ops_suite.SAFE_CASE.baselines])
    assert [path.name for path in map(Path, report.write_results(run, str(tmp_path / "new")))] == \
        ["ops-cpu-float32.json", "ops-cpu-float32.md"]  # into a directory it makes
    saved = json.loads((tmp_path / "new" / "ops-cpu-float32.json").read_text())
    assert saved["environment"]["timestamp"] == "2026-01-02T03:04:05+00:00"
    assert saved["environment"]["cpu"]["load_average"] == [1.0, 2.0, 3.0]
    mask, linear, *safe = saved["results"]  # on a CPU the minimum of the rounds
    assert mask == {"op": "topk_mask row 50%", "shape": [64, 128], "dtype": "float32",
                    "baseline": "torch.topk + scatter_", "pyprune_ms": 2.0, "baseline_ms": 5.0, "speedup": 2.5,
                    "pyprune_GBps": 2.0, "byte_floor_ms": 1.0, "times_byte_floor": 2.0}
    assert linear["speedup"] == 3.0 and "byte_floor_ms" not in linear  # not a mask op
    assert [r["baseline"].split(" ")[-1] for r in safe] == ["math", "AdamW(foreach=True)", "AdamW(fused=True)"]
    assert all(r["pyprune_ms"] == 4.0 and r["speedup"] == 2.0 for r in safe)
    md = (tmp_path / "new" / "ops-cpu-float32.md").read_text()
    assert "| × floor |" in md and "| topk_mask row 50% | 64×128 | float32 | 2.0 | torch.topk + scatter_ | 5.0 | " \
        "2.5× | 2.0 | 1.0 | 2.0× |" in md
    assert f"| {ops_suite.SAFE_STEP} | block of 7: 0.0M | float32 |" in md


def test_the_ops_suite_times_every_public_op_against_eager_pytorch():
    import pyprune.ops as ops
    source = Path(ops_suite.__file__).read_text()
    public_ops = [name for name in ops.__all__ if callable(getattr(ops, name)) and name != "use_implementation"]
    assert [name for name in public_ops if f"ops.{name}(" not in source] == []
    assert len({case.key for case in ops_suite.CASES}) == len(ops_suite.CASES)
    assert all(len(ops_suite.roles(case)) >= 2 for case in ops_suite.CASES)  # pyprune and a baseline at least
    assert ops_suite.block_label(ops_suite.BLOCK["full"]) == "block of 7: 202.4M"


def _sparse(implementation, M, seconds, pattern="2:4", shape=(64, 128), dtype="float32"):
    info = dict(suite="sparse_linear", shape=list(shape), M=M, dtype=dtype, pattern=pattern,
                implementation=implementation, device="cpu", weight_copies=1, flops=2.0 * M * shape[0] * shape[1],
                bytes=1e6)
    if implementation != "F.linear":
        info["max_rel_error"] = 1e-7
    return info, seconds


def test_sparse_linear_report_writes_results_a_plot_and_the_dispatch_block(tmp_path, monkeypatch):
    # 2:4: kernel 2x dense at one token, 1.02x at 300 (under dispatch.MIN_SPEEDUP); 4:8: kernel slower
    run = _run(*[_sparse(*case) for case in [
        ("F.linear", 1, 2e-3), ("kernel", 1, 1e-3), ("dense", 1, 2e-3), ("F.linear", 300, 1.02e-3),
        ("kernel", 300, 1e-3), ("dense", 300, 1e-3), ("F.linear", 1, 1e-3, "4:8"), ("kernel", 1, 2e-3, "4:8"),
        ("F.linear", 300, 1e-3, "4:8"), ("kernel", 300, 2e-3, "4:8")]])
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"environments": []}))
    report.write_results(run, str(tmp_path), tag="t", dispatch_table=str(table))
    saved = json.loads((tmp_path / "sparse-linear-cpu-t.json").read_text())
    rows = saved["results"]
    assert [(r["pattern"], r["M"], r["backend"]) for r in rows] == [
        ("2:4", 1, "kernel"), ("2:4", 1, "dense"), ("2:4", 300, "kernel"), ("2:4", 300, "dense"),
        ("4:8", 1, "kernel"), ("4:8", 300, "kernel")]
    assert rows[0] == {"shape": [64, 128], "M": 1, "dtype": "float32", "pattern": "2:4", "weight_copies": 1,
                       "backend": "kernel", "max_rel_error": 1e-7, "dense_ms": 4.0, "status": "ok", "ms": 2.0,
                       "speedup": 2.0, "tflops": 0.0, "gbps": 0.5, "load_average": [1.0, 2.0, 3.0]}
    md = (tmp_path / "sparse-linear-cpu-t.md").read_text()
    assert "| 64×128 | 1 | float32 | 2:4 | kernel | 2.0 | 4.0 | 2.0× |" in md
    assert "| float32 | 2:4 | kernel | 2.00× (2.00–2.00) | 1.02× (1.02–1.02) |" in md  # the summary
    assert (tmp_path / "sparse-linear-cpu-t-float32.svg").read_text().startswith("<svg")
    [block] = json.loads(table.read_text())["environments"]  # this run's environment and its rows
    assert block["environment"] == dispatch.environment(CPU)
    entries = block["entries"]
    assert {key: entry["implementation"] for key, entry in entries.items()} == {
        "float32|2:4|2^6x2^7|1": "kernel", "float32|2:4|2^6x2^7|many": "dense", "float32|4:8|2^6x2^7|1": "dense",
        "float32|4:8|2^6x2^7|many": "dense"}
    assert entries["float32|2:4|2^6x2^7|many"]["sparse_geomean_speedup_vs_dense"] == 1.02
    assert entries["float32|2:4|2^6x2^7|1"]["source"] == os.path.relpath(tmp_path / "sparse-linear-cpu-t.json",
                                                                       ROOT / "benchmarks")
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    layer = SparseLinear(128, 64, n=4, m=8)
    with torch.no_grad():  # tuning off: a dense row runs as is, a kernel row is not taken unmeasured
        assert layer.choose_implementation(torch.zeros(1, 128)) == "dense" and layer.decisions["1"] == ("dense", "prior")
        layer = SparseLinear(128, 64)
        assert layer.choose_implementation(torch.zeros(1, 128)) == "dense" and layer.decisions["1"] == ("dense", "fallback")
    # another environment's block stays when this one's is written again; an unattributable table is refused
    other = dict(block, environment=dict(block["environment"], threads=block["environment"]["threads"] + 1))
    table.write_text(json.dumps({"environments": [other, block]}))
    report.write_dispatch({"environment": saved["environment"], "results": rows[:1]}, str(table), "again")
    assert json.loads(table.read_text())["environments"][0] == other
    assert json.loads(table.read_text())["environments"][1]["entries"]["float32|2:4|2^6x2^7|1"]["source"] == "again"
    table.write_text(json.dumps({"entries": {}}))
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps(run))
    with pytest.raises(ValueError, match="must be {\"environments\""):
        report.main([str(run_json), "--write-dispatch", str(table), "--output-dir", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()


def test_sparse_linear_suite_cycles_copies_that_fill_the_bytes_asked_for():
    weight = torch.zeros(64, 128)  # 32 KiB
    assert sparse_linear_suite.cold_copies(weight, CPU, 1 << 20) == 32
    assert sparse_linear_suite.cold_copies(weight, CPU, 0) == 1
    assert sparse_linear_suite.fill_bytes("tiny", CPU) == 0 and sparse_linear_suite.fill_bytes("full", CPU) > 0


def test_report_refuses_a_run_without_timings(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"machine_info": {}, "datetime": "", "benchmarks": []}))
    with pytest.raises(SystemExit):
        report.main([str(path)])
    assert "holds no timed benchmark of the suites" in capsys.readouterr().err


def test_e2e_suite_checks_a_bf16_pair_against_the_same_model_in_fp32(tmp_path):
    """In bf16 the sparse and the dense model's logits are each measured against the pruned model in fp32;
    the check is how far the sparse model's error passes the dense model's."""
    model_dir = tmp_path / "tiny"
    tiny_llama(layers=2).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    pair = e2e_suite.prepare(str(model_dir), "2:4", "all", "kernel", 2, 16, 3, torch.bfloat16, CPU)
    assert pair.record["sparse_layers"] == 14 and pair.record["backends"]["prefill"] == ["kernel"]
    assert 0 < pair.fp32_error["dense"] and 0 < pair.fp32_error["sparse"]  # bf16 is not fp32
    assert pair.excess_error == pair.fp32_error["sparse"] - pair.fp32_error["dense"]
    assert pair.excess_error <= e2e_suite.TOLERANCE[torch.bfloat16]
    assert e2e_suite.extra_info(pair, "prefill", "sparse", CPU)["fp32_rel_logit_error"] == pair.fp32_error


def test_e2e_suite_converts_the_layers_measured_faster_or_all_of_a_local_model(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_llama(layers=1).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    # this machine measured "kernel" at one token for the MLP's 128x64 / 64x128 linears only
    dispatch.record(CPU, {dispatch.case_key(torch.float32, "2:4", *shape, 1): {"implementation": "kernel"}
                          for shape in ((128, 64), (64, 128))})
    pairs = {where: e2e_suite.prepare(str(model_dir), "2:4", where, "auto", 1, 16, 3, torch.float32, CPU)
             for where in ("faster", "all")}
    faster, every = (pairs[where].record for where in ("faster", "all"))
    assert faster["sparse_where"] == "faster" and every["sparse_where"] == "all"
    assert faster["sparse_layers"] == 3 and every["sparse_layers"] == 7  # gate, up, down; all seven
    for pair in pairs.values():
        assert pair.max_rel_logit_error <= e2e_suite.TOLERANCE[torch.float32]
        assert pair.fp32_error["dense"] == 0.0 and pair.excess_error == pair.max_rel_logit_error  # fp32: dense is it
        assert pair.record["top1_agreement_sparse_vs_dense"] == 1.0 and pair.record["same_generated_tokens"]
        assert pair.record["same_new_tokens_before_divergence"] == 3
    assert faster["weight_bytes"]["sparse"] < every["weight_bytes"]["sparse"]  # nn.Linear keeps no second copy
    # where each layer's backends came from
    assert every["decision_sources"] == {"1": {"cache": 3, "fallback": 4}, "16": {"fallback": 7}}
    assert every["decisions"]["model.layers.0.mlp.down_proj"] == {"1": ["kernel", "cache"], "16": ["dense", "fallback"]}
    assert every["decisions"]["model.layers.0.self_attn.q_proj"] == {"1": ["dense", "fallback"],
                                                                     "16": ["dense", "fallback"]}
    assert every["tuned_on_first_use"] == {"cases": 0, "seconds": 0.0}
    # the suite's records of these cases, timed at 10 / 5 ms (prefill) and 40 / 20 ms (decode), make the results
    times = {("prefill", "dense"): 0.01, ("prefill", "sparse"): 0.005, ("decode", "dense"): 0.04,
             ("decode", "sparse"): 0.02}
    run = _run(*[(e2e_suite.extra_info(pairs[where], phase, side, CPU), seconds / 2)
                 for where in ("faster", "all") for (phase, side), seconds in times.items()])
    report.write_results(run, str(tmp_path))
    saved = json.loads((tmp_path / "e2e-cpu.json").read_text())
    assert saved["settings"] == {"layers_of_llama_7b_shape": 1, "backend": "auto", "sparse_where": ["faster", "all"]}
    assert [(r["sparse_where"], r["sparse_layers"]) for r in saved["results"]] == [("faster", 3), ("all", 7)]
    row = saved["results"][1]
    assert row == dict(row, model=str(model_dir), pattern="2:4", prefill_tokens=16, new_tokens=3, repeats=3,
                       dense_prefill_ms=10.0, sparse_prefill_ms=5.0, prefill_speedup=2.0, dense_decode_tok_s=50.0,
                       sparse_decode_tok_s=100.0, decode_speedup=2.0, same_generated_tokens=True,
                       dense_weight_bytes=every["weight_bytes"]["dense"], decisions=every["decisions"],
                       logit_error={"sparse_vs_dense": pairs["all"].max_rel_logit_error,
                                    "vs_fp32": pairs["all"].fp32_error})
    md = (tmp_path / "e2e-cpu.md").read_text()
    assert "prefill speedup" in md and "| 2:4 | all | 7 | " in md and "| cache 3, fallback 4; fallback 7 |" in md


def test_the_suites_timed_give_results_files(tmp_path):
    """A real timed run (one round of a few tiny ops and SparseLinear cases) through pytest-benchmark's JSON to
    the results files (end to end: the suite's own records, in the test above)."""
    out = tmp_path / "run.json"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}  # a run of its own
    env.update(PYPRUNE_TUNE="0", PYPRUNE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/test_ops.py", "benchmarks/test_sparse_linear.py",
                           "-q", "-rs", "-p", "no:cacheprovider", "--benchmark-only", "--benchmark-min-rounds", "1",
                           "--benchmark-max-time", "0", "--benchmark-json", str(out), "--fill-bytes", str(1 << 20),
                           "-k", "64x128-topk_mask-row or float32-64x128-2:4 and M1"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for backend in set(dispatch.IMPLEMENTATIONS) - {"kernel", "dense"}:  # every backend is a case; these need CUDA
        assert f"{backend} unavailable: it needs CUDA tensors" in done.stdout
    names = [Path(p).name for p in report.write_results(json.loads(out.read_text()), str(tmp_path), tag="run")]
    assert names == ["ops-cpu-run-float32.json", "ops-cpu-run-float32.md", "sparse-linear-cpu-run.json",
                     "sparse-linear-cpu-run.md", "sparse-linear-cpu-run-float32.svg"]
    ops_rows = json.loads((tmp_path / "ops-cpu-run-float32.json").read_text())["results"]
    assert [r["op"] for r in ops_rows] == ["topk_mask row 50%"] and ops_rows[0]["times_byte_floor"] > 0
    rows = json.loads((tmp_path / "sparse-linear-cpu-run.json").read_text())["results"]
    assert [r["backend"] for r in rows] == ["kernel", "dense"]
    assert all(r["ms"] > 0 and r["speedup"] > 0 and r["max_rel_error"] <= 1e-4 for r in rows)
    assert all(r["weight_copies"] == (1 << 20) // (64 * 128 * 4) for r in rows)  # 32 KiB weights fill 1 MiB
    assert "| 64×128 | 1 | float32 | 2:4 | kernel |" in (tmp_path / "sparse-linear-cpu-run.md").read_text()


def test_dress_speed_benchmark_on_a_local_and_a_random_tiny_model(tmp_path, monkeypatch):
    from pyprune.nn.measure import model_cost
    from pyprune.nn import keep_hidden_channels_
    model_dir = tmp_path / "tiny"
    tiny_llama(layers=1).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    monkeypatch.setitem(bench_dress_speed.REAL_MODEL, "tiny-llama-shape", ("TinyLlama", 3))
    assert bench_dress_speed.main(["--device", "cpu", "--models", str(model_dir), "tiny-llama-shape",
                                   "--layers", "1", "--prefill-tokens", "16", "--prompt-tokens", "4",
                                   "--new-tokens", "2", "--batch", "2", "--repeat", "2",
                                   "--output-dir", str(tmp_path), "--name", "dress"]) == 0
    report = json.loads((tmp_path / "dress.json").read_text())
    assert report["environment"]["cpu_threads"] >= 1 and len(report["settings"]["load_average_after"]) == 3
    # both tiny models have tiny_llama's shapes: the costs are those of tiny_llama sliced 64 -> 48
    reference = tiny_llama(layers=1)
    dense_cost = model_cost(reference, 16)
    keep_hidden_channels_(reference, torch.arange(48))
    sliced_cost = model_cost(reference, 16)
    loaded, random = report["results"]
    assert (loaded["weights"], random["weights"]) == ("loaded", "random")
    for row in (loaded, random):
        assert row["hidden_size"] == {"dense": 64, "sliced": 48} and row["layers"] == 1
        assert row["cost"] == {"dense": dense_cost, "sliced": sliced_cost}
        assert row["parameter_ratio"] == round(dense_cost["parameters"] / sliced_cost["parameters"], 3)
        assert {label: len(times) for label, times in row["times_s"].items()} == {
            f"{model}_{part}": 2 for model in ("dense", "sliced") for part in ("prefill", "generate", "prompt")}
        assert min(row["dense_prefill_ms"], row["sliced_prefill_ms"], row["dense_decode_tok_s"],
                   row["sliced_decode_tok_s"]) > 0
        assert row["prefill_speedup"] == round(row["dense_prefill_ms"] / row["sliced_prefill_ms"], 3)
        assert row["decode_speedup"] == round(row["sliced_decode_tok_s"] / row["dense_decode_tok_s"], 3)
    assert report["notes"] == [bench_dress_speed.depth_note(random)]
    assert "depth is reduced to 1 of 3 decoder layers" in report["notes"][0]
    md = (tmp_path / "dress.md").read_text()
    assert "| prefill dense ms | prefill sliced ms | prefill ratio |" in md
    assert f"| tiny-llama-shape (random weights) | 1 | float32 | 64 → 48 | {random['dense_prefill_ms']} |" in md
    assert report["notes"][0] in md


def test_dress_speed_benchmark_rejects_a_non_positive_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_dress_speed.main(["--batch", "0"])
    assert exit_info.value.code == 2 and "--batch: must be a positive integer; got 0" in capsys.readouterr().err


def test_distributed_speed_benchmark_times_one_process_and_two_ranks_beside_the_time_model(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    assert bench_distributed.main(["--model", str(model_dir), "--calib", str(text), "--nsamples", "8", "--seqlen", "16",
                                   "--batch-size", "2", "--runs", "sparsegpt:2:4", "--output-dir", str(tmp_path),
                                   "--name", "dist", "--note", "tiny"]) == 0
    report = json.loads((tmp_path / "dist.json").read_text())
    [row] = report["results"]
    assert [(run["ranks"], run["threads"]) for run in row["runs"].values()] == [(1, 2), (2, 1)]
    assert all(run["prune_s"] > 0 and run["wall_s"] > run["prune_s"] and run["sparsity"] == 0.5
               for run in row["runs"].values())
    predicted = row["predicted"]
    assert set(predicted["cpu"]) == set(row["runs"]) and set(predicted["gpu"]) == {"1 GPU", "2 GPUs", "8 GPUs"}
    one, two = (predicted["cpu"][label] for label in row["runs"])
    assert one["communication"] == 0 < two["communication"] and two["solves"] < 2 * one["solves"]
    assert min(report["rates"].values()) > 0 and report["link"] > 0 and report["settings"]["uptime_before"]
    md = (tmp_path / "dist.md").read_text()
    assert "| sparsegpt | 2:4 | 2 ranks × 1 thread |" in md and "- tiny" in md


def test_distributed_speed_benchmark_predicts_a_training_prune_again_from_a_results_file(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    timed = {"environment": {"cpu": {"model": "test CPU"}}, "notes": ["timed"], "rates": {}, "link": 1.0,
             "settings": {"model": str(model_dir), "calib": str(text), "nsamples": 8, "seqlen": 16, "batch_size": 2,
                          "extra": [], "started": "then", "load_average_before": [0.1], "uptime_before": "up",
                          "load_average_after": [0.2], "uptime_after": "up"},
             "results": [{"method": "safe+", "pattern": "2:4", "runs": {
                 label: {"ranks": ranks, "threads": threads, "prune_s": 10.0 * ranks, "wall_s": 12.0 * ranks,
                         "sparsity": 0.5} for label, ranks, threads in bench_distributed.CONFIGS}}]}
    (tmp_path / "timed.json").write_text(json.dumps(timed))
    assert bench_distributed.main(["--predict-from", str(tmp_path / "timed.json"), "--output-dir", str(tmp_path),
                                   "--name", "again"]) == 0
    report = json.loads((tmp_path / "again.json").read_text())
    [row] = report["results"]
    assert row["runs"] == timed["results"][0]["runs"] and report["notes"] == ["timed"]
    assert row["steps_per_block"] == 3 * 8 // 2  # the default 3 epochs of minibatches of 2 of the 8 windows
    assert row["training_step"]["train_batch"] == 2 and min(row["training_step"]["step_s"].values()) > 0
    one, two = (row["predicted"]["cpu"][label] for label in row["runs"])
    blocks = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert one["communication"] == 0 < two["communication"]
    step_s = row["training_step"]["step_s"]  # predictions are rounded to the microsecond
    assert one["training"] == pytest.approx(blocks * 12 * step_s["whole"] / 2, rel=1e-4, abs=1e-6)
    assert two["training"] == pytest.approx(blocks * 12 * step_s["share"], rel=1e-4, abs=1e-6)
    md = (tmp_path / "again.md").read_text()
    assert "| safe+ | 2:4 | 2 ranks × 1 thread | 20.0 |" in md and "after the timed prunes" in md


def test_time_model_costs_a_training_step_as_its_passes_of_forward_and_backward():
    from time_model import training_parts
    layers = [(2, 3, 4), (3, 2, 4)]  # P_active = 12 weights a token, 12 weights
    rates = {"fwd": 8.0, "fp32": 6.0}
    one = training_parts(layers, 1, rates, link=16.0, steps=5, step_tokens=2)
    two = training_parts(layers, 2, rates, link=16.0, steps=5, step_tokens=2)
    assert one == {"forward": 2 * 2 * 12 * 4 / 8.0, "training": 5 * 2 * 3 * 2 * 12 * 2 / 6.0, "communication": 0}
    assert two["training"] == one["training"] / 2 and two["communication"] == 5 * 2 * (2 * 1 / 2) * 4 * 12 / 16.0
    measured = training_parts(layers, 2, rates, link=16.0, steps=5, step_tokens=2, step_seconds=0.5)
    assert measured["training"] == 2.5 and measured["forward"] == two["forward"]


def test_robustness_arm_cost_counts_each_measured_prune_over_its_passes(tiny_model_dir, tmp_path):
    """Each prune is timed at the given calibration with one gradient pass and, for a method of several,
    with two, split into a fixed part and a pass (their difference), and counted over the method's passes
    (Taylor's one pass is the prune as measured); an arm at its first ratio is its prunes (noise floor
    included) and evaluations, a further ratio its evaluations alone; the command sums them over seeds and
    ratios."""
    output = tmp_path / "cost.json"
    assert robustness_arm_cost.main(["--model", str(tiny_model_dir[0]), "--methods", "taylor", "moreau",
                                     "--arithmetic", "rounding", "--nsamples", "2", "--seqlen", "16",
                                     "--eval-tokens", "64", "--eval-seqlen", "16", "--seeds", "0", "1",
                                     "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["batch_size"] == robustness.BATCH_SIZE
    prunes = {(p["format"], p["method"]): p for p in result["prunes"]}
    assert {key: p["passes"] for key, p in prunes.items()} == {
        ("bfloat16", "taylor"): 1, ("float16", "taylor"): 1, ("bfloat16", "moreau"): 10, ("float16", "moreau"): 10}
    for (_, method), p in prunes.items():
        assert p["measured_s"] > 0 and len(p["wall_s"]) == (2 if method == "moreau" else 1)
        if method == "taylor":
            assert p["measured_2_passes_s"] is None and p["full_s"] == p["measured_s"] == p["pass_s"]
        else:
            assert p["pass_s"] == pytest.approx(max(p["measured_2_passes_s"] - p["measured_s"], 0.0))
            assert p["fixed_s"] == pytest.approx(max(p["measured_s"] - p["pass_s"], 0.0))
            assert p["full_s"] == pytest.approx(p["fixed_s"] + p["pass_s"] * 10)
    [evaluation] = result["evaluations"]
    taylor, moreau = result["arms"]
    assert (taylor["prunes"], moreau["prunes"]) == (2, 4)  # the noise floor: a second draw in bf16 and in fp16
    assert moreau["first_ratio_s"] == pytest.approx(2 * (prunes["bfloat16", "moreau"]["full_s"]
                                                         + prunes["float16", "moreau"]["full_s"])
                                                    + 4 * evaluation["measured_s"])
    assert taylor["further_ratio_s"] == pytest.approx(2 * evaluation["measured_s"])
    assert moreau["command_s"] == pytest.approx(2 * (moreau["first_ratio_s"] + moreau["further_ratio_s"]))
    assert "| rounding | moreau | 4 | 4 |" in (tmp_path / "cost.md").read_text()
