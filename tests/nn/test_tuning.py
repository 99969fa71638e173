"""Tune on first use: SparseLinear(implementation="auto") times kernel against dense where this
environment has no answer of its own, keeps the answer in a cache keyed by the whole environment
(the CPU's model, family / model / stepping, ISA flags and last-level cache, torch, pyprune, thread
count; written atomically, safe with concurrent writers), never times with PYPRUNE_TUNE=0 or while
torch.compile traces (then such a case runs dense), and never uses another machine's answers: a
shipped table's row applies only in its very environment, and there a ``kernel`` row is measured
again before it runs."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from pyprune import ops
from pyprune.nn import SparseLinear, dispatch, sparsify_, tuning
from pyprune.nn import sparse as sparse_module
from pyprune.ops.library import native as native_module

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
        return layer.choose_implementation(torch.zeros(tokens, layer.in_features, dtype=dtype))


def _present_cpu(monkeypatch, cpu):
    """Make ``cpu`` (a :func:`dispatch.cpu_identity`) the CPU this process runs on."""
    monkeypatch.setattr(dispatch, "this_cpu", lambda: cpu)


#: /proc/cpuinfo of the two machines of issue 50: a hypervisor names both "AMD EPYC"; the AVX2 Zen 3
#: measured the shipped rows, the AVX-512-BF16 Zen 4 got them (two processors each, as on a VM).
_PROCESSOR = ("processor\t: {index}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
              "model name\t: AMD EPYC\nstepping\t: 1\ncache size\t: 512 KB\nflags\t\t: {flags}\n"
              "power management:\n")
ZEN3_FLAGS = "fpu sse sse2 avx fma f16c avx2 bmi2 sha_ni vaes"
ZEN4_FLAGS = ZEN3_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512_vbmi2"
ZEN3, ZEN4 = ("\n".join(_PROCESSOR.format(index=i, model=model, flags=flags) for i in range(2))
              for model, flags in (("1", ZEN3_FLAGS), ("17", ZEN4_FLAGS)))


def _table(path, env, entries):
    """A shipped table at ``path`` holding one block: ``entries`` measured in ``env``."""
    path.write_text(json.dumps({"environments": [{"environment": env, "entries": entries}]}))
    return str(path)


@pytest.mark.parametrize("speedup,expected", [(2.0, "kernel"), (1.0, "dense")])
def test_first_use_measures_once_and_keeps_the_answer(timings, speedup, expected, capsys):
    timings["speedup"] = speedup
    layer = _layer()
    assert _choose(layer) == expected and timings["calls"] == 1
    assert layer.decisions == {"1": (expected, "measured")}
    key = dispatch.case_key(torch.float32, "2:4", 32, 64, 1)
    entry = dispatch.cached_entries(CPU)[key]
    assert entry["implementation"] == expected and entry["sparse_speedup_vs_dense"] == speedup
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


def test_notices_off_measures_without_the_notice(timings, capsys):
    """The CLI's --quiet (tuning.notices_off): the first-use measurement still runs, silently."""
    timings["speedup"] = 2.0
    with tuning.notices_off():
        assert _choose(_layer()) == "kernel" and timings["calls"] == 1
    assert "timing SparseLinear" not in capsys.readouterr().err
    assert _choose(_layer(seed=1), tokens=3) == "kernel"  # a new bucket outside the block: announced
    assert "timing SparseLinear" in capsys.readouterr().err


