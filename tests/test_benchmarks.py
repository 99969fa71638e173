"""The benchmark harnesses run on CPU in CI (tiny shapes), so they never rot: every file they
promise is written, rows carry the measured numbers, and the dispatch table they build is one
SparseLinear reads."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from pyprune.nn import SparseLinear, dispatch

from tests.helpers import tiny_llama, tiny_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_dress_speed  # noqa: E402
import bench_e2e  # noqa: E402
import bench_ops  # noqa: E402
import bench_sparse_linear  # noqa: E402


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
    assert {r["backend"] for r in rows} == set(dispatch.BACKENDS)
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
        assert (entry["backend"] != "dense") == (speedup is not None and speedup >= dispatch.MIN_SPEEDUP)
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    layer = SparseLinear(128, 64)
    with torch.no_grad():  # tuning off: a dense row runs as is, a kernel row is not taken unmeasured
        assert layer.choose_backend(torch.zeros(1, 128)) == "dense"
    assert layer.decisions["1"] == ("dense", "prior" if entries["float32|2:4|2^13|1"]["backend"] == "dense"
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
    dispatch.record(torch.device("cpu"), {dispatch.case_key(torch.float32, "2:4", 128, 64, 1): {"backend": "kernel"}})
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
    """Each public op of pyprune.ops (the backend switch aside) is timed by bench_ops against its
    eager PyTorch baseline, and the two agree where the op is a pure function of its inputs."""
    import pyprune.ops as ops
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "magnitude_score", "wanda_score", "taylor_score", "soft_threshold",
                           "nm_decompress", "moreau_perturb_", "--repeat", "1", "--output", str(out)]) == 0
    timed = {r["op"].split(" ")[0] for r in json.loads(out.read_text())["results"]}
    assert {"magnitude_score", "wanda_score", "taylor_score", "soft_threshold", "nm_decompress",
            "moreau_perturb_"} <= timed
    source = Path(bench_ops.__file__).read_text()
    public_ops = [name for name in ops.__all__ if callable(getattr(ops, name)) and name != "use_backend"]
    assert [name for name in public_ops if f"ops.{name}(" not in source] == []
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    values, meta = ops.nm_compress(w, ops.score_nm_mask(w, 2, 4), 2, 4)
    assert torch.equal(bench_ops.eager_decompress(values, meta, 2, 4), ops.nm_decompress(values, meta, 2, 4))
