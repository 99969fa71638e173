#!/usr/bin/env bash
# Compile-checks every csrc/cuda/*.cu with nvcc for sm_80 and sm_90a, and csrc/cuda/*.cpp (the torch
# bindings) with the host compiler against the installed torch's headers (no GPU needed).
# Usage: csrc/check_cuda.sh   (NVCC=/path/to/nvcc to pick the compiler; extra nvcc flags in
# NVCC_FLAGS; PYTHON for the interpreter whose torch to use). Exits non-zero when nvcc is missing
# or any file fails to compile.
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
# Bindings: syntax-check with the host compiler. A CPU torch wheel ships the c10/cuda headers but
# not the CMake-generated c10/cuda/impl/cuda_cmake_macros.h, so an empty stand-in is provided.
python="${PYTHON:-python}"
cxx="${CXX:-g++}"
cuda_include="$(dirname "$(dirname "$(readlink -f "$(command -v "$nvcc")")")")/include"
[ -f "$cuda_include/cuda_runtime.h" ] || cuda_include="${CUDA_HOME:-/usr/local/cuda}/include"
if torch_flags="$("$python" -c 'import sysconfig, torch.utils.cpp_extension as c
print(" ".join(["-I" + p for p in c.include_paths()] + ["-I" + sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
  mkdir -p "$tmp/stub/c10/cuda/impl"
  : > "$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
  for src in "$here"/cuda/*.cpp; do
    # shellcheck disable=SC2086
    if "$cxx" -fsyntax-only -std=c++20 -I"$tmp/stub" $torch_flags -I"$cuda_include" \
        -DTORCH_EXTENSION_NAME=_C_cuda "$src"; then
      echo "ok    $src"
    else
      echo "FAIL  $src" >&2
      status=1
    fi
  done
else
  echo "check_cuda.sh: torch is not importable by $python; bindings not checked" >&2
  status=1
fi
exit "$status"
