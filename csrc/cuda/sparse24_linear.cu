// 2:4 sparse tensor-core linear layer (the CUDA implementation of torch.ops.pyprune.sparse24_linear)
// and its compress kernel (of torch.ops.pyprune.sparse24_compress), plain CUDA behind extern "C"
// launchers; sm_80+.
//
//   y[t, o] = sum_k x[t, k] * W[o, k] + bias[o]      with W 2:4 sparse along k.
//
// The layer computes yᵀ = W · xᵀ with mma.sp.sync.aligned.m16n8k32: the sparse operand A is a
// 16 (outputs) x 32 (inputs) tile of W, B is a 32 (inputs) x 8 (tokens) tile of xᵀ, fp32 accumulate.
//
// Storage (the same `values` as pyprune.ops.nm_compress for 2:4; `meta` as
// pyprune.reference.sparse24_mma_meta):
//   values [out, K/2]  : the two kept weights of every group of 4, in column order.
//   meta   [out, K/16] : int16; word j of a row covers input columns 16j..16j+15 (groups 4j..4j+3);
//                        group i of the word sits in bits 4i..4i+3 as (first kept position) |
//                        (second kept position) << 2, positions 0..3 within the group.
//
// Fragments of m16n8k32 (PTX ISA, "sparse mma ... m16n8k32 .f16/.bf16"), per lane:
// g = lane / 4, t = lane % 4.
//   A (4 x .b32): {W_c[g][2t..2t+1], W_c[g+8][2t..2t+1], W_c[g][2t+8..2t+9], W_c[g+8][2t+8..2t+9]}
//       where W_c is the 16 x 16 compressed tile (value column c belongs to group c / 2).
//   B (4 x .b32): b_j = xᵀ[2t + 8j .. 2t + 8j + 1][g] = x[token g][k0 + 2t + 8j ..], j = 0..3.
//   C (4 x f32) : {y[o=g][tok=2t], y[g][2t+1], y[g+8][2t], y[g+8][2t+1]}  (rows = outputs).
//   metadata    : with sparsity selector 0, lanes with t = 0 and t = 1 supply it:
//       low 16 bits = meta[g][k0/16 + t], high 16 bits = meta[g + 8][k0/16 + t].
//
// One warp computes a 16-output x (8 * N_TILES)-token tile; a block has WARPS warps stacked
// along the outputs. Operands are read straight from global memory (the tiles are small and
// reused through L1); K must be a multiple of 32.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

enum DType { kF16 = 1, kBF16 = 2 };

constexpr int kWarps = 4;

template <int DT> struct Half;
template <> struct Half<kF16> {
  typedef __half T;
  static __device__ __forceinline__ float to_float(T x) { return __half2float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2half_rn(x); }
};
template <> struct Half<kBF16> {
  typedef __nv_bfloat16 T;
  static __device__ __forceinline__ float to_float(T x) { return __bfloat162float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2bfloat16_rn(x); }
};

// Two consecutive 16-bit elements as one .b32 register, or zero when out of bounds.
__device__ __forceinline__ uint32_t load_pair(const uint16_t* __restrict__ p, bool valid) {
  return valid ? __ldg(reinterpret_cast<const uint32_t*>(p)) : 0u;
}

// PTX 8.5 (CUDA 12.5) names the metadata ordering; our positions are always ascending.
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 5))
#define PYPRUNE_MMA_SP "mma.sp::ordered_metadata"
#else
#define PYPRUNE_MMA_SP "mma.sp"
#endif

template <int DT>
__device__ __forceinline__ void mma_sp(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                       uint32_t meta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// One instruction per element type; only the type names differ.
#define PYPRUNE_MMA_SP_ASM(TYPE)                                                                 \
  asm volatile(PYPRUNE_MMA_SP ".sync.aligned.m16n8k32.row.col.f32." TYPE "." TYPE ".f32 "        \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n" \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),    \
                 "r"(b[3]), "r"(meta))
  if (DT == kF16)
    PYPRUNE_MMA_SP_ASM("f16");
  else
    PYPRUNE_MMA_SP_ASM("bf16");
#undef PYPRUNE_MMA_SP_ASM
#elif defined(__CUDA_ARCH__)
  __trap();  // no sparse tensor cores before sm80; csrc/cuda/library.cpp refuses such devices
#endif
}

template <int DT, int N_TILES>
__global__ void __launch_bounds__(kWarps * 32)
sparse24_linear_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ values,
                       const uint16_t* __restrict__ meta, const uint16_t* __restrict__ bias,
                       uint16_t* __restrict__ y, int64_t tokens, int64_t out_features, int64_t K) {
  typedef typename Half<DT>::T T;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t out0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * 16;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.y) * 8 * N_TILES;
  if (out0 >= out_features) return;  // whole warp leaves together

  const int64_t row_lo = out0 + g, row_hi = out0 + g + 8;
  const bool lo_ok = row_lo < out_features, hi_ok = row_hi < out_features;
  const int64_t kv = K / 2, km = K / 16;

  float acc[N_TILES][4];
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t vc = k0 / 2 + 2 * t;
    uint32_t a[4];
    a[0] = load_pair(values + row_lo * kv + vc, lo_ok);
    a[1] = load_pair(values + row_hi * kv + vc, hi_ok);
    a[2] = load_pair(values + row_lo * kv + vc + 8, lo_ok);
    a[3] = load_pair(values + row_hi * kv + vc + 8, hi_ok);
    const int64_t mc = k0 / 16 + (t & 1);
    const uint32_t m_lo = lo_ok ? __ldg(meta + row_lo * km + mc) : 0x4444u;  // positions 0,1
    const uint32_t m_hi = hi_ok ? __ldg(meta + row_hi * km + mc) : 0x4444u;
    const uint32_t m = (m_lo & 0xffffu) | (m_hi << 16);
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
      const int64_t tok = tok0 + 8 * j + g;
      const bool tok_ok = tok < tokens;
      uint32_t b[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) b[q] = load_pair(x + tok * K + k0 + 2 * t + 8 * q, tok_ok);
      mma_sp<DT>(acc[j], a, b, m);
    }
  }

  const float bias_lo = (bias != nullptr && lo_ok)
      ? Half<DT>::to_float(reinterpret_cast<const T*>(bias)[row_lo]) : 0.f;
  const float bias_hi = (bias != nullptr && hi_ok)
      ? Half<DT>::to_float(reinterpret_cast<const T*>(bias)[row_hi]) : 0.f;
  T* out = reinterpret_cast<T*>(y);
