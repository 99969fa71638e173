// The AVX-512 decode GEMV of half-density N:M weights (1:2, 2:4, 4:8: every mask byte keeps 4 of
// its 8 columns, so a block of 32 columns holds 16 values and one of 64 holds 32).
//
// Both kernels compute y = x · (W ⊙ mask)ᵀ on the kept weights only: for each block, the columns
// of a row's kept weights come out of its mask bits by one vpcompressb over 0, 1, 2, ... (their
// positions, in order), and every token's x block is permuted into that order (vpermt2ps /
// vpermt2w) and multiplied with the packed weights, so a multiply-add is spent on kept weights
// alone, half of what a dense GEMM spends. The indices are built once per row and block and serve
// every token of a chunk.
//   permute (fp32 x; fp32/fp16/bf16 weights widened): 16 values per FMA.
//   bf16 dot (bf16 x and weights, AVX512_BF16): vdpbf16ps sums 32 products in 16 fp32 lanes.
// Blocking: 8 tokens' accumulators stay in registers; a panel of 48 rows shares each x block of
// 2048 columns (8 tokens of it fit L1/L2) before the next, and the panels go to the threads.
#include "nm_linear_avx512.h"
#include "parallel.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace pyprune_cpu {
namespace {

#define PYPRUNE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi2")))
#define PYPRUNE_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi2,avx512bf16")))

constexpr int kChunkTokens = 8;      // tokens whose accumulators stay in registers
constexpr int64_t kPanelRows = 48;   // rows sharing each x block (divisible by every kRows below)
constexpr int64_t kBlockCols = 2048; // columns of x per pass over a panel

// Rows per pass for a token count: kRows * kTokens accumulators, kRows weights and kRows index
// vectors, two x halves and a temporary fit the 32 vector registers.
constexpr int rows_per_pass(int tokens) {
  return tokens == 1 ? 8 : tokens == 2 ? 6 : tokens <= 4 ? 4 : tokens <= 6 ? 3 : 2;
}

alignas(64) constexpr uint8_t kColumnIota[64] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

template <typename Bits>
inline Bits mask_bits(const uint8_t* p) {
  Bits bits;
  std::memcpy(&bits, p, sizeof(Bits));
  return bits;
}

// The columns of the kept weights of a block, in order, as bytes (lane k: the k-th set bit). A
// valid half-density mask has exactly half its bits set; a mask with more reads no further (the
// values of a block have a fixed place), one with fewer leaves column 0 in the missing lanes.
PYPRUNE_AVX512 inline __m512i kept_columns(uint64_t bits) {
  return _mm512_maskz_compress_epi8(_cvtu64_mask64(bits),
                                    _mm512_load_si512(reinterpret_cast<const void*>(kColumnIota)));
}

PYPRUNE_AVX512 inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
PYPRUNE_AVX512 inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PYPRUNE_AVX512 inline __m512 widen16(const c10::BFloat16* p) {  // bf16 is the top half of fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The kernels' shared frame: rows r0 .. r0+kRows of one chunk of tokens, their fp32 sums (in
// `sums`, kTokens per row) grown by the 32- or 64-column blocks [j0, j1).
template <typename T, typename X>
struct Pass {
  const X* x;  // the chunk's first token; token t at x + t * cols
  const T* values;
  const uint8_t* meta;
  int64_t cols, kv, meta_bytes;
};

// permute: 32-column blocks, 16 packed values each.
template <typename T, int kTokens, int kRows>
PYPRUNE_AVX512 void permute_rows(const Pass<T, float>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
  __m512 acc[kRows][kTokens];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512 w[kRows];
    __m512i idx[kRows];
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + i;
      w[i] = widen16(p.values + r * p.kv + 16 * j);
      idx[i] = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(
          kept_columns(mask_bits<uint32_t>(p.meta + r * p.meta_bytes + 4 * j))));
    }
    for (int t = 0; t < kTokens; ++t) {
      const float* xt = p.x + t * p.cols + 32 * j;
      const __m512 lo = _mm512_loadu_ps(xt), hi = _mm512_loadu_ps(xt + 16);
      for (int i = 0; i < kRows; ++i)
        acc[i][t] = _mm512_fmadd_ps(w[i], _mm512_permutex2var_ps(lo, idx[i], hi), acc[i][t]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) sums[i * kTokens + t] += _mm512_reduce_add_ps(acc[i][t]);
}

// bf16 dot: 64-column blocks, 32 packed values each; vdpbf16ps adds value pairs' products.
template <int kTokens, int kRows>
PYPRUNE_AVX512_BF16 void dot_rows(const Pass<c10::BFloat16, c10::BFloat16>& p, int64_t r0, int64_t j0,
                                  int64_t j1, float* sums) {
  __m512 acc[kRows][kTokens];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512i w[kRows], idx[kRows];
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + i;
      w[i] = _mm512_loadu_si512(p.values + r * p.kv + 32 * j);
      idx[i] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(
          kept_columns(mask_bits<uint64_t>(p.meta + r * p.meta_bytes + 8 * j))));
    }
    for (int t = 0; t < kTokens; ++t) {
      const c10::BFloat16* xt = p.x + t * p.cols + 64 * j;
      const __m512i lo = _mm512_loadu_si512(xt), hi = _mm512_loadu_si512(xt + 32);
      for (int i = 0; i < kRows; ++i)
        acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)w[i],
                                     (__m512bh)_mm512_permutex2var_epi16(lo, idx[i], hi));
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) sums[i * kTokens + t] += _mm512_reduce_add_ps(acc[i][t]);
}

