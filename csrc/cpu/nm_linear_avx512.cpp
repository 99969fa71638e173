// The AVX-512 decode GEMV of half-density N:M weights (1:2, 2:4, 4:8: every mask byte keeps 4 of
// its 8 columns, so 16 columns hold 8 values and 32 hold 16, whatever the pattern).
//
// Both kernels expand each row's packed values to dense columns in registers with the mask bits as
// the write mask (vexpandps / vpexpandw: value k goes to the k-th set bit's lane, the others are
// zero), once per row and block, and every token of a chunk multiplies the expanded block: the
// weights are read from memory once, compressed, and no index table or permute is needed.
//   expand (fp32 x; fp32/fp16/bf16 weights widened to fp32): FMAs on 16 columns.
//   bf16 dot (bf16 x and weights, AVX512_BF16): vdpbf16ps on 32 columns, pairs summed into fp32.
// Blocking: 8 tokens' accumulators stay in registers; x is repacked so a block's tokens lie side by
// side; a panel of 48 rows shares each x block of 2048 columns before the next, and the panels go
// to the threads. Each pass prefetches what the next pass over the panel's rows will read.
#include "nm_linear_avx512.h"
#include "parallel.h"

#include <algorithm>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace pyprune_cpu {
namespace {

#define PYPRUNE_AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))
#define PYPRUNE_AVX512_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vbmi2,avx512bf16")))

constexpr int kChunkTokens = 8;      // tokens whose accumulators stay in registers
constexpr int64_t kPanelRows = 48;   // rows sharing each x block (divisible by every kRows below)
constexpr int64_t kBlockCols = 2048; // columns of x per pass over a panel

// Rows per pass for a token count: kRows * kTokens accumulators, 2 * kRows expanded weight vectors
// and two x vectors fit the 32 vector registers.
constexpr int rows_per_pass(int tokens) {
  return tokens == 1 ? 8 : tokens == 2 ? 6 : tokens <= 4 ? 4 : tokens <= 6 ? 3 : 2;
}

template <typename Bits>
inline Bits mask_bits(const uint8_t* p) {
  Bits bits;
  std::memcpy(&bits, p, sizeof(Bits));
  return bits;
}

// 8 weights widened to fp32 in the low half of a vector.
PYPRUNE_AVX512 inline __m512 widen8(const float* p) { return _mm512_zextps256_ps512(_mm256_loadu_ps(p)); }
PYPRUNE_AVX512 inline __m512 widen8(const c10::Half* p) {
  return _mm512_zextps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
PYPRUNE_AVX512 inline __m512 widen8(const c10::BFloat16* p) {  // bf16 is the top half of fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_zextps256_ps512(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
}

// The values (one cache line) and, every 8th block, the mask bytes that the next pass over the rows
// reads at this block, `rows_ahead` rows on: a pass streams a few rows' short segments, too short
// for the hardware prefetcher to reach ahead of (it pays most at 8 tokens, where a pass holds 2 rows).
template <typename T>
inline void prefetch_next_pass(const T* v, const uint8_t* mask, int rows_ahead, int64_t kv, int64_t meta_bytes,
                               int64_t j) {
  _mm_prefetch(reinterpret_cast<const char*>(v + rows_ahead * kv), _MM_HINT_T0);
  if ((j & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(mask + rows_ahead * meta_bytes), _MM_HINT_T0);
}

// The kernels' shared frame: one chunk of kTokens tokens over the rows, their fp32 sums (kTokens
// per row) grown block by block.
template <typename T, typename X>
struct Pass {
  const X* x;       // the chunk's first token; token t at x + t * cols
  const X* packed;  // the chunk's whole blocks: block j of token t at (j * kTokens + t) * block columns
  const T* values;
  const uint8_t* meta;
  int64_t cols, kv, meta_bytes;
};

// expand: 32-column blocks (16 values, 4 mask bytes) as two 16-column vectors.
template <typename T, int kTokens, int kRows>
PYPRUNE_AVX512 void expand_rows(const Pass<T, float>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
  __m512 acc[kRows][kTokens];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512 lo_w[kRows], hi_w[kRows];
    for (int i = 0; i < kRows; ++i) {
      const T* v = p.values + (r0 + i) * p.kv + 16 * j;
      const uint32_t bits = mask_bits<uint32_t>(p.meta + (r0 + i) * p.meta_bytes + 4 * j);
      lo_w[i] = _mm512_maskz_expand_ps(static_cast<__mmask16>(bits), widen8(v));
      hi_w[i] = _mm512_maskz_expand_ps(static_cast<__mmask16>(bits >> 16), widen8(v + 8));
      prefetch_next_pass(v, p.meta + (r0 + i) * p.meta_bytes + 4 * j, kRows, p.kv, p.meta_bytes, j);
    }
    for (int t = 0; t < kTokens; ++t) {
      const float* xt = p.packed + (j * kTokens + t) * 32;
      const __m512 lo = _mm512_loadu_ps(xt), hi = _mm512_loadu_ps(xt + 16);
      for (int i = 0; i < kRows; ++i)
        acc[i][t] = _mm512_fmadd_ps(hi_w[i], hi, _mm512_fmadd_ps(lo_w[i], lo, acc[i][t]));
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) sums[i * kTokens + t] += _mm512_reduce_add_ps(acc[i][t]);
}

// bf16 dot: 64-column blocks (32 values, 8 mask bytes) as two 32-column vectors of bf16 pairs.
template <int kTokens, int kRows>
PYPRUNE_AVX512_BF16 void dot_rows(const Pass<c10::BFloat16, c10::BFloat16>& p, int64_t r0, int64_t j0,
                                  int64_t j1, float* sums) {
  __m512 acc[kRows][kTokens];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512i lo_w[kRows], hi_w[kRows];
    for (int i = 0; i < kRows; ++i) {
      const c10::BFloat16* v = p.values + (r0 + i) * p.kv + 32 * j;
      const uint64_t bits = mask_bits<uint64_t>(p.meta + (r0 + i) * p.meta_bytes + 8 * j);
      lo_w[i] = _mm512_maskz_expand_epi16(static_cast<__mmask32>(bits),
                                          _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))));
      hi_w[i] = _mm512_maskz_expand_epi16(static_cast<__mmask32>(bits >> 32),
                                          _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16))));
      prefetch_next_pass(v, p.meta + (r0 + i) * p.meta_bytes + 8 * j, kRows, p.kv, p.meta_bytes, j);
    }
    for (int t = 0; t < kTokens; ++t) {
      const c10::BFloat16* xt = p.packed + (j * kTokens + t) * 64;
      const __m512i lo = _mm512_loadu_si512(xt), hi = _mm512_loadu_si512(xt + 32);
      for (int i = 0; i < kRows; ++i)
        acc[i][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i][t], (__m512bh)lo_w[i], (__m512bh)lo),
                                     (__m512bh)hi_w[i], (__m512bh)hi);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) sums[i * kTokens + t] += _mm512_reduce_add_ps(acc[i][t]);
}

