// Staging of fp32/fp16/bf16 tensor elements as fp32, shared by the element-wise CPU kernels
// (moreau.cpp, sam.cpp): a span [start, start + n) of a tensor is converted into a small fp32
// buffer and back (round to nearest even), so every arithmetic loop is a plain fp32 loop the
// compiler vectorises whatever the tensors' dtypes.
#pragma once

#include "cpu_isa.h"
#include "ops.h"
#include "scores.h"

#include <torch/types.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PYPRUNE_STAGING_X86 1
#endif

namespace pyprune_cpu {

template <Dt D>
PYPRUNE_ALWAYS_INLINE void load_as(const void* base, int64_t start, int64_t n,
                                   float* __restrict out) {
  const auto* __restrict p = static_cast<const typename Elem<D>::type*>(base) + start;
  for (int64_t i = 0; i < n; ++i) out[i] = Elem<D>::load(p, i);
}

PYPRUNE_ALWAYS_INLINE void load_span(const void* base, Dt dt, int64_t start, int64_t n,
                                     float* __restrict out) {
  switch (dt) {
    case Dt::F32: load_as<Dt::F32>(base, start, n, out); break;
    case Dt::F16: load_as<Dt::F16>(base, start, n, out); break;
    default: load_as<Dt::BF16>(base, start, n, out); break;
  }
}

#ifdef PYPRUNE_STAGING_X86
__attribute__((target("avx2,f16c"))) inline void store_half_f16c(const float* in, uint16_t* out,
                                                                  int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
  }
  for (; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(in[i]);
}
#endif

inline void store_span(void* base, Dt dt, int64_t start, int64_t n, const float* __restrict in) {
  if (dt == Dt::F32) {
    std::memcpy(static_cast<float*>(base) + start, in, sizeof(float) * static_cast<size_t>(n));
    return;
  }
  uint16_t* __restrict out = static_cast<uint16_t*>(base) + start;
  if (dt == Dt::BF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::round_to_nearest_even(in[i]);
    return;
  }
#ifdef PYPRUNE_STAGING_X86
  if (cpu_has_avx2()) return store_half_f16c(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(in[i]);
}

// The span as fp32 to read or update in place: an fp32 tensor's own memory, else `buffer` filled
// by load_span (write an updated buffer back with store_span).
PYPRUNE_ALWAYS_INLINE float* staged_span(void* base, Dt dt, int64_t start, int64_t n,
                                         float* buffer) {
  if (dt == Dt::F32) return static_cast<float*>(base) + start;
  load_span(base, dt, start, n, buffer);
  return buffer;
}

PYPRUNE_ALWAYS_INLINE const float* staged_span(const void* base, Dt dt, int64_t start, int64_t n,
                                               float* buffer) {
  return staged_span(const_cast<void*>(base), dt, start, n, buffer);
}

}  // namespace pyprune_cpu
