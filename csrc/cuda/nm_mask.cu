// N:M pruning masks on the GPU (pyprune._C_cuda), plain CUDA: no torch headers here (the CPU
// torch wheel's headers do not go through nvcc); csrc/cuda/library.cpp checks the arguments and
// calls the extern "C" launcher below on the current stream.
//
// Semantics (identical to the CPU kernel and to pyprune.reference.nm_mask): in every group of m
// consecutive elements of a row keep the n highest fp32 scores, the lower index winning ties:
//     keep_i  <=>  #{j < i : s_j >= s_i} + #{j > i : s_j > s_i}  <  n.
// Scores, bitwise equal to the reference:
//   ScoreKind::GIVEN:     s = float(src)
//   ScoreKind::MAGNITUDE: s = |float(src)|
//   ScoreKind::WANDA:     s = |float(src)| * sqrt(act_sqnorm[col])   (IEEE sqrt and multiply, no FMA)
// (score kinds from ../score_kind.h, the mirror of pyprune.ops.conventions.ScoreKind)
// A NaN score sets *nan_flag to 1 (the mask is then meaningless and the caller raises).
//
// One thread per group. m = 4 and m = 8 have compile-time unrolled kernels that load a group
// with vector loads and store its mask with one 4- or 8-byte store when the pointers allow it;
// any other m <= 32 goes through a generic kernel.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "../score_kind.h"

using pyprune::ScoreKind;
#include <stdint.h>

namespace {

enum DType { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <int DT> struct Elem;
template <> struct Elem<kF32> {
  typedef float T;
  static __device__ __forceinline__ float to_float(float x) { return x; }
};
template <> struct Elem<kF16> {
  typedef uint16_t T;
  static __device__ __forceinline__ float to_float(uint16_t b) {
    return __half2float(__ushort_as_half(b));  // exact
  }
};
template <> struct Elem<kBF16> {
  typedef uint16_t T;
  static __device__ __forceinline__ float to_float(uint16_t b) {
    return __uint_as_float(static_cast<uint32_t>(b) << 16);  // exact
  }
};

template <int DT, int KIND>
__device__ __forceinline__ float score(typename Elem<DT>::T raw, const float* __restrict__ act,
                                       int64_t col) {
  float s = Elem<DT>::to_float(raw);
  if (KIND != ScoreKind::GIVEN) s = fabsf(s);
  if (KIND == ScoreKind::WANDA) s = __fmul_rn(s, __fsqrt_rn(__ldg(act + col)));
  return s;
}

// Copies `bytes` (a multiple of 8) from global memory with 16- or 8-byte loads.
template <int BYTES>
__device__ __forceinline__ void load_vec(void* dst, const void* src) {
  static_assert(BYTES % 8 == 0, "vector loads need a multiple of 8 bytes");
  if (BYTES % 16 == 0) {
#pragma unroll
    for (int k = 0; k < BYTES / 16; ++k)
      reinterpret_cast<uint4*>(dst)[k] = __ldg(reinterpret_cast<const uint4*>(src) + k);
  } else {
#pragma unroll
    for (int k = 0; k < BYTES / 8; ++k)
      reinterpret_cast<uint2*>(dst)[k] = __ldg(reinterpret_cast<const uint2*>(src) + k);
  }
}

// Fixed m = M. VEC: src is aligned to min(16, M * sizeof(T)) bytes and out to M bytes.
template <int DT, int KIND, int M, bool VEC>
__global__ void __launch_bounds__(256)
nm_mask_fixed(const typename Elem<DT>::T* __restrict__ src, const float* __restrict__ act,
              uint8_t* __restrict__ out, int* __restrict__ nan_flag, int64_t groups,
              int64_t groups_per_row, int n) {
  typedef typename Elem<DT>::T T;
  constexpr int BYTES = M * static_cast<int>(sizeof(T));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const T* p = src + g * M;
    alignas(16) T raw[M];
    if (VEC) {
      load_vec<BYTES>(raw, p);
    } else {
#pragma unroll
      for (int i = 0; i < M; ++i) raw[i] = p[i];
    }
    const int64_t col0 = KIND == ScoreKind::WANDA ? (g % groups_per_row) * M : 0;
    float s[M];
    bool nan = false;
#pragma unroll
    for (int i = 0; i < M; ++i) {
      s[i] = score<DT, KIND>(raw[i], act, col0 + i);
      nan |= (s[i] != s[i]);
    }
    if (nan) *nan_flag = 1;
    uint8_t keep[M];
#pragma unroll
    for (int i = 0; i < M; ++i) {
      int r = 0;
#pragma unroll
      for (int j = 0; j < M; ++j) {
        if (j < i) r += (s[j] >= s[i]);
        else if (j > i) r += (s[j] > s[i]);
      }
      keep[i] = static_cast<uint8_t>(r < n);
    }
    uint8_t* o = out + g * M;
    if (VEC) {
      if (M == 4) {
        uint32_t w = 0;
#pragma unroll
        for (int i = 0; i < M; ++i) w |= static_cast<uint32_t>(keep[i]) << (8 * i);
        *reinterpret_cast<uint32_t*>(o) = w;
      } else {  // M == 8
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lo |= static_cast<uint32_t>(keep[i]) << (8 * i);
          hi |= static_cast<uint32_t>(keep[i + 4]) << (8 * i);
        }
        *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
      }
    } else {
#pragma unroll
      for (int i = 0; i < M; ++i) o[i] = keep[i];
    }
  }
}