#pragma unroll
  for (int j = 0; j < N_TILES; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t tok = tok0 + 8 * j + 2 * t + e;
      if (tok >= tokens) continue;
      if (lo_ok) out[tok * out_features + row_lo] = Half<DT>::from_float(acc[j][e] + bias_lo);
      if (hi_ok) out[tok * out_features + row_hi] = Half<DT>::from_float(acc[j][2 + e] + bias_hi);
    }
  }
}

// One thread per 16 input columns of a row: the two kept values of each of its four groups go
// to values, their positions to one metadata word.
__global__ void sparse24_compress_kernel(const uint16_t* __restrict__ w, const uint8_t* __restrict__ mask,
                                         uint16_t* __restrict__ values, uint16_t* __restrict__ meta,
                                         int64_t words, int* __restrict__ bad_group) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += stride) {
    uint32_t word = 0;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      const int64_t base = i * 16 + grp * 4;
      int kept = 0;
      uint32_t code = 0;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        if (mask[base + p] == 0) continue;
        if (kept < 2) {
          values[i * 8 + grp * 2 + kept] = w[base + p];
          code |= static_cast<uint32_t>(p) << (2 * kept);
        }
        ++kept;
      }
      if (kept != 2) atomicExch(bad_group, 1);
      word |= code << (4 * grp);
    }
    meta[i] = static_cast<uint16_t>(word);
  }
}

template <int DT, int N_TILES>
void launch_linear(const void* x, const void* values, const void* meta, const void* bias, void* y,
                   int64_t tokens, int64_t out_features, int64_t K, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((out_features + 16 * kWarps - 1) / (16 * kWarps)),
                  static_cast<unsigned>((tokens + 8 * N_TILES - 1) / (8 * N_TILES)));
  sparse24_linear_kernel<DT, N_TILES><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values),
      static_cast<const uint16_t*>(meta), static_cast<const uint16_t*>(bias),
      static_cast<uint16_t*>(y), tokens, out_features, K);
}

template <int DT>
void launch_dtype(const void* x, const void* values, const void* meta, const void* bias, void* y,
                  int64_t tokens, int64_t out_features, int64_t K, cudaStream_t stream) {
  // Decode-size inputs use one 8-token tile per warp; larger ones reuse each A fragment 4 times.
  if (tokens <= 8)
    launch_linear<DT, 1>(x, values, meta, bias, y, tokens, out_features, K, stream);
  else
    launch_linear<DT, 4>(x, values, meta, bias, y, tokens, out_features, K, stream);
}

}  // namespace

// x [tokens, K], values [out, K/2], meta [out, K/16] int16, bias [out] or null, y [tokens, out];
// all contiguous, x/values/bias/y of one 16-bit dtype (1 = fp16, 2 = bf16); K % 32 == 0.
extern "C" cudaError_t pyprune_sparse24_linear_cuda(const void* x, const void* values,
                                                    const void* meta, const void* bias, void* y,
                                                    int dtype, int64_t tokens,
                                                    int64_t out_features, int64_t K,
                                                    cudaStream_t stream) {
  if (K % 32 != 0 || tokens < 0 || out_features < 0 || (dtype != kF16 && dtype != kBF16))
    return cudaErrorInvalidValue;
  if (tokens == 0 || out_features == 0) return cudaSuccess;
  if (dtype == kF16)
    launch_dtype<kF16>(x, values, meta, bias, y, tokens, out_features, K, stream);
  else
    launch_dtype<kBF16>(x, values, meta, bias, y, tokens, out_features, K, stream);
  return cudaGetLastError();
}

// w [rows, cols] 16-bit, mask [rows, cols] bool (2 of every 4 kept); cols % 16 == 0.
// values [rows, cols/2], meta [rows, cols/16] int16; *bad_group = 1 when a group keeps != 2.
extern "C" cudaError_t pyprune_sparse24_compress_cuda(const void* w, const uint8_t* mask,
                                                      void* values, void* meta, int* bad_group,
                                                      int64_t rows, int64_t cols,
                                                      cudaStream_t stream) {
  if (cols % 16 != 0 || rows < 0) return cudaErrorInvalidValue;
  const int64_t words = rows * (cols / 16);
  if (words == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (words + threads - 1) / threads;
  sparse24_compress_kernel<<<static_cast<unsigned>(blocks < 65535 * 32 ? blocks : 65535 * 32),
                             threads, 0, stream>>>(
      static_cast<const uint16_t*>(w), mask, static_cast<uint16_t*>(values),
      static_cast<uint16_t*>(meta), words, bad_group);
  return cudaGetLastError();
}
