#!/usr/bin/env bash
# The GPU work of a session with a device machine, in one call (issue 4: sparse execution):
# build pyprune with its CUDA extension against the machine's torch, run the GPU tests, then time the
# SparseLinear and end-to-end suites (pytest-benchmark, full size) and write their results files.
# Everything lands in $OUT (default benchmarks/results): gpu-tests.log, run.json (pytest-benchmark's,
# for --benchmark-compare), sparse-linear-cuda.{json,md,*-bfloat16.svg,*-float16.svg}, dispatch_table.json
# (this environment's block; add it to the "environments" of pyprune/nn/dispatch_table.json), e2e-cuda.{json,md}.
#
#   device run:  bash benchmarks/gpu_session.sh            (about 10 minutes on an H100)
#   faster:      TOKENS="1 16 256 4096" SHAPES="4096x4096 11008x4096" bash benchmarks/gpu_session.sh
set -uo pipefail
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

PYPRUNE_BUILD_CUDA=1 "$python" -m pip install -q --no-build-isolation --no-deps -e . \
    > "$out/gpu-tests.log" 2>&1 || { tail -40 "$out/gpu-tests.log"; exit 1; }
"$python" -c "import torch, pyprune._C_cuda; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$out/gpu-tests.log"
"$python" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee -a "$out/gpu-tests.log"

tokens=${TOKENS:-}
shapes=${SHAPES:-}
"$python" -m pytest benchmarks/test_sparse_linear.py benchmarks/test_e2e.py -q -p no:cacheprovider \
    --benchmark-only --size full --benchmark-min-rounds "${REPEAT:-5}" --benchmark-json "$out/run.json" \
    ${tokens:+--tokens $tokens} ${shapes:+--shapes $shapes} \
    --models smollm2-135m-shape llama-7b-shape --layers "${LAYERS:-8}"
"$python" benchmarks/report.py "$out/run.json" --output-dir "$out" --write-dispatch "$out/dispatch_table.json"