// Any m <= 32.
template <int DT, int KIND>
__global__ void __launch_bounds__(256)
nm_mask_generic(const typename Elem<DT>::T* __restrict__ src, const float* __restrict__ act,
                uint8_t* __restrict__ out, int* __restrict__ nan_flag, int64_t groups,
                int64_t groups_per_row, int n, int m) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const typename Elem<DT>::T* p = src + g * m;
    const int64_t col0 = KIND == ScoreKind::WANDA ? (g % groups_per_row) * m : 0;
    float s[32];
    bool nan = false;
    for (int i = 0; i < m; ++i) {
      s[i] = score<DT, KIND>(p[i], act, col0 + i);
      nan |= (s[i] != s[i]);
    }
    if (nan) *nan_flag = 1;
    uint8_t* o = out + g * m;
    for (int i = 0; i < m; ++i) {
      const float si = s[i];
      int r = 0;
      for (int j = 0; j < i; ++j) r += (s[j] >= si);
      for (int j = i + 1; j < m; ++j) r += (s[j] > si);
      o[i] = static_cast<uint8_t>(r < n);
    }
  }
}

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t groups) {
  int64_t blocks = (groups + kThreads - 1) / kThreads;
  const int64_t cap = 1 << 20;  // the kernels are grid-stride loops
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

template <int DT, int KIND, int M>
void launch_fixed(const void* src, const float* act, uint8_t* out, int* nan_flag, int64_t groups,
                  int64_t groups_per_row, int n, cudaStream_t stream) {
  typedef typename Elem<DT>::T T;
  const int bytes = M * static_cast<int>(sizeof(T));
  const uintptr_t src_align = bytes < 16 ? bytes : 16;
  const bool vec = reinterpret_cast<uintptr_t>(src) % src_align == 0 &&
                   reinterpret_cast<uintptr_t>(out) % M == 0;
  const T* s = static_cast<const T*>(src);
  if (vec)
    nm_mask_fixed<DT, KIND, M, true><<<grid_for(groups), kThreads, 0, stream>>>(
        s, act, out, nan_flag, groups, groups_per_row, n);
  else
    nm_mask_fixed<DT, KIND, M, false><<<grid_for(groups), kThreads, 0, stream>>>(
        s, act, out, nan_flag, groups, groups_per_row, n);
}

template <int DT, int KIND>
void launch_kind(const void* src, const float* act, uint8_t* out, int* nan_flag, int64_t groups,
                 int64_t groups_per_row, int n, int m, cudaStream_t stream) {
  if (m == 4) {
    launch_fixed<DT, KIND, 4>(src, act, out, nan_flag, groups, groups_per_row, n, stream);
  } else if (m == 8) {
    launch_fixed<DT, KIND, 8>(src, act, out, nan_flag, groups, groups_per_row, n, stream);
  } else {
    nm_mask_generic<DT, KIND><<<grid_for(groups), kThreads, 0, stream>>>(
        static_cast<const typename Elem<DT>::T*>(src), act, out, nan_flag, groups,
        groups_per_row, n, m);
  }
}

template <int DT>
void launch_dtype(const void* src, const float* act, uint8_t* out, int* nan_flag, int64_t groups,
                  int64_t groups_per_row, int n, int m, int score_kind, cudaStream_t stream) {
  switch (score_kind) {
    case ScoreKind::GIVEN:
      launch_kind<DT, ScoreKind::GIVEN>(src, act, out, nan_flag, groups, groups_per_row, n, m,
                                        stream);
      break;
    case ScoreKind::MAGNITUDE:
      launch_kind<DT, ScoreKind::MAGNITUDE>(src, act, out, nan_flag, groups, groups_per_row, n,
                                            m, stream);
      break;
    default:
      launch_kind<DT, ScoreKind::WANDA>(src, act, out, nan_flag, groups, groups_per_row, n, m,
                                        stream);
      break;
  }
}

}  // namespace

// src: [rows, cols] contiguous, dtype 0 = float32, 1 = float16, 2 = bfloat16.
// act_sqnorm: fp32 [cols] (ScoreKind::WANDA only, else ignored and may be null).
// out: [rows, cols] bytes (torch.bool). nan_flag: one device int, zeroed by the caller; set to 1
// when a score is NaN. Everything is enqueued on `stream`; returns the launch status.
extern "C" cudaError_t pyprune_nm_mask_cuda(const void* src, int dtype, const float* act_sqnorm,
                                            uint8_t* out, int* nan_flag, int64_t rows,
                                            int64_t cols, int n, int m, int score_kind,
                                            cudaStream_t stream) {
  if (m < 2 || m > 32 || n < 1 || n >= m || cols % m != 0 || rows < 0 || cols < 0 ||
      score_kind < ScoreKind::GIVEN || score_kind > ScoreKind::WANDA || dtype < 0 || dtype > 2 ||
      (score_kind == ScoreKind::WANDA && act_sqnorm == nullptr))
    return cudaErrorInvalidValue;
  const int64_t groups_per_row = cols / m;
  const int64_t groups = rows * groups_per_row;
  if (groups == 0) return cudaSuccess;
  switch (dtype) {
    case kF32:
      launch_dtype<kF32>(src, act_sqnorm, out, nan_flag, groups, groups_per_row, n, m,
                         score_kind, stream);
      break;
    case kF16:
      launch_dtype<kF16>(src, act_sqnorm, out, nan_flag, groups, groups_per_row, n, m,
                         score_kind, stream);
      break;
    default:
      launch_dtype<kBF16>(src, act_sqnorm, out, nan_flag, groups, groups_per_row, n, m,
                          score_kind, stream);
      break;
  }
  return cudaGetLastError();
}
