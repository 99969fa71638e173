#!/usr/bin/env bash
# Compile-checks every csrc/cuda/*.cu with nvcc for sm_80 and sm_90a (no GPU needed).
# Usage: csrc/check_cuda.sh   (NVCC=/path/to/nvcc to pick the compiler; extra nvcc flags in
# NVCC_FLAGS). Exits non-zero when nvcc is missing or any file fails to compile.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-nvcc}"
if ! command -v "$nvcc" >/dev/null 2>&1; then
  echo "check_cuda.sh: nvcc not found (set NVCC)" >&2
  exit 2
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

shopt -s nullglob
sources=("$here"/cuda/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda.sh: no .cu files under $here/cuda" >&2
  exit 1
fi

status=0
for src in "${sources[@]}"; do
  obj="$tmp/$(basename "$src" .cu).o"
  # shellcheck disable=SC2086
  if "$nvcc" -c "$src" -o "$obj" -std=c++17 -O3 \
      -gencode arch=compute_80,code=sm_80 \
      -gencode arch=compute_90a,code=sm_90a \
      -Xcompiler -Wall ${NVCC_FLAGS:-}; then
    echo "ok    $src"
  else
    echo "FAIL  $src" >&2
    status=1
  fi
done
exit "$status"
