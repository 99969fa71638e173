"""Every Triton kernel compiles to GPU code (sm_80 and sm_90 cubin) for the launches pyprune
makes, even where no GPU exists: the interpreter tests check the numbers, this checks that the
same kernels lower for a real GPU (see tests/triton_compile_check.py)."""
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
KERNELS = {"_score_kernel", "_sqnorm_partial_kernel", "_nm_mask_kernel", "_count_at_least_kernel",
           "_accept_bit_kernel", "_threshold_mask_kernel", "_soft_threshold_kernel",
           "_group_soft_threshold_kernel", "_pack_mask_kernel", "_compress_kernel", "_decompress_kernel",
           "_nm_gemv_kernel", "_nm_linear_kernel", "_sliced_linear_kernel", "_moreau_rows_kernel",
           "_moreau_columns_kernel", "_moreau_perturb_kernel", "_abs_outer_kernel",
           "_penalty_rows_kernel", "_penalty_columns_kernel", "_sum_squares_kernel", "_perturb_kernel",
           "_adam_kernel", "_dual_nm_kernel", "_dual_update_kernel", "_dual_keep_kernel"}


@pytest.mark.slow
def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(SCRIPT)), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("compiled") and set(summary.split(": ", 1)[1].split(", ")) >= KERNELS, summary
