"""The speed benchmarks as pytest-benchmark suites: ops (test_ops.py), SparseLinear (test_sparse_linear.py)
and end to end (test_e2e.py).

    pytest benchmarks --benchmark-only --size full --benchmark-json run.json   # time the real tables
    python benchmarks/report.py run.json                                       # results files from it
    pytest benchmarks --benchmark-only --benchmark-autosave                    # keep a run (.benchmarks/)
    pytest benchmarks --benchmark-only --benchmark-compare                     # against the last one kept
    python -m pytest -n 2                                                      # CI: tiny, nothing timed

Timing runs only when asked for (``--benchmark-only`` or ``--benchmark-enable``; not under xdist's ``-n``,
which pytest-benchmark refuses); otherwise every case runs once, as under ``--benchmark-disable``, and
checks its result, and SparseLinear tunes nothing on first use (``PYPRUNE_TUNE=0``). Every case records
what it is (suite, op or layer, shape, dtype, device, bytes moved...) in ``benchmark.extra_info``; the
machine and versions (``_common.machine_record``) go to the JSON's ``machine_info["pyprune"]``.
"""
import os

import pytest
import torch
from _common import default_device, machine_record, roofline

from pyprune.nn import tuning

#: Size presets: ``full`` for the results tables, ``tiny`` for CI.
SIZES = ("tiny", "full")


def pytest_addoption(parser):
    group = parser.getgroup("pyprune benchmarks")
    group.addoption("--size", choices=SIZES, default="tiny",
                    help="case sizes: tiny (CI, the default) or full (LLaMA-7B shapes, the results tables)")
    group.addoption("--device", default=None, help="cpu or cuda (default: cuda when available)")
    group.addoption("--dtype", action="append", choices=["float32", "float16", "bfloat16"],
                    help="dtypes to run (repeat the option; default: each suite's for the device)")
    group.addoption("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    group.addoption("--shapes", nargs="+", default=None,
                    help="SparseLinear: OUTxIN weight shapes (default: the size preset's)")
    group.addoption("--tokens", nargs="+", type=int, default=None,
                    help="SparseLinear: token counts M (default: the size preset's)")
    group.addoption("--fill-bytes", type=int, default=None,
                    help="SparseLinear on a CPU: cycle through copies of each layer whose weights fill this many "
                         "bytes (default: twice the last-level cache at full size; 0: one copy, called from cache)")
    group.addoption("--models", nargs="+", default=None,
                    help="end to end: smollm2-135m, llama-7b-shape, smollm2-135m-shape, or a model directory")
    group.addoption("--layers", type=int, default=None, help="end to end: decoder layers of the *-shape models")
    group.addoption("--prefill-tokens", type=int, default=None, help="end to end: tokens of the timed prefill")
    group.addoption("--new-tokens", type=int, default=None,
                    help="end to end: new tokens of the decode (at least 2: the first comes from the prompt)")
    group.addoption("--sparse-where", nargs="+", choices=["faster", "all"], default=None,
                    help="end to end: faster (only the linears measured faster sparse at one token, as pyprune "
                         "generate; the full size's default), all (every N:M linear); tiny runs both")
    group.addoption("--backend", default="auto", help="end to end: SparseLinear's backend (default auto)")


def pytest_configure(config):
    """Before pytest-benchmark reads its options (its hook runs last): no timing unless asked for, and
    ``--dist`` (in the project's addopts) dropped from a timing run without ``-n``, which pytest-benchmark
    would take for xdist."""
    timing = config.getoption("benchmark_only") or config.getoption("benchmark_enable")
    if not timing:
        config.option.benchmark_disable = True
        os.environ.setdefault(tuning.SWITCH, "0")  # nor does SparseLinear time a case on first use
    elif not config.getoption("numprocesses", None):
        config.option.dist = "no"
    if config.getoption("threads"):
        torch.set_num_threads(config.getoption("threads"))


def pytest_benchmark_update_machine_info(config, machine_info):
    device = default_device(config.getoption("device"))
    machine_info["pyprune"] = dict(machine_record(device), roofline=roofline(device))


@pytest.fixture(scope="session")
def device(request):
    return default_device(request.config.getoption("device"))


@pytest.fixture(scope="session")
def size(request):
    return request.config.getoption("size")