// The kernel of an x type: fp32 x expands, bf16 x takes the dot.
template <typename T, int kTokens, int kRows>
void run_rows(const Pass<T, float>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
  expand_rows<T, kTokens, kRows>(p, r0, j0, j1, sums);
}
template <typename T, int kTokens, int kRows>
void run_rows(const Pass<c10::BFloat16, c10::BFloat16>& p, int64_t r0, int64_t j0, int64_t j1, float* sums) {
  dot_rows<kTokens, kRows>(p, r0, j0, j1, sums);
}

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
    for (; r + kRows <= r1; r += kRows) run_rows<T, kTokens, kRows>(p, r, j0, j1, sums + (r - r0) * kTokens);
    for (; r < r1; ++r) run_rows<T, kTokens, 1>(p, r, j0, j1, sums + (r - r0) * kTokens);
  }
  for (int64_t r = r0; r < r1; ++r) {
    float* s = sums + (r - r0) * kTokens;
    tail_columns<T, X, kTokens>(p, r, blocks * kBlock, s);
    const float b = bias ? static_cast<float>(bias[r]) : 0.f;
    for (int t = 0; t < kTokens; ++t) y[t * rows + r] = static_cast<T>(s[t] + b);
  }
}

// x's whole blocks repacked chunk by chunk, block-major: the tokens of a block lie side by side,
// where in x they are a row (cols elements) apart and, for 4 KiB-multiple rows, fall in one L1 set.
template <typename X, int kBlock>
std::unique_ptr<X[]> pack_blocks(const X* x, int64_t tokens, int64_t cols) {
  const int64_t blocks = cols / kBlock;
  std::unique_ptr<X[]> packed(new X[std::max<int64_t>(1, tokens * blocks * kBlock)]);
  for (int64_t t0 = 0; t0 < tokens; t0 += kChunkTokens) {
    const int64_t count = std::min<int64_t>(kChunkTokens, tokens - t0);
    X* chunk = packed.get() + t0 * blocks * kBlock;
    for (int64_t j = 0; j < blocks; ++j)
      for (int64_t t = 0; t < count; ++t)
        std::memcpy(chunk + (j * count + t) * kBlock, x + (t0 + t) * cols + j * kBlock, kBlock * sizeof(X));
  }
  return packed;
}

// Panels over the threads (dynamic: a descheduled thread on a shared machine does not hold a
// fixed share), chunks of up to 8 tokens inside each panel so its weights are read from memory
// once and from cache for the other chunks.
template <typename T, typename X, int kBlock>
void half_density(Pass<T, X> p, const T* bias, T* y, int64_t tokens, int64_t rows) {
  const std::unique_ptr<X[]> packed = pack_blocks<X, kBlock>(p.x, tokens, p.cols);
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows, blocks = p.cols / kBlock;
#pragma omp parallel for schedule(dynamic, 1) if (rows * p.cols * std::min<int64_t>(tokens, kChunkTokens) >= kParallelMin)
  for (int64_t panel = 0; panel < panels; ++panel) {
    const int64_t r0 = panel * kPanelRows, r1 = std::min(rows, r0 + kPanelRows);
    for (int64_t t0 = 0; t0 < tokens; t0 += kChunkTokens) {
      Pass<T, X> chunk = p;
      chunk.x = p.x + t0 * p.cols;
      chunk.packed = packed.get() + t0 * blocks * kBlock;
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
  half_density<T, float, 32>({x, nullptr, values, meta, cols, cols / 2, meta_bytes}, bias, y, tokens, rows);
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
  half_density<c10::BFloat16, c10::BFloat16, 64>({x, nullptr, values, meta, cols, cols / 2, meta_bytes}, bias, y,
                                                  tokens, rows);
}

}  // namespace pyprune_cpu

#endif  // x86-64: elsewhere cpu_isa() never passes kGeneric and nothing calls these
