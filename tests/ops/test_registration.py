"""Each op's implementations are registered where pyprune.ops.implementations says: one schema per
op, the reference as the CompositeExplicitAutograd fallback, pyprune._C's kernels at the CPU key,
pyprune._C_cuda's at the CUDA key (its source is checked, as no GPU build runs here), Triton at the
CUDA key where no native CUDA kernel is."""
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from pyprune import ops
from pyprune.ops import library

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _registered_in(source: Path, key: str):
    """The ops a csrc library.cpp registers under TORCH_LIBRARY_IMPL(pyprune, key, m)."""
    block = re.search(rf"TORCH_LIBRARY_IMPL\(pyprune, {key}, m\) \{{(.*?)\n\}}", source.read_text(), re.S)
    return set(re.findall(r'm\.impl\("(\w+)"', block.group(1)))


def test_every_op_is_defined_once_with_its_implementations_listed():
    defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("pyprune::")}
    assert defined == set(ops.IMPLEMENTATIONS)
    for op, names in ops.IMPLEMENTATIONS.items():
        assert names[0] == "reference" and set(names) <= set(ops.implementations.NAMES), op
        assert library.has_kernel(op, "CompositeExplicitAutograd"), op
        assert set(library.PYTHON_KERNELS[op]) == set(names) & {"reference", "triton"}, op


def test_native_cpu_kernels_are_registered_for_exactly_the_listed_ops(cpu_extension_is_built):
    listed = {op for op, names in ops.IMPLEMENTATIONS.items() if "cpu" in names}
    assert {op for op in ops.IMPLEMENTATIONS if library.has_kernel(op, "CPU")} == listed
    assert _registered_in(CSRC / "cpu" / "library.cpp", "CPU") == listed


def test_native_cuda_kernels_are_the_listed_ops_and_triton_takes_the_other_cuda_keys():
    listed = {op for op, names in ops.IMPLEMENTATIONS.items() if "cuda" in names}
    assert _registered_in(CSRC / "cuda" / "library.cpp", "CUDA") == listed
    for op, names in ops.IMPLEMENTATIONS.items():
        # CUDA tensors: the native kernel where built, else Triton, else the reference fallback
        expected = "cuda" in names and library.native("cuda") is not None or "triton" in names
        assert library.has_kernel(op, "CUDA") == expected, op



def test_without_the_native_extensions_every_op_runs_on_the_reference():
    """The schemas live in Python: a build without pyprune._C (nor _C_cuda) defines every op, and
    CPU tensors run the reference (the CompositeExplicitAutograd kernel); forcing "cpu" raises."""
    code = """
import sys
sys.modules["pyprune._C"] = sys.modules["pyprune._C_cuda"] = None  # importing them fails
import torch
from pyprune import ops
from pyprune.ops import library, reference as R
assert library.native("cpu") is None and not library.has_kernel("nm_mask", "CPU")
w = torch.randn(8, 16)
mask = ops.score_nm_mask(w, 2, 4)
values, meta = ops.nm_compress(w, mask, 2, 4)
x = torch.randn(3, 16)
assert torch.equal(mask, R.score_nm_mask(w, 2, 4))
assert torch.equal(ops.nm_linear(x, values, meta, 2, 4), R.nm_linear(x, values, meta, 2, 4))
try:
    with ops.use_implementation("cpu"):
        ops.nm_mask(w, 2, 4)
except RuntimeError as error:
    assert "implementation 'cpu' cannot run op 'nm_mask' on cpu tensors here" in str(error)
else:
    raise AssertionError("forcing cpu without pyprune._C ran")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYPRUNE_IMPLEMENTATION": ""})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
