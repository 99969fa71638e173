// The AVX-512 decode GEMV of half-density N:M weights (nm_linear_avx512.cpp), called by
// nm_linear's GEMV (nm_linear.cpp) where cpu_isa() allows it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace pyprune_cpu {

// The AVX-512 half-density kernels (nm_linear_avx512.cpp): y[tokens, rows] = x · (W ⊙ mask)ᵀ + bias
// for 1:2, 2:4 and 4:8, any number of tokens. `x` is fp32 for the expand kernel (weights widened
// to fp32, FMAs) and bf16 for the dot kernel (vdpbf16ps on bf16 pairs). Accumulation is fp32.
template <typename T>
void gemv_half_density_avx512(const float* x, const T* values, const uint8_t* meta, const T* bias,
                              T* y, int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes);
void gemv_half_density_avx512_bf16(const c10::BFloat16* x, const c10::BFloat16* values,
                                   const uint8_t* meta, const c10::BFloat16* bias, c10::BFloat16* y,
                                   int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes);

}  // namespace pyprune_cpu