def test_cache_file_is_replaced_atomically_and_read_back(timings, monkeypatch):
    path = dispatch.record(CPU, {"k|1": {"implementation": "kernel"}})
    payload = json.loads(open(path, encoding="utf-8").read())
    assert payload == {"environment": dispatch.environment(CPU), "entries": {"k|1": {"implementation": "kernel"}}}
    assert path == dispatch.cache_path(CPU) and path.startswith(dispatch.cache_root())
    assert dispatch.cached_entries(CPU) == {"k|1": {"implementation": "kernel"}}

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        dispatch.record(CPU, {"k|2": {"implementation": "dense"}})
    monkeypatch.undo()
    assert json.loads(open(path, encoding="utf-8").read()) == payload  # the old file, whole
    assert sorted(os.listdir(os.path.dirname(path))) == sorted([os.path.basename(path),
                                                                os.path.basename(path) + ".lock"])
    with pytest.raises(ValueError, match="implementation must be one of"):
        dispatch.record(CPU, {"k|3": {"implementation": "fast"}})


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
    dispatch.record(torch.device("cpu"), {f"{sys.argv[1]}|{i}": {"implementation": "dense"}})
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
    assert entries[dispatch.case_key(torch.float32, "2:4", 32, 64, 1)]["implementation"] in ("kernel", "dense")
    assert {f"{name}|{i}" for name in "ab" for i in range(40)} <= set(entries)


#: Each part of the environment changed alone: another CPU of the same name (ISA flags, model
#: number, stepping, last-level cache), another torch, pyprune, native kernels' ISA level or thread
#: count.
def _another(value: str) -> str:
    """A number string other than ``value`` (a CPU's model number or stepping)."""
    return str(int(value) + 1) if value.isdigit() else "1"


#: Per key part: this machine's CPU identity with that part changed (a function of the present one, so the
#: change is one on every CPU, the Zen 3 with flags avx2 f16c fma and model 1 included), or None for parts
#: changed otherwise.
OTHER = {"flags": lambda cpu: {"flags": sorted(set(cpu["flags"]) ^ {"avx512_bf16"})},
         "model_number": lambda cpu: {"model_number": _another(cpu["model_number"])},
         "stepping": lambda cpu: {"stepping": _another(cpu["stepping"])},
         "llc": lambda cpu: {"llc_bytes": 2 * cpu["llc_bytes"] or 16 << 20}, "torch": None, "pyprune": None,
         "kernels": None, "threads": None}


@contextlib.contextmanager
def _other_environment(part):
    """This process's environment with ``part`` (a key of OTHER) changed, for the block."""
    threads, native, cap = torch.get_num_threads(), native_module("cpu"), None
    with pytest.MonkeyPatch.context() as patch:
        try:
            if part == "torch":
                patch.setattr(torch, "__version__", "0.0.1")
            elif part == "pyprune":
                patch.setattr(dispatch, "__version__", "0.0.1")
            elif part == "kernels":  # the C++ kernels capped at another level (any x86-64 CI CPU has AVX2)
                cap = native.limit_cpu_isa("generic" if native.cpu_isa() != "generic" else "avx2")
            elif part == "threads":
                torch.set_num_threads(threads + 1)
            else:
                cpu = dispatch.this_cpu()
                _present_cpu(patch, dict(cpu, **OTHER[part](cpu)))
            yield
        finally:
            torch.set_num_threads(threads)
            if cap is not None:
                native.limit_cpu_isa(cap)


@pytest.mark.parametrize("part", sorted(OTHER))
def test_changing_any_key_part_measures_again(timings, part):
    assert _choose(_layer()) and timings["calls"] == 1
    assert _choose(_layer()) and timings["calls"] == 1
    old_path = dispatch.cache_path(CPU)
    with _other_environment(part):
        assert dispatch.cache_path(CPU) != old_path and dispatch.cached_entries(CPU) == {}
        layer = _layer()
        assert _choose(layer) and timings["calls"] == 2 and layer.decisions["1"][1] == "measured"


