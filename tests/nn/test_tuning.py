"""Tune on first use: SparseLinear(backend="auto") times kernel against dense where neither the
per-user cache nor the shipped table answers, keeps the answer in a cache keyed by the machine,
torch, pyprune and thread count (written atomically, safe with concurrent writers), never times
with PYPRUNE_TUNE=0 or while torch.compile traces, and the cache overrides the shipped table."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pyprune import ops
from pyprune.nn import SparseLinear, dispatch, sparsify_, tuning

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layer(in_features=64, out_features=32, seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.mul_(ops.score_nm_mask(linear.weight, 2, 4))
    return SparseLinear.from_dense(linear, "2:4")


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """Tuning on, an empty shipped table, and every call of the timing function counted; the
    per-round speedup of the kernel it reports is ``timings["speedup"]`` when set (a chosen answer
    for the decision), else the real measurement's."""
    monkeypatch.setenv("PYPRUNE_TUNE", "1")
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(tmp_path / "no-table.json"))
    state = {"calls": 0, "speedup": None}
    real = tuning.interleaved

    def counted(*args, **kwargs):
        state["calls"] += 1
        base, times, ratios = real(*args, **kwargs)
        if state["speedup"] is not None:
            ratios = {name: state["speedup"] for name in ratios}
        return base, times, ratios
    monkeypatch.setattr(tuning, "interleaved", counted)
    monkeypatch.setattr(tuning, "_announced", [])  # as in a fresh process
    return state


def _choose(layer, tokens=1, dtype=torch.float32):
    with torch.no_grad():
        return layer.choose_backend(torch.zeros(tokens, layer.in_features, dtype=dtype))


@pytest.mark.parametrize("speedup,expected", [(2.0, "kernel"), (1.0, "dense")])
def test_first_use_measures_once_and_keeps_the_answer(timings, speedup, expected, capsys):
    timings["speedup"] = speedup
    layer = _layer()
    assert _choose(layer) == expected and timings["calls"] == 1
    assert layer.decisions == {"1": (expected, "measured")}
    key = dispatch.case_key(CPU, torch.float32, "2:4", 32, 64, 1)
    entry = dispatch.cached_entries(CPU)[key]
    assert entry["backend"] == expected and entry["sparse_speedup_vs_dense"] == speedup
    assert entry["kernel_ms"] > 0 and entry["dense_ms"] > 0 and entry["tokens"] == 1
    other = _layer(seed=1)
    assert _choose(other) == expected  # a new layer of the same bucket: the cache answers
    assert other.decisions == {"1": (expected, "cache")}
    assert _choose(layer, tokens=3) == expected and timings["calls"] == 2  # the 4-token bucket is new
    assert ("dense" in layer._cache) == (expected == "dense")  # the dense copy kept only when dense won
    with torch.no_grad():  # and the layer computes the same either way
        x = torch.randn(2, 64)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    err = capsys.readouterr().err  # two cases timed, announced once with where the answers go
    assert err.count("pyprune: timing SparseLinear kernel vs dense") == 1 and dispatch.cache_path(CPU) in err


def test_cache_file_is_replaced_atomically_and_read_back(timings, monkeypatch):
    path = dispatch.record(CPU, {"k|1": {"backend": "kernel"}})
    payload = json.loads(open(path, encoding="utf-8").read())
    assert payload == {"environment": dispatch.environment(CPU), "entries": {"k|1": {"backend": "kernel"}}}
    assert path == dispatch.cache_path(CPU) and path.startswith(dispatch.cache_root())
    assert dispatch.cached_entries(CPU) == {"k|1": {"backend": "kernel"}}

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        dispatch.record(CPU, {"k|2": {"backend": "dense"}})
    monkeypatch.undo()
    assert json.loads(open(path, encoding="utf-8").read()) == payload  # the old file, whole
    assert sorted(os.listdir(os.path.dirname(path))) == sorted([os.path.basename(path),
                                                                os.path.basename(path) + ".lock"])
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.record(CPU, {"k|3": {"backend": "fast"}})


_WORKER = """
import sys, torch
from pyprune import ops
from pyprune.nn import SparseLinear, dispatch
torch.manual_seed(0)
linear = torch.nn.Linear(64, 32)
with torch.no_grad():
    linear.weight.mul_(ops.score_nm_mask(linear.weight, 2, 4))
SparseLinear.from_dense(linear, "2:4").tune(1)  # the same key in both processes
for i in range(40):
    dispatch.record(torch.device("cpu"), {f"{sys.argv[1]}|{i}": {"backend": "dense"}})
"""


def test_two_processes_tuning_at_once_keep_a_valid_file_with_every_answer(timings, dispatch_cache_per_test):
    env = dict(os.environ, PYPRUNE_CACHE=dispatch_cache_per_test, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, name], env=env, stderr=subprocess.PIPE)
               for name in ("a", "b")]
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err.decode()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' environment
    try:
        path = dispatch.cache_path(CPU)
    finally:
        torch.set_num_threads(threads)
    entries = json.loads(open(path, encoding="utf-8").read())["entries"]
    assert entries[dispatch.case_key(CPU, torch.float32, "2:4", 32, 64, 1)]["backend"] in ("kernel", "dense")
    assert {f"{name}|{i}" for name in "ab" for i in range(40)} <= set(entries)


