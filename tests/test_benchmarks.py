"""The benchmark harnesses run on CPU in CI (tiny shapes), so they never rot: every file they
promise is written, rows carry the measured numbers, and the dispatch table they build is one
SparseLinear reads."""
import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from pyprune.nn import SparseLinear, dispatch

from tests.helpers import tiny_llama, tiny_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_dress_speed  # noqa: E402
import bench_e2e  # noqa: E402
import bench_ops  # noqa: E402
import bench_sparse_linear  # noqa: E402
import continual_seeds_smollm2  # noqa: E402
import continual_smollm2  # noqa: E402
import crosscheck_wanda  # noqa: E402
import dress_smollm2  # noqa: E402


def test_sparse_linear_benchmark_writes_results_plots_and_a_dispatch_table(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    assert bench_sparse_linear.main(["--device", "cpu", "--shapes", "64x128", "--tokens", "1", "300",
                                     "--dtypes", "float32", "--repeat", "1", "--fill-bytes", str(1 << 20), "--output-dir",
                                     str(tmp_path), "--name", "sl", "--write-dispatch", str(table)]) == 0
    report = json.loads((tmp_path / "sl.json").read_text())
    cpu_device = torch.device("cpu")
    env = report["environment"]
    assert env["dispatch_device"] == dispatch.device_key(cpu_device)
    assert env["dispatch_environment"] == dispatch.environment(cpu_device)
    cpu = env["cpu"]  # the machine as the dispatch keys it, every cache level and the load
    assert {k: cpu[k] for k in dispatch.this_cpu()} == dispatch.this_cpu() and cpu["model"]
    assert cpu["caches"] == dispatch.cpu_caches() and len(cpu["load_average"]) == 3
    rows = report["results"]
    assert {r["backend"] for r in rows} == set(dispatch.IMPLEMENTATIONS)
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["backend"] for r in ran} == {"kernel", "dense"}
    assert all(r["ms"] > 0 and r["speedup"] > 0 and r["max_rel_error"] <= 1e-4 for r in ran)
    # each call takes the next of the copies that fill --fill-bytes (32 KiB weights in 1 MiB)
    assert report["environment"]["weight_fill_bytes"] == 1 << 20
    assert all(r["weight_copies"] == (1 << 20) // (64 * 128 * 4) for r in rows)
    assert all(r["status"].startswith("unavailable") for r in rows if r["backend"] not in ("kernel", "dense"))
    assert "| 64×128 | 1 | float32 | 2:4 | kernel |" in (tmp_path / "sl.md").read_text()
    assert (tmp_path / "sl-float32.svg").read_text().startswith("<svg")
    [block] = json.loads(table.read_text())["environments"]  # this run's environment and its rows
    assert block["environment"] == dispatch.environment(cpu_device)
    entries = block["entries"]
    assert set(entries) == {f"float32|{p}|2^13|{t}" for p in ("2:4", "4:8") for t in ("1", "many")}
    for key, entry in entries.items():  # sparse only where it measured >= 1.05x dense
        speedup = entry["sparse_geomean_speedup_vs_dense"]
        assert (entry["implementation"] != "dense") == (speedup is not None and speedup >= dispatch.MIN_SPEEDUP)
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    layer = SparseLinear(128, 64)
    with torch.no_grad():  # tuning off: a dense row runs as is, a kernel row is not taken unmeasured
        assert layer.choose_implementation(torch.zeros(1, 128)) == "dense"
    assert layer.decisions["1"] == ("dense", "prior" if entries["float32|2:4|2^13|1"]["implementation"] == "dense"
                                    else "fallback")
    # another environment's block stays when this one's is written again; an unattributable table is refused
    other = dict(block, environment=dict(block["environment"], threads=block["environment"]["threads"] + 1))
    table.write_text(json.dumps({"environments": [other, block]}))
    bench_sparse_linear.write_dispatch({"environment": env, "results": report["results"][:1]}, str(table), "again")
    assert json.loads(table.read_text())["environments"][0] == other
    assert json.loads(table.read_text())["environments"][1]["entries"]["float32|2:4|2^13|1"]["source"] == "again"
    table.write_text(json.dumps({"entries": {}}))
    with pytest.raises(ValueError, match="must be {\"environments\""):
        bench_sparse_linear.main(["--write-dispatch", str(table), "--shapes", "64x128"])


def test_e2e_benchmark_runs_on_a_local_model(tmp_path, monkeypatch):
    model_dir = tmp_path / "tiny"
    tiny_llama(layers=1).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    # this machine measured "kernel" at one token for the MLP's 128x64 / 64x128 linears only
    dispatch.record(torch.device("cpu"), {dispatch.case_key(torch.float32, "2:4", 128, 64, 1): {"implementation": "kernel"}})
    common = ["--device", "cpu", "--models", str(model_dir), "--patterns", "2:4", "--prefill", "16",
              "--decode", "2", "--repeat", "1", "--output-dir", str(tmp_path)]
    assert bench_e2e.main(common + ["--name", "e2e-default"]) == 0
    assert bench_e2e.main(common + ["--name", "e2e", "--sparse-where", "faster", "all"]) == 0
    [default] = json.loads((tmp_path / "e2e-default.json").read_text())["results"]
    faster, every = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert default["sparse_where"] == faster["sparse_where"] == "faster" and every["sparse_where"] == "all"
    assert default["sparse_layers"] == 3
    assert faster["sparse_layers"] == 3 and every["sparse_layers"] == 7  # gate, up, down; all seven
    for row in (faster, every):
        assert row["top1_agreement_sparse_vs_dense"] == 1.0 and row["same_generated_tokens"]
        assert row["dense_prefill_ms"] > 0 and row["sparse_decode_tok_s"] > 0
    assert faster["sparse_weight_bytes"] < every["sparse_weight_bytes"]  # nn.Linear keeps no second copy
    assert "prefill speedup" in (tmp_path / "e2e.md").read_text()
    # the machine as the dispatch keys it, the load, and where each layer's backends came from
    env = json.loads((tmp_path / "e2e.json").read_text())["environment"]
    assert env["dispatch_environment"] == dispatch.environment(torch.device("cpu"))
    assert env["cpu"]["flags"] == dispatch.this_cpu()["flags"] and len(every["load_average"]) == 3
    assert every["decision_sources"] == {"1": {"cache": 3, "fallback": 4}, "16": {"fallback": 7}}
    assert every["decisions"]["model.layers.0.mlp.down_proj"] == {"1": ["kernel", "cache"], "16": ["dense", "fallback"]}
    assert every["decisions"]["model.layers.0.self_attn.q_proj"] == {"1": ["dense", "fallback"],
                                                                     "16": ["dense", "fallback"]}


def test_ops_benchmark_quick_run(tmp_path):
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "nm_linear", "--repeat", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["op"].startswith("nm_linear") and r["speedup"] > 0 for r in rows)
    assert not any("byte_floor_ms" in r for r in rows)  # not a mask op