def test_cpu_identity_tells_apart_cpus_a_hypervisor_names_alike():
    zen3, zen4 = dispatch.cpu_identity(ZEN3, 32 << 20), dispatch.cpu_identity(ZEN4, 32 << 20)
    assert zen4 == {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": "25", "model_number": "17",
                    "stepping": "1", "llc_bytes": 32 << 20,
                    "flags": ["avx2", "avx512_bf16", "avx512_vbmi2", "avx512_vnni", "avx512bw", "avx512dq",
                              "avx512f", "avx512vl", "f16c", "fma"]}
    assert zen3["model"] == zen4["model"] and zen3["flags"] == ["avx2", "f16c", "fma"] and zen3 != zen4
    assert dispatch.cpu_identity(ZEN4, 16 << 20) != zen4  # the cache size is part of it
    assert dispatch.cpu_identity("", 0)["flags"] == []
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="llc_bytes must be a size in bytes"):
            dispatch.cpu_identity(ZEN4, bad)
    with pytest.raises(ValueError, match="cpuinfo must be the text"):
        dispatch.cpu_identity(None, 0)


def test_the_machine_key_and_the_cache_follow_the_presented_cpu(monkeypatch):
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN4, 32 << 20))
    assert dispatch.device_key(CPU) == "cpu/AMD EPYC/25.17.1/avx512_bf16/LLC 32 MiB"
    zen4_env, zen4_path = dispatch.environment(CPU), dispatch.cache_path(CPU)
    assert zen4_env["machine"] == dict(dispatch.cpu_identity(ZEN4, 32 << 20), device="cpu")
    assert zen4_env["threads"] == torch.get_num_threads() and zen4_env["torch"] == torch.__version__
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN3, 32 << 20))
    assert dispatch.device_key(CPU) == "cpu/AMD EPYC/25.1.1/avx2/LLC 32 MiB"
    assert dispatch.cache_path(CPU) != zen4_path


def test_cpu_caches_are_read_from_sysfs_and_size_the_eviction(tmp_path, monkeypatch):
    for index, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "32K"),
                                                 ("2", "Unified", "2048K"), ("3", "Unified", "105M")]):
        (tmp_path / f"index{index}").mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / f"index{index}" / name).write_text(value + "\n")
    (tmp_path / "uevent").write_text("")
    assert dispatch.cpu_caches(str(tmp_path)) == {"L1d": 48 << 10, "L1i": 32 << 10, "L2u": 2 << 20, "L3u": 105 << 20}
    assert dispatch.cpu_caches(str(tmp_path / "absent")) == {}
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN4, 16 << 20))
    assert tuning.last_level_cache_bytes() == 16 << 20
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN4, 0))  # sysfs did not say
    assert tuning.last_level_cache_bytes() == 32 << 20


def test_the_off_switch_never_times(timings, monkeypatch, tmp_path):
    monkeypatch.setenv("PYPRUNE_TUNE", "0")
    key = dispatch.case_key(torch.float32, "2:4", 32, 64, 1)
    # a shipped row of this very environment naming the kernel: unconfirmed, so not used
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", _table(tmp_path / "table.json", dispatch.environment(CPU),
                                                        {key: {"implementation": "kernel"}}))
    layer = _layer()
    assert _choose(layer) == dispatch.FALLBACK_IMPLEMENTATION and layer.decisions == {"1": ("dense", "fallback")}
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.mul_(ops.score_nm_mask(model[0].weight, 2, 4))
    assert sparsify_(model, faster_at=1) == {}  # no measurement says sparse pays: left dense
    assert timings["calls"] == 0 and not os.path.exists(dispatch.cache_path(CPU))
    dispatch.record(CPU, {key: {"implementation": "kernel"}})
    layer = _layer()
    assert _choose(layer) == "kernel" and timings["calls"] == 0  # switched off, this machine's cache answers
    assert layer.decisions == {"1": ("kernel", "cache")} and set(sparsify_(model, faster_at=1)) == {"0"}
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
    assert timings["calls"] == 2  # 32×64 twice and its transpose 64×32: two shape buckets


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = _layer()

    def forward(self, x):
        return torch.relu(self.sparse(x))