@pytest.mark.parametrize("part", ["cpu", "torch", "pyprune", "threads"])
def test_changing_any_key_part_measures_again(timings, monkeypatch, part):
    assert _choose(_layer()) and timings["calls"] == 1
    assert _choose(_layer()) and timings["calls"] == 1
    old_path = dispatch.cache_path(CPU)
    threads = torch.get_num_threads()
    if part == "cpu":
        monkeypatch.setattr(dispatch, "device_key", lambda device: "cpu/avx2/Another CPU")
    elif part == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    elif part == "pyprune":
        monkeypatch.setattr(dispatch, "__version__", "0.0.1")
    else:
        torch.set_num_threads(threads + 1)
    try:
        assert dispatch.cache_path(CPU) != old_path and dispatch.cached_entries(CPU) == {}
        assert _choose(_layer()) and timings["calls"] == 2
    finally:
        torch.set_num_threads(threads)


def test_the_off_switch_never_times(timings, monkeypatch):
    monkeypatch.setenv("PYPRUNE_TUNE", "0")
    layer = _layer()
    assert _choose(layer) == dispatch.FALLBACK_BACKEND and layer.decisions == {"1": ("dense", "fallback")}
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.mul_(ops.score_nm_mask(model[0].weight, 2, 4))
    assert sparsify_(model, faster_at=1) == {}  # no measurement says sparse pays: left dense
    assert timings["calls"] == 0 and not os.path.exists(dispatch.cache_path(CPU))
    dispatch.record(CPU, {dispatch.case_key(CPU, torch.float32, "2:4", 32, 64, 1): {"backend": "kernel"}})
    assert _choose(_layer()) == "kernel" and timings["calls"] == 0  # switched off, the cache still answers
    monkeypatch.setenv("PYPRUNE_TUNE", "yes")
    with pytest.raises(ValueError, match="PYPRUNE_TUNE must be 0"):
        _choose(_layer(), tokens=2)


def test_sparsify_faster_at_measures_unanswered_shapes(timings):
    timings["speedup"] = 2.0
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        for linear in model:
            linear.weight.mul_(ops.score_nm_mask(linear.weight, 2, 4))
    assert set(sparsify_(model, faster_at=1)) == {"0", "1", "2"}
    assert timings["calls"] == 1  # one weight-size bucket (2^11) for all three


def test_no_timing_while_torch_compile_traces(timings):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = _layer()

        def forward(self, x):
            return torch.relu(self.sparse(x))
    module = Tiny()
    x = torch.randn(3, 64)
    with torch.no_grad():
        out = torch.compile(module, backend="eager")(x)
        assert timings["calls"] == 0 and not os.path.exists(dispatch.cache_path(CPU))
        torch.testing.assert_close(out, torch.relu(module.sparse.forward_on("kernel", x)))


def test_the_shipped_table_answers_where_the_cache_has_nothing_and_the_cache_overrides_it(
        timings, tmp_path, monkeypatch):
    key = dispatch.case_key(CPU, torch.float32, "2:4", 32, 64, 1)
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": {key: {"backend": "kernel"}}}))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    layer = _layer()
    assert _choose(layer) == "kernel" and timings["calls"] == 0 and layer.decisions == {"1": ("kernel", "prior")}
    dispatch.record(CPU, {key: {"backend": "dense"}})
    layer = _layer()
    assert _choose(layer) == "dense" and timings["calls"] == 0 and layer.decisions == {"1": ("dense", "cache")}


def test_interleaved_rounds_alternate_and_respect_the_bounds():
    calls = []
    base, times, ratios = tuning.interleaved(lambda: calls.append("b"), {"k": lambda: calls.append("k")}, 9,
                                             budget_s=0.0, min_rounds=3, before_each=lambda: calls.append("e"))
    assert calls == ["b", "k"] + ["e", "b", "e", "k"] * 3  # warm-up, then 3 rounds: the budget is spent
    assert set(times) == set(ratios) == {"k"} and base >= 0 and ratios["k"] > 0
    calls.clear()
    tuning.interleaved(lambda: calls.append("b"), {"k": lambda: calls.append("k")}, 5)
    assert calls.count("b") == 6  # no budget: every round


def test_dense_backend_at_prefill_size_decompresses_once(monkeypatch):
    """M = 256 on the dense backend: F.linear on the cached dense weight, never a new copy per call."""
    import pyprune.ops as pyprune_ops
    layer = _layer(256, 64)
    layer.backend = "dense"
    decompressions = []
    real = pyprune_ops.nm_decompress
    monkeypatch.setattr(pyprune_ops, "nm_decompress", lambda *a: decompressions.append(1) or real(*a))
    seen = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: seen.append(w.data_ptr())
                        or real_linear(x, w, b))
    x = torch.randn(256, 256)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
    assert len(decompressions) == 1 and len(set(seen)) == 1 and len(seen) == 3
