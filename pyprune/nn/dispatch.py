"""Which implementation runs a :class:`~pyprune.nn.SparseLinear` forward, from measurements of this very
environment.

Every measurement is keyed by its environment (:func:`environment`): the machine (:func:`machine`:
on a CPU the model name, vendor, family, model and stepping, the instruction-set flags of
:data:`ISA_FLAGS` it has and its last-level cache's size, as :func:`cpu_identity` reads them; on a
GPU its name and compute capability), torch and pyprune versions, the instruction-set level
pyprune's native kernels run at (:func:`native_kernels`), and torch's thread count. A hypervisor's ``AMD EPYC`` names every EPYC generation, so a
name alone never keys: AVX2 Zen 3 and AVX-512-BF16 Zen 4 are other environments. Within one, a case
(:func:`case_key`) is the dtype, N:M pattern, shape bucket (out and in, each rounded up to a power of
two: a matrix and its transpose are two cases, the kernel's speed differs between them) and token bucket (1, 2, 4 … 256, or ``many``), and its entry names the sparse implementation that
measured at least :data:`MIN_SPEEDUP` times as fast as dense ``F.linear``, or ``dense``.

Two stores hold entries, in one shape: a block ``{"environment": {...}, "entries": {case: entry}}``.

* The per-user cache, this environment's own measurements: one block per file,
  ``$PYPRUNE_CACHE/dispatch/<hash of the environment>.json`` (default cache root
  ``~/.cache/pyprune``), written by :func:`record` (under a file lock, atomically: concurrent tuners
  never leave a partial file and keep each other's answers), filled by :mod:`pyprune.nn.tuning` on
  first use and by ``pyprune tune``.
* The shipped table, a prior: ``{"environments": [block, ...]}`` in ``dispatch_table.json`` next to
  this file (or the file named by ``PYPRUNE_DISPATCH_TABLE``), written by
  ``benchmarks/report.py --write-dispatch`` from a timed run of ``benchmarks/test_sparse_linear.py``.
  A block applies only where its environment equals this process's exactly.

:func:`answer` gives what may be used as is: the cache's entry (source ``cache``), else a prior
``dense`` entry (``prior``). A prior naming a sparse implementation is no answer: the caller measures the
case first where :func:`pyprune.nn.tuning.can_tune` (``measured``, recorded in the cache), and runs
dense where it cannot (:data:`FALLBACK_IMPLEMENTATION`, ``fallback``): sparse never runs without a
measurement of this environment, taken here, saying it pays.

An entry names its implementation in ``implementation``; entries written before that name
(``backend``, and ``mma_sp`` for ``sparse24_linear``) still read (:func:`entry_implementation`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch

from .. import __version__
from ..files import cache_root, ensure_cache_dir, write_json
from ..ops.library import native

#: Every SparseLinear implementation. ``kernel``: pyprune.ops.nm_linear (Triton on GPU, C++ on CPU);
#: ``dense``: F.linear on the weight decompressed once and cached (cuBLAS/MKL/oneDNN);
#: ``cusparselt`` / ``cutlass``: torch's 2:4 semi-structured tensors; ``sparse24_linear``:
#: pyprune.ops.sparse24_linear, pyprune's CUDA 2:4 sparse tensor-core GEMM.
IMPLEMENTATIONS = ("kernel", "dense", "cusparselt", "cutlass", "sparse24_linear")
#: Former names of implementations, still read from stored entries and accepted (with a
#: DeprecationWarning) by SparseLinear until the next release.
FORMER_NAMES = {"mma_sp": "sparse24_linear"}
#: The implementation where this environment has no answer of its own: never slower than dense.
FALLBACK_IMPLEMENTATION = "dense"
#: A sparse implementation is named only where it measured at least this speedup over dense.
MIN_SPEEDUP = 1.05
#: Token counts up to the last are rounded up to the next one; more are ``many``.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_table.json")
#: The /proc/cpuinfo flags pyprune's kernels or oneDNN's GEMMs use, roughly from the least to the most
#: capable (:func:`device_key` shows the last one a CPU has).
ISA_FLAGS = ("fma", "f16c", "avx2", "avx_vnni", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vbmi2",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
#: Where sysfs lists the first CPU's caches (one ``index<i>`` directory per cache).
SYSFS_CACHES = "/sys/devices/system/cpu/cpu0/cache"
#: Where a layer's implementation came from: this environment's cache, the shipped table (a ``dense`` row
#: of this very environment), a measurement taken here (a prior naming sparse is one, confirmed or
#: overruled), or no usable answer at all (dense).
SOURCES = ("cache", "prior", "measured", "fallback")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- the machine -------------------------------------------------------------------------------------

def cpu_identity(cpuinfo: str, llc_bytes: int) -> Dict:
    """The CPU that ``cpuinfo`` (/proc/cpuinfo's text; its first processor) describes, with a
    last-level cache of ``llc_bytes`` (0: unknown): model name, vendor, family, model number,
    stepping, the sorted :data:`ISA_FLAGS` it has and ``llc_bytes``."""
    if not isinstance(cpuinfo, str):
        raise ValueError(f"cpuinfo must be the text of /proc/cpuinfo; got {type(cpuinfo).__name__}")
    if isinstance(llc_bytes, bool) or not isinstance(llc_bytes, int) or llc_bytes < 0:
        raise ValueError(f"llc_bytes must be a size in bytes >= 0 (0: unknown); got {llc_bytes!r}")
    fields: Dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:
            break  # the blank line after the first processor
        fields.setdefault(key.strip(), value.strip())
    return {"model": fields.get("model name", ""), "vendor": fields.get("vendor_id", ""),
            "family": fields.get("cpu family", ""), "model_number": fields.get("model", ""),
            "stepping": fields.get("stepping", ""),
            "flags": sorted(set(fields.get("flags", "").split()) & set(ISA_FLAGS)), "llc_bytes": llc_bytes}


def cpu_caches(root: str = SYSFS_CACHES) -> Dict[str, int]:
    """{``L1d``, ``L1i``, ``L2u``, ``L3u`` ...: bytes} of the caches sysfs lists under ``root``
    (level, then the first letter of the type; empty where it lists none)."""
    caches = {}
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            level, kind, size = (_read_text(os.path.join(root, index, name)) for name in ("level", "type", "size"))
        except OSError:  # not a cache's directory
            continue
        digits = size.rstrip("KMG")
        if digits.isdigit():
            caches[f"L{level}{kind[:1].lower()}"] = int(digits) * _SIZE_UNITS.get(size[len(digits):], 1)
    return caches


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read().strip()


def _cpuinfo_text() -> str:
    try:
        return _read_text("/proc/cpuinfo")
    except OSError:  # not Linux: the name the platform gives, nothing more
        return f"model name: {platform.processor() or platform.machine()}"


@lru_cache(maxsize=None)
def this_cpu() -> Dict:
    """:func:`cpu_identity` of this machine, its last-level cache the largest :func:`cpu_caches`
    lists (read once per process; tests replace this function to present another CPU)."""
    return cpu_identity(_cpuinfo_text(), max(cpu_caches().values(), default=0))


@lru_cache(maxsize=None)
def _cuda_identity(index: Optional[int]) -> Dict:
    major, minor = torch.cuda.get_device_capability(index)
    return {"device": "cuda", "name": torch.cuda.get_device_name(index), "capability": f"sm{major}{minor}"}


def machine(device: torch.device) -> Dict:
    """What sets a measurement's speed on ``device`` besides software: on a CPU ``device: cpu`` and
    :func:`this_cpu`; on a CUDA device its name and compute capability."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_identity(device.index)
    return dict(device=device.type, **this_cpu()) if device.type == "cpu" else {"device": device.type}


def device_key(device: torch.device) -> str:
    """:func:`machine` in short, for people (e.g. ``cpu/AMD EPYC/25.17.1/avx512_bf16/LLC 32 MiB``,
    ``cuda/NVIDIA H200/sm90``); the stores key on the whole :func:`environment`."""
    found = machine(device)
    if found["device"] == "cuda":
        return f"cuda/{found['name']}/{found['capability']}"
    if found["device"] != "cpu":
        return found["device"]
    top = next((flag for flag in reversed(ISA_FLAGS) if flag in found["flags"]), "no-fma")
    return (f"cpu/{found['model']}/{found['family']}.{found['model_number']}.{found['stepping']}/{top}/"
            f"LLC {found['llc_bytes'] / (1 << 20):g} MiB")


def native_kernels(device: torch.device) -> str:
    """What pyprune's native kernels run on ``device``: on a CPU the instruction-set level of
    ``pyprune._C`` (its ``cpu_isa()``: the CPU's, capped by ``PYPRUNE_MAX_CPU_ISA`` or
    ``limit_cpu_isa``), on a GPU ``built``; ``missing`` where the extension is not built."""
    kind = torch.device(device).type
    module = native(kind) if kind in ("cpu", "cuda") else None
    if module is None:
        return "missing"
    return module.cpu_isa() if kind == "cpu" else "built"


def environment(device: torch.device) -> Dict:
    """What a measurement depends on besides the case: :func:`machine`, torch and pyprune versions,
    :func:`native_kernels` and torch's thread count (more threads move the point where sparse pays)."""
    return {"machine": machine(device), "torch": torch.__version__, "pyprune": __version__,
            "native_kernels": native_kernels(device), "threads": torch.get_num_threads()}


def cpu_record() -> Dict:
    """The CPU as the dispatch keys it (:func:`this_cpu`), the size of every cache level in bytes
    (:func:`cpu_caches`) and the load average."""
    info = dict(this_cpu(), caches=cpu_caches())
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    return info


def _nvidia_driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment_record(device: torch.device) -> Dict:
    """The machine and library versions a result (a benchmark's, a study's) was measured with:
    :func:`device_key` and :func:`environment` in full, threads, versions, which native kernels
    are built, the time; on a CPU :func:`cpu_record`, on a GPU the CUDA, driver, capability and
    cuSPARSELt versions."""
    device = torch.device(device)
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({this_cpu()['model']})",
        "dispatch_device": device_key(device),
        "dispatch_environment": environment(device),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pyprune": __version__,
        "native_cpu_kernels": native("cpu") is not None,
        "native_cuda_kernels": native("cuda") is not None,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cpu":
        info["cpu"] = cpu_record()
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["driver"] = _nvidia_driver()
        info["capability"] = "sm%d%d" % torch.cuda.get_device_capability(device)
        try:
            info["cusparselt"] = torch.backends.cusparselt.version()
        except (AttributeError, RuntimeError):
            info["cusparselt"] = None
    return info


# -- cases ---------------------------------------------------------------------------------------------

def token_bucket(tokens: int) -> str:
    return next((str(b) for b in TOKEN_BUCKETS if tokens <= b), "many")


def shape_bucket(out_features: int, in_features: int) -> str:
    """``2^ax2^b``: out and in features, each rounded up to a power of two (out first: the compressed
    dimension is in, so 576×1536 and 1536×576 are two buckets)."""
    return "x".join(f"2^{max(size - 1, 0).bit_length()}" for size in (out_features, in_features))


def entry_key(dtype: torch.dtype, pattern: str, shape: str, tokens: str) -> str:
    """``<dtype>|<pattern>|<shape bucket>|<token bucket>``, e.g. ``bfloat16|2:4|2^12x2^12|256``."""
    return f"{str(dtype).replace('torch.', '')}|{pattern}|{shape}|{tokens}"


def case_key(dtype: torch.dtype, pattern: str, out_features: int, in_features: int, tokens: int) -> str:
    """The key, in the cache and the table, of a layer's forward of ``tokens`` tokens."""
    return entry_key(dtype, pattern, shape_bucket(out_features, in_features), token_bucket(tokens))


def answer(device: torch.device, dtype: torch.dtype, pattern: str, out_features: int,
           in_features: int, tokens: int) -> Optional[Tuple[Dict, str]]:
    """(entry, source) that may be used as is for this case: this environment's cache entry
    (``cache``), else the shipped table's ``dense`` entry for this very environment (``prior``);
    else None (a prior naming a sparse implementation included: it is measured before it is used)."""
    key = case_key(dtype, pattern, out_features, in_features, tokens)
    entry = cached_entries(device).get(key)
    if entry is not None:
        return entry, "cache"
    entry = prior_entries(device).get(key)
    return (entry, "prior") if entry is not None and entry_implementation(entry) == "dense" else None


def entry_implementation(entry) -> Optional[str]:
    """The implementation a stored entry names (``implementation``, or ``backend`` in entries
    written before; former names mapped to current ones), or None where it names none."""
    if not isinstance(entry, dict):
        return None
    name = entry.get("implementation", entry.get("backend"))
    name = FORMER_NAMES.get(name, name)
    return name if name in IMPLEMENTATIONS else None


# -- the shipped table (the prior) ---------------------------------------------------------------------

def table_path() -> str:
    return os.environ.get("PYPRUNE_DISPATCH_TABLE") or TABLE_PATH


def _stamp(path: str) -> Optional[tuple]:
    """What changes when the file at ``path`` is replaced or rewritten; None where there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino


def table(path: Optional[str] = None) -> List[Dict]:
    """The blocks of the shipped table at ``path`` (default :func:`table_path`; none where it is
    absent), re-read when the file changes; ValueError naming the file where it is malformed."""
    path = path or table_path()
    stamp = _stamp(path)
    return [] if stamp is None else _load_table(path, stamp)


@lru_cache(maxsize=8)
def _load_table(path: str, stamp: tuple) -> List[Dict]:
    with open(path, encoding="utf-8") as handle:
        payload = json.load(handle)
    blocks = payload.get("environments") if isinstance(payload, dict) else None
    if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and isinstance(b.get("environment"), dict) and isinstance(b.get("entries"), dict)
            for b in blocks):
        raise ValueError(f"dispatch table {path} must be {{\"environments\": [{{\"environment\": {{...}}, "
                         f"\"entries\": {{...}}}}, ...]}}: rows without the environment they were measured in "
                         "cannot be attributed to a machine; write it with benchmarks/report.py --write-dispatch "
                         "(from a timed run of benchmarks/test_sparse_linear.py)")
    for block in blocks:
        for key, entry in block["entries"].items():
            if entry_implementation(entry) is None:
                named = entry.get("implementation", entry.get("backend")) if isinstance(entry, dict) else entry
                raise ValueError(f"dispatch table {path}: entry {key!r} names implementation {named!r}; "
                                 f"allowed: {', '.join(IMPLEMENTATIONS)}")
    return blocks


def prior_entries(device: torch.device) -> Dict:
    """{case key: entry} of the shipped table's block of this very environment (none of another)."""
    env = environment(device)
    return next((block["entries"] for block in table() if block["environment"] == env), {})


# -- the per-user cache of measurements ------------------------------------------------------------

def cache_path(device: torch.device) -> str:
    """The cache file of this environment: a name derived from every part of :func:`environment`."""
    digest = hashlib.sha256(json.dumps(environment(device), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "dispatch", f"{digest}.json")


def _read_cache(path: str, env: Dict) -> Dict:
    """The cache file's entries; an absent, unreadable or other environment's file holds none."""
    try:
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(payload, dict) or payload.get("environment") != env:
        return {}
    entries = payload.get("entries")
    return {k: v for k, v in entries.items() if entry_implementation(v) is not None} \
        if isinstance(entries, dict) else {}


@lru_cache(maxsize=16)
def _read_cache_version(path: str, env_json: str, stamp: tuple) -> Dict:
    return _read_cache(path, json.loads(env_json))


def cached_entries(device: torch.device) -> Dict:
    """{case key: entry} measured in this environment (re-read when the file changes)."""
    path = cache_path(device)
    stamp = _stamp(path)
    return {} if stamp is None else _read_cache_version(path, json.dumps(environment(device), sort_keys=True), stamp)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on ``path + '.lock'`` (POSIX; elsewhere the atomic rename alone)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path + ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record(device: torch.device, entries: Dict[str, Dict]) -> str:
    """Add ``entries`` ({case key: entry with ``implementation``}) to this environment's cache file:
    under the lock the file is re-read, merged and replaced by a complete new file (written to a
    temporary name beside it, then renamed), so readers never see a partial file and concurrent
    writers keep each other's answers. Returns the file's path."""
    for key, entry in entries.items():
        if entry.get("implementation") not in IMPLEMENTATIONS:
            raise ValueError(f"entry {key!r}: implementation must be one of {', '.join(IMPLEMENTATIONS)}; "
                             f"got {entry.get('implementation')!r}")
    path, env = cache_path(device), environment(device)
    ensure_cache_dir(os.path.dirname(path))
    with _locked(path):
        merged = dict(_read_cache(path, env), **entries)
        write_json(path, {"environment": env, "entries": dict(sorted(merged.items()))})
    return path