def test_under_torch_compile_a_layer_never_times_and_runs_dense_unless_eager_decided(timings, monkeypatch):
    """While torch.compile traces no file is read and nothing is timed: a case eager forwards
    decided keeps that implementation in the graph, any other runs dense, a cache's kernel answer too."""
    dispatch.record(CPU, {dispatch.case_key(torch.float32, "2:4", 32, 64, t): {"implementation": "kernel"} for t in (1, 3)})
    timings["speedup"] = 2.0  # what a measurement would say, were one taken
    module = _Tiny()
    x = torch.randn(3, 64)
    kernel_calls = []
    real = sparse_module.call  # how the kernel implementation calls the nm_linear op
    monkeypatch.setattr(sparse_module, "call", lambda *a: kernel_calls.append(1) or real(*a))
    with torch.no_grad():
        out = torch.compile(module, backend="eager")(x)
        assert timings["calls"] == 0 and module.sparse.decisions == {} and module.sparse._choices == {}
        assert kernel_calls == [] and "dense" in module.sparse._cache  # the dense weight, built in the graph
        torch.testing.assert_close(out, torch.relu(module.sparse.forward_on("dense", x)))
        decided = _Tiny()
        assert _choose(decided.sparse, tokens=1) == "kernel"  # eager, one token: the cache answers
        torch.compile(decided, backend="eager")(x[:1])
        assert kernel_calls and "dense" not in decided.sparse._cache and timings["calls"] == 0


def test_a_shipped_row_applies_only_in_its_own_environment(timings, tmp_path, monkeypatch):
    """Issue 50: rows measured on an AVX2 Zen 3 named ``AMD EPYC`` are no answer on an AVX-512-BF16
    Zen 4 of the same name: this machine measures for itself (or runs dense with tuning off)."""
    one, four = (dispatch.case_key(torch.float32, "2:4", 32, 64, t) for t in (1, 4))
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN3, 32 << 20))
    zen3 = dispatch.environment(CPU)
    _present_cpu(monkeypatch, dispatch.cpu_identity(ZEN4, 32 << 20))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", _table(tmp_path / "table.json", zen3,
                                                        {one: {"implementation": "kernel"}, four: {"implementation": "dense"}}))
    monkeypatch.setenv("PYPRUNE_TUNE", "0")
    layer = _layer()
    assert _choose(layer, 1) == _choose(layer, 4) == "dense" and timings["calls"] == 0
    assert layer.decisions == {"1": ("dense", "fallback"), "4": ("dense", "fallback")}  # never "prior"
    monkeypatch.setenv("PYPRUNE_TUNE", "1")
    timings["speedup"] = 0.2  # as oneDNN's native bf16 GEMM beat the kernel on Zen 4
    layer = _layer()
    assert _choose(layer, 1) == _choose(layer, 4) == "dense" and timings["calls"] == 2
    assert layer.decisions == {"1": ("dense", "measured"), "4": ("dense", "measured")}


@pytest.mark.parametrize("part", sorted(OTHER))
def test_no_part_of_another_environment_lets_its_rows_apply(timings, tmp_path, monkeypatch, part):
    one, four = (dispatch.case_key(torch.float32, "2:4", 32, 64, t) for t in (1, 4))
    with _other_environment(part):
        other = dispatch.environment(CPU)
    monkeypatch.setenv("PYPRUNE_TUNE", "0")
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", _table(tmp_path / "table.json", other,
                                                        {one: {"implementation": "kernel"}, four: {"implementation": "dense"}}))
    assert other != dispatch.environment(CPU) and dispatch.prior_entries(CPU) == {}
    layer = _layer()
    assert _choose(layer, 1) == _choose(layer, 4) == "dense"
    assert layer.decisions == {"1": ("dense", "fallback"), "4": ("dense", "fallback")}