def test_ops_benchmark_mask_rows_measure_the_byte_floor(tmp_path):
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "topk_mask", "--repeat", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["topk_mask row 50%", "topk_mask tensor 50%", "score_topk_mask wanda row 50%"] * 2
    for r in rows:
        assert r["byte_floor_ms"] > 0 and abs(r["times_byte_floor"] - r["pyprune_ms"] / r["byte_floor_ms"]) < 0.02
    assert "| × floor |" in (tmp_path / "ops.md").read_text()


def test_ops_benchmark_safe_step_quick_run(tmp_path):
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "SAFE", "--repeat", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["baseline"].split(" ")[-1] for r in rows] == ["math", "AdamW(foreach=True)", "AdamW(fused=True)"]
    assert all(r["shape"] == "block of 7: 0.8M" and r["pyprune_ms"] > 0 and r["speedup"] > 0 for r in rows)
    assert "| SAFE x-step (sam_perturb_ + sam_adam_step_) | block of 7: 0.8M | float32 |" in (tmp_path / "ops.md").read_text()


def test_svg_plot_rejects_empty_input():
    from _common import svg_line_plot
    with pytest.raises(ValueError, match="at least one point"):
        svg_line_plot({}, "t", "x", "y")


def test_previous_result_resumes_the_same_settings_and_refuses_a_file_of_others(tmp_path):
    from _common import previous_result, write_json
    path = tmp_path / "study.json"
    assert previous_result(str(path), {"seed": 0}) is None
    write_json(str(path), {"settings": {"seed": 0, "tokens": 2048}, "rows": [{"ppl": 1.5}]})
    before = path.read_text()
    assert previous_result(str(path), {"seed": 0, "tokens": 2048})["rows"] == [{"ppl": 1.5}]
    with pytest.raises(SystemExit, match=r"--output .*study.json holds results of other settings "
                                         r"\(differing: seed, tokens\)"):
        previous_result(str(path), {"seed": 1, "tokens": 8192})
    assert path.read_text() == before