template <typename T, int kTokens, int kRows>
struct Rows {
  static void run(const Pass<T, float>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
    permute_rows<T, kTokens, kRows>(p, r0, j0, j1, sums);
  }
};
template <int kTokens, int kRows>
struct Rows<c10::BFloat16, kTokens, kRows> {
  using Dot = Pass<c10::BFloat16, c10::BFloat16>;
  static void run(const Pass<c10::BFloat16, float>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
    permute_rows<c10::BFloat16, kTokens, kRows>(p, r0, j0, j1, sums);
  }
  static void run(const Dot& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
    dot_rows<kTokens, kRows>(p, r0, j0, j1, sums);
  }
};

// The columns past the last whole block, from the mask bits (scalar), into the sums.
template <typename T, typename X, int kTokens>
void tail_columns(const Pass<T, X>& p, int64_t r, int64_t first_col, float* sums) {
  const T* w = p.values + r * p.kv + first_col / 2;
  const T* const w_end = p.values + (r + 1) * p.kv;  // a mask with too many set bits stops here
  const uint8_t* mask = p.meta + r * p.meta_bytes;
  for (int64_t byte = first_col / 8; byte < p.meta_bytes; ++byte) {
    for (unsigned bits = mask[byte]; bits && w < w_end; bits &= bits - 1) {
      const int64_t col = 8 * byte + __builtin_ctz(bits);
      if (col >= p.cols) break;
      const float weight = static_cast<float>(*w++);
      for (int t = 0; t < kTokens; ++t) sums[t] += weight * static_cast<float>(p.x[t * p.cols + col]);
    }
  }
}

// One panel of rows [r0, r1) for one chunk of kTokens tokens: x blocks of kBlockCols columns in
// turn, each over the panel's rows kRows at a time; then the tail, the bias, and y.
template <typename T, typename X, int kTokens, int kBlock>
void panel_chunk(const Pass<T, X>& p, const T* bias, T* y, int64_t rows, int64_t r0, int64_t r1) {
  constexpr int kRows = rows_per_pass(kTokens);
  float sums[kPanelRows * kTokens] = {0.f};
  const int64_t blocks = p.cols / kBlock, step = kBlockCols / kBlock;
  for (int64_t j0 = 0; j0 < blocks; j0 += step) {
    const int64_t j1 = std::min(blocks, j0 + step);
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows) Rows<T, kTokens, kRows>::run(p, r, j0, j1, sums + (r - r0) * kTokens);
    for (; r < r1; ++r) Rows<T, kTokens, 1>::run(p, r, j0, j1, sums + (r - r0) * kTokens);
  }
  for (int64_t r = r0; r < r1; ++r) {
    float* s = sums + (r - r0) * kTokens;
    tail_columns<T, X, kTokens>(p, r, blocks * kBlock, s);
    const float b = bias ? static_cast<float>(bias[r]) : 0.f;
    for (int t = 0; t < kTokens; ++t) y[t * rows + r] = static_cast<T>(s[t] + b);
  }
}

// Panels over the threads (dynamic: a descheduled thread on a shared machine does not hold a
// fixed share), chunks of up to 8 tokens inside each panel so its weights are read from memory
// once and from cache for the other chunks.
template <typename T, typename X, int kBlock>
void half_density(const Pass<T, X>& p, const T* bias, T* y, int64_t tokens, int64_t rows) {
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
#pragma omp parallel for schedule(dynamic, 1) if (rows * p.cols * std::min<int64_t>(tokens, kChunkTokens) >= kParallelMin)
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t r0 = panel * kPanelRows, r1 = std::min(rows, r0 + kPanelRows);
    for (int64_t t0 = 0; t0 < tokens; t0 += kChunkTokens) {
      Pass<T, X> chunk = p;
      chunk.x = p.x + t0 * p.cols;
      T* yc = y + t0 * rows;
      switch (std::min<int64_t>(kChunkTokens, tokens - t0)) {
#define PYPRUNE_TOKENS(count) \
  case count:                 \
    panel_chunk<T, X, count, kBlock>(chunk, bias, yc, rows, r0, r1); \
    break;
        PYPRUNE_TOKENS(1) PYPRUNE_TOKENS(2) PYPRUNE_TOKENS(3) PYPRUNE_TOKENS(4)
        PYPRUNE_TOKENS(5) PYPRUNE_TOKENS(6) PYPRUNE_TOKENS(7) PYPRUNE_TOKENS(8)
#undef PYPRUNE_TOKENS
      }
    }
  }
}

}  // namespace

template <typename T>
void gemv_half_density_avx512(const float* x, const T* values, const uint8_t* meta, const T* bias,
                              T* y, int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes) {
  half_density<T, float, 32>({x, values, meta, cols, cols / 2, meta_bytes}, bias, y, tokens, rows);
}

template void gemv_half_density_avx512<float>(const float*, const float*, const uint8_t*, const float*,
                                              float*, int64_t, int64_t, int64_t, int64_t);
template void gemv_half_density_avx512<c10::Half>(const float*, const c10::Half*, const uint8_t*,
                                                  const c10::Half*, c10::Half*, int64_t, int64_t,
                                                  int64_t, int64_t);
template void gemv_half_density_avx512<c10::BFloat16>(const float*, const c10::BFloat16*, const uint8_t*,
                                                      const c10::BFloat16*, c10::BFloat16*, int64_t,
                                                      int64_t, int64_t, int64_t);

void gemv_half_density_avx512_bf16(const c10::BFloat16* x, const c10::BFloat16* values,
                                   const uint8_t* meta, const c10::BFloat16* bias, c10::BFloat16* y,
                                   int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes) {
  half_density<c10::BFloat16, c10::BFloat16, 64>({x, values, meta, cols, cols / 2, meta_bytes}, bias, y,
                                                  tokens, rows);
}

}  // namespace pyprune_cpu

#endif  // x86-64: elsewhere cpu_isa() never passes kGeneric and nothing calls these
