"""The benchmark harnesses run on CPU in CI (tiny shapes), so they never rot: every file they
promise is written, rows carry the measured numbers, and the dispatch table they build is one
SparseLinear reads."""
import json
import os
import sys

import pytest
import torch
import transformers

from pyprune.nn import SparseLinear, dispatch

from .helpers import tiny_llama, tiny_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_e2e  # noqa: E402
import bench_ops  # noqa: E402
import bench_sparse_linear  # noqa: E402
import crosscheck_wanda  # noqa: E402


def test_sparse_linear_benchmark_writes_results_plots_and_a_dispatch_table(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    assert bench_sparse_linear.main(["--device", "cpu", "--shapes", "64x128", "--tokens", "1", "32",
                                     "--dtypes", "float32", "--repeat", "1", "--output-dir",
                                     str(tmp_path), "--name", "sl", "--write-dispatch", str(table)]) == 0
    report = json.loads((tmp_path / "sl.json").read_text())
    assert report["environment"]["dispatch_device"] == "cpu"
    rows = report["results"]
    assert {r["backend"] for r in rows} == set(dispatch.BACKENDS)
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["backend"] for r in ran} == {"kernel", "dense"}
    assert all(r["ms"] > 0 and r["speedup"] > 0 and r["max_rel_error"] <= 1e-4 for r in ran)
    assert all(r["status"].startswith("unavailable") for r in rows if r["backend"] not in ("kernel", "dense"))
    assert "| 64×128 | 1 | float32 | 2:4 | kernel |" in (tmp_path / "sl.md").read_text()
    assert (tmp_path / "sl-float32.svg").read_text().startswith("<svg")
    entries = json.loads(table.read_text())["entries"]
    assert set(entries) == {f"cpu|float32|{p}|{c}" for p in ("2:4", "4:8") for c in ("decode", "prefill")}
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    layer = SparseLinear(128, 64)
    with torch.no_grad():
        assert layer.choose_backend(torch.zeros(1, 128)) == entries["cpu|float32|2:4|decode"]["backend"]


def test_e2e_benchmark_runs_on_a_local_model(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_llama(layers=1).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    assert bench_e2e.main(["--device", "cpu", "--models", str(model_dir), "--prefill", "16",
                           "--decode", "2", "--repeat", "1", "--output-dir", str(tmp_path),
                           "--name", "e2e"]) == 0
    row = json.loads((tmp_path / "e2e.json").read_text())["results"][0]
    assert row["sparse_layers"] == 7 and row["top1_agreement_sparse_vs_dense"] == 1.0
    assert row["dense_prefill_ms"] > 0 and row["sparse_decode_tok_s"] > 0
    assert "prefill speedup" in (tmp_path / "e2e.md").read_text()


def test_ops_benchmark_quick_run(tmp_path):
    out = tmp_path / "ops.json"
    assert bench_ops.main(["--quick", "--only", "nm_linear", "--repeat", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["op"].startswith("nm_linear") and r["speedup"] > 0 for r in rows)


def test_svg_plot_rejects_empty_input():
    from _common import svg_line_plot
    with pytest.raises(ValueError, match="at least one point"):
        svg_line_plot({}, "t", "x", "y")


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