def test_results_lock_admits_one_writer_at_a_time(tmp_path):
    import fcntl
    from _common import locked
    path = str(tmp_path / "rows.json")
    with locked(path):
        with open(f"{path}.lock", "w") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(f"{path}.lock", "w") as other:  # released on leaving the block
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_dress_benchmark_tells_trained_rows_apart_by_learning_rate_and_seed():
    def options(*argv):
        args = argparse.Namespace(lam=1.0, lr=1e-3, norm="l2", train_batch=4, train_seed=0, steps=150)
        for name, value in zip(argv[::2], argv[1::2]):
            setattr(args, name, value)
        return {label: dict(opts, channels="quiet") for label, opts, _ in dress_smollm2.arms(args, {"dress", "npr"})}
    stored = options()
    for changed in (options("lr", 3e-3), options("train_seed", 1)):
        for label, opts in changed.items():
            row = {"label": label, "lr": 1e-3, "train_batch": 4, **stored[label]}
            assert dress_smollm2.is_row(row, label, stored[label]) and not dress_smollm2.is_row(row, label, opts)


def test_dress_benchmark_groups_a_setting_over_its_training_seeds():
    def row(label, seed=None, lr=1e-3, steps=150, ppl=60.0):
        return {"channels": "quiet", "label": label, "lam": None if label == "npr" else 250.0, "lr": lr,
                "norm": "l2", "train_batch": 4, "steps": 0 if label == "npr" else steps, "train_steps": steps,
                "rescale_norms": True, "slice_mass_ratio": 0.5, "ppl_sliced": {"pride_and_prejudice": ppl},
                **({} if seed is None else {"train_seed": seed})}
    rows = [row("prox", ppl=60.0), row("prox", seed=1, ppl=62.0), row("prox", lr=3e-3),  # other lr: alone
            row("npr", ppl=58.0), row("npr", seed=2, ppl=57.0), row("slice", steps=0)]
    groups = dress_smollm2.seed_groups(rows)
    assert [(first["label"], [r["ppl_sliced"]["pride_and_prejudice"] for r in group]) for first, group in groups] \
        == [("prox", [60.0, 62.0]), ("npr", [58.0, 57.0])]
    from _common import mean_std
    assert mean_std([60.0, 62.0], ".2f") == "61.00 ± 1.41"
    assert mean_std([60.0, None], ".2f") == "60.00" and mean_std([None]) == "–"

def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("crosscheck_wanda.py: error: ")
    return err


