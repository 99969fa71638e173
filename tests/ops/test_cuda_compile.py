"""csrc/cuda compiles with nvcc for sm_80 and sm_90a (and its torch bindings with the host
compiler), even where no GPU can run it."""
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "check_cuda.sh")


def test_cuda_sources_and_bindings_compile():
    nvcc = os.environ.get("NVCC", "nvcc")
    if shutil.which(nvcc) is None:  # every machine of this project has nvcc (DESIGN: nvcc 13.0)
        pytest.fail(f"{nvcc!r} is not on PATH (set NVCC to its path): the CUDA sources cannot be "
                    "compile-checked without it", pytrace=False)
    result = subprocess.run(["bash", SCRIPT], capture_output=True, text=True,
                            env=dict(os.environ, PYTHON=sys.executable))
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    sources = [f for f in os.listdir(os.path.dirname(SCRIPT) + "/cuda") if f.endswith((".cu", ".cpp"))]
    assert len(sources) >= 3 and result.stdout.count("ok ") == len(sources), result.stdout