@pytest.mark.parametrize("speedup,expected", [(2.0, "kernel"), (1.0, "dense")])
def test_a_shipped_kernel_row_of_this_environment_is_measured_before_it_runs(timings, tmp_path, monkeypatch,
                                                                             speedup, expected):
    """A prior ``kernel`` row, even of this very environment, runs only once a measurement here
    confirms it (the measurement wins and goes to the cache); a prior ``dense`` row runs as is."""
    one, four = (dispatch.case_key(torch.float32, "2:4", 32, 64, t) for t in (1, 4))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", _table(tmp_path / "table.json", dispatch.environment(CPU),
                                                        {one: {"implementation": "kernel"}, four: {"implementation": "dense"}}))
    timings["speedup"] = speedup
    layer = _layer()
    assert _choose(layer, 4) == "dense" and timings["calls"] == 0 and layer.decisions == {"4": ("dense", "prior")}
    assert _choose(layer, 1) == expected and timings["calls"] == 1 and layer.decisions["1"] == (expected, "measured")
    assert dispatch.cached_entries(CPU)[one]["implementation"] == expected and four not in dispatch.cached_entries(CPU)
    other = _layer(seed=1)
    assert _choose(other, 1) == expected and timings["calls"] == 1 and other.decisions == {"1": (expected, "cache")}
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.mul_(ops.score_nm_mask(model[0].weight, 2, 4))
    assert set(sparsify_(model, faster_at=1)) == ({"0"} if expected == "kernel" else set())
    assert timings["calls"] == 1  # the cache answers now


def test_the_cache_overrides_the_shipped_table(timings, tmp_path, monkeypatch):
    key = dispatch.case_key(torch.float32, "2:4", 32, 64, 1)
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", _table(tmp_path / "table.json", dispatch.environment(CPU),
                                                        {key: {"implementation": "dense"}}))
    dispatch.record(CPU, {key: {"implementation": "kernel"}})
    layer = _layer()
    assert _choose(layer) == "kernel" and timings["calls"] == 0 and layer.decisions == {"1": ("kernel", "cache")}


def test_a_table_without_environments_or_with_an_unknown_implementation_is_refused(tmp_path, monkeypatch):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"entries": {"cpu/avx2/AMD EPYC|float32|2:4|2^11|1": {"implementation": "kernel"}}}))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(old))
    with pytest.raises(ValueError, match=r"dispatch table .*old.json must be \{\"environments\""):
        _choose(_layer())
    with pytest.raises(ValueError, match=r"dispatch table .*bad.json: entry 'float32\|2:4\|2\^11\|1' names implementation "
                                         r"'fast'; allowed: kernel, dense"):
        dispatch.table(_table(tmp_path / "bad.json", {}, {"float32|2:4|2^11|1": {"implementation": "fast"}}))
    assert dispatch.table(str(tmp_path / "absent.json")) == []
    # every shipped block names the whole environment it was measured in, as this process's is named
    own = dispatch.environment(torch.device("cpu"))
    shipped = dispatch.table(dispatch.TABLE_PATH)
    assert shipped, "the shipped table has no block"
    for block in shipped:
        assert block["environment"].keys() == own.keys()
        assert block["environment"]["machine"].keys() == own["machine"].keys()


def test_interleaved_rounds_alternate_and_respect_the_bounds():
    calls = []
    base, times, ratios = tuning.interleaved(lambda: calls.append("b"), {"k": lambda: calls.append("k")}, 9,
                                             budget_s=0.0, min_rounds=3, before_each=lambda: calls.append("e"))
    assert calls == ["b", "k"] + ["e", "b", "e", "k"] * 3  # warm-up, then 3 rounds: the budget is spent
    assert set(times) == set(ratios) == {"k"} and base >= 0 and ratios["k"] > 0
    calls.clear()
    tuning.interleaved(lambda: calls.append("b"), {"k": lambda: calls.append("k")}, 5)
    assert calls.count("b") == 6  # no budget: every round


def test_dense_implementation_at_prefill_size_decompresses_once(monkeypatch):
    """M = 256 on the dense implementation: F.linear on the cached dense weight, never a new copy per call."""
    import pyprune.ops as pyprune_ops
    layer = _layer(256, 64)
    layer.implementation = "dense"
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