def test_crosscheck_without_a_wanda_checkout_exits_2_at_once(tmp_path, capsys):
    assert crosscheck_wanda.main([]) == 2
    assert "--wanda-repo is required" in _one_line_error(capsys)
    missing = tmp_path / "nowhere"
    assert crosscheck_wanda.main(["--wanda-repo", str(missing), "--python", sys.executable]) == 2
    assert f"--wanda-repo {str(missing)!r} is not a directory" in _one_line_error(capsys)
    assert crosscheck_wanda.main(["--wanda-repo", str(tmp_path), "--python", sys.executable]) == 2
    assert "is not a checkout of locuslab/wanda (no lib/prune.py, lib/sparsegpt.py" in _one_line_error(capsys)


def test_crosscheck_without_a_transformers_4_36_python_exits_2_at_once(tmp_path, capsys):
    for name in crosscheck_wanda.AUTHORS_FILES:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert crosscheck_wanda.main(["--wanda-repo", str(tmp_path)]) == 2
    assert "--python is required" in _one_line_error(capsys)
    assert crosscheck_wanda.main(["--wanda-repo", str(tmp_path), "--python", str(tmp_path / "python")]) == 2
    assert "cannot be run" in _one_line_error(capsys)
    assert crosscheck_wanda.main(["--wanda-repo", str(tmp_path), "--python", sys.executable]) == 2
    assert f"has transformers {transformers.__version__}; the authors' code needs 4.36.x" in _one_line_error(capsys)


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


def test_every_op_has_a_benchmark_row(tmp_path):
    """Each public op of pyprune.ops (the implementation switch aside) is timed by bench_ops against its
    eager PyTorch baseline, and the two agree where the op is a pure function of its inputs."""
    import pyprune.ops as ops
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "magnitude_score", "wanda_score", "taylor_score", "soft_threshold",
                           "nm_decompress", "moreau_perturb_", "--repeat", "1", "--output", str(out)]) == 0
    timed = {r["op"].split(" ")[0] for r in json.loads(out.read_text())["results"]}
    assert {"magnitude_score", "wanda_score", "taylor_score", "soft_threshold", "nm_decompress",
            "moreau_perturb_"} <= timed
    source = Path(bench_ops.__file__).read_text()
    public_ops = [name for name in ops.__all__ if callable(getattr(ops, name)) and name != "use_implementation"]
    assert [name for name in public_ops if f"ops.{name}(" not in source] == []
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    values, meta = ops.nm_compress(w, ops.score_nm_mask(w, 2, 4), 2, 4)
    assert torch.equal(bench_ops.eager_decompress(values, meta, 2, 4), ops.nm_decompress(values, meta, 2, 4))


def test_continual_benchmark_runs_the_chosen_orders_and_refuses_one_outside_its_protocol(capsys):
    datasets = ["austen", "moby_dick", "python"]
    assert len(continual_smollm2.selected_orders(datasets, "all", None)) == 6
    assert continual_smollm2.selected_orders(datasets, "all", ["python,austen,moby_dick", "austen,moby_dick,python",
                                                                "python,austen,moby_dick"]) == [
        ("python", "austen", "moby_dick"), ("austen", "moby_dick", "python")]
    with pytest.raises(SystemExit, match="--orders: python,austen,moby_dick is not an order .* allowed: "
                                         "austen,moby_dick,python$"):
        continual_smollm2.selected_orders(datasets, "given", ["python,austen,moby_dick"])
    with pytest.raises(SystemExit, match="--orders: austen,python is not an order"):
        continual_smollm2.main(["--orders", "austen,python"])  # refused before the model loads


def _continual_result(seed, rows):
    """A continual_smollm2 results file over datasets a, b: ``rows`` maps a method label to its
    orders, each (P[step 1][a], P[step 1][b], P[step 2][a], P[step 2][b])."""
    def steps(order, p):
        return [{"pruned_on": order[0], "perplexity": {"a": p[0], "b": p[1]}},
                {"pruned_on": order[1], "perplexity": {"a": p[2], "b": p[3]}}]
    return {"settings": {"datasets": ["a", "b"], "permutations": "all", "calibration": f"2 x 8 tokens (seed {seed})",
                         "evaluation": "16 tokens"}, "dense": {"a": 1.0, "b": 1.0},
            "rows": [{"pattern": "2:4", "method": method, "init": "cumulative", "partial": len(runs) < 2,
                      "matrix": [{"order": list(order), "steps": steps(order, p)} for order, p in runs.items()]}
                     for method, runs in rows.items()]}


