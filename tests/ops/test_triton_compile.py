"""Every Triton kernel compiles to GPU code (sm_80 and sm_90 cubin) for the launches pyprune
makes, even where no GPU exists: the interpreter tests check the numbers, this checks that the
same kernels lower for a real GPU (see tests/ops/triton_compile_check.py)."""
import ast
import glob
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
KERNEL_SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels", "*.py")


def shipped_kernels():
    """Every ``*_kernel`` function under ``@triton.jit`` in kernels/ (installed as pyprune.ops.kernels), read from the source (the
    compile check must launch them all; a new kernel joins this list by being written)."""
    names = set()
    for path in glob.glob(KERNEL_SOURCES):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                  and node.name.endswith("_kernel") and any("jit" in ast.unparse(d) for d in node.decorator_list)}
    return names


@pytest.mark.slow
def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT))), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("compiled") and set(summary.split(": ", 1)[1].split(", ")) == shipped_kernels(), summary