def test_continual_seeds_summary_pairs_the_rows_every_seed_ran_over_their_common_orders():
    seed0 = _continual_result(0, {"copal": {("a", "b"): (10, 20, 13, 21), ("b", "a"): (30, 40, 31, 44)},
                                  "wanda": {("a", "b"): (10, 20, 12, 22), ("b", "a"): (1, 1, 1, 1)},
                                  "sparsegpt": {("a", "b"): (1, 1, 1, 1)}})
    seed1 = _continual_result(1, {"copal": {("a", "b"): (10, 20, 15, 23)}, "wanda": {("a", "b"): (10, 20, 11, 21)}})
    summary = continual_seeds_smollm2.merge([seed0, seed1])
    assert summary["orders"] == [["a", "b"]]  # the order (b, a) is missing from seed 1
    assert summary["settings"]["calibration"] == "2 x 8 tokens" and summary["settings"]["calibration_seeds"] == [0, 1]
    copal, wanda = summary["rows"]  # sparsegpt: seed 0 only
    assert (copal["method"], wanda["method"]) == ("copal", "wanda")
    # order a -> b: BWT of a = P[2][a] - P[1][a]; A-PPL = mean of the final P
    assert [p["a_bwt"] for p in copal["per_seed"]] == [3, 5] and [p["a_ppl"] for p in copal["per_seed"]] == [17, 19]
    assert (copal["a_bwt_mean"], copal["a_bwt_std"], copal["a_ppl_mean"], copal["a_ppl_std"]) == (4, 1, 18, 1)
    assert (wanda["a_bwt_mean"], wanda["a_ppl_mean"]) == (1.5, 16.5)
    text = continual_seeds_smollm2.markdown(summary)
    assert "| 2:4 | copal | cumulative | 4.000 ± 1.00 | 18.000 ± 1.00 | 3.000 / 17.000 | 5.000 / 19.000 |" in text
    assert "| 2:4 | wanda | cumulative | 1 | 1.00 / 16.00 |" in text
    with pytest.raises(SystemExit, match="each file must have its own calibration seed; got seeds \\[0, 0\\]"):
        continual_seeds_smollm2.merge([seed0, seed0])
    other = _continual_result(1, {"copal": {("a", "b"): (1, 1, 1, 1)}})
    other["settings"]["evaluation"] = "32 tokens"
    with pytest.raises(SystemExit, match="differ in more than the calibration seed"):
        continual_seeds_smollm2.merge([seed0, other])


def test_continual_table_gives_each_partial_row_its_metrics_over_the_orders_it_finished():
    result = _continual_result(0, {"copal": {("a", "b"): (10, 20, 13, 21)}})
    text = continual_smollm2.markdown(result)
    assert "| 2:4 | copal (partial, 1 of 2 orders) | cumulative | 3.00 / 17.00 | – | 3.000 / 17.000 |" in text
    assert "No row has run every order" in text and "| A-BWT | M-BWT |" not in text
    result["rows"][0]["matrix"].append({"order": ["b", "a"], "steps": _continual_result(
        0, {"copal": {("b", "a"): (30, 40, 31, 44)}})["rows"][0]["matrix"][0]["steps"]})
    # b -> a: BWT of b = 44 - 40, final mean 37.5; over both orders A-BWT = mean of the per-dataset BWTs
    assert "| 3.00 / 17.00 | 4.00 / 37.50 | 3.500 ± 0.50 / 27.250 ± 10.25 |" in continual_smollm2.markdown(result)
