// The compressed N:M form on the CPU: decompression, and the nm_linear op: a GEMV for decode-size
// inputs that reads only the kept weights, blocks decompressed into a reused buffer and multiplied by
// BLAS for larger ones.
//
// Format (pyprune.ops.nm_compress): values [rows, cols·n/m] hold the kept weights of each row in
// column order; meta [rows, ceil(cols/8)] uint8 is the keep mask, column 8b+j in bit j of byte b
// (bits past the last column are 0). Groups never reorder values, so the i-th set bit of a row's
// mask holds the row's i-th value whatever n and m are: both kernels walk the mask bytes.

#include "checks.h"
#include "cpu_isa.h"
#include "nm_linear_avx512.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <climits>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYPRUNE_X86 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyprune_cpu {
namespace {

// Tokens per kernel call: more are taken in chunks of this many, each chunk reading the weights
// again (the expand kernel is bound by its shuffles and x loads there, not by memory).
constexpr int64_t kMaxTokens = 8;
// x with at most this many rows takes the GEMV: AVX-512 kernels read the weights once for all rows,
// AVX2 ones once per kMaxTokens; which is faster than dense at a given count depends on the CPU, so
// SparseLinear measures it (pyprune.nn.tuning).
constexpr int64_t kGemvMaxRows = 256;
// Larger x: the bytes of W decompressed per BLAS call.
constexpr int64_t kBlockBytes = int64_t{1} << 21;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

void check_compressed(const char* op, const torch::Tensor& values, const torch::Tensor& meta,
                      int64_t n, int64_t m) {
  check::tensor(op, "values", values, 2);
  check::tensor(op, "meta", meta, 2, {at::kByte});
  TORCH_CHECK(n >= 1 && values.size(1) % n == 0, op, ": values must have a multiple of n (", n, ") columns");
  const int64_t cols = values.size(1) / n * m;
  check::nm(op, n, m, cols);
  TORCH_CHECK(meta.size(0) == values.size(0) && meta.size(1) == (cols + 7) / 8, op,
              ": meta must be [", values.size(0), ", ", (cols + 7) / 8, "]");
}

template <typename T>
void decompress_rows(const T* values, const uint8_t* meta, T* dense, int64_t rows, int64_t cols,
                     int n, int m, int64_t meta_bytes) {
  const int64_t kv = cols / m * n;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* v = values + r * kv;
    const T* const v_end = v + kv;  // a mask with too many set bits must not read past its row
    const uint8_t* mr = meta + r * meta_bytes;
    T* out = dense + r * cols;
    std::memset(static_cast<void*>(out), 0, sizeof(T) * static_cast<size_t>(cols));
    for (int64_t byte = 0; byte < meta_bytes; ++byte) {
      for (unsigned bits = mr[byte]; bits && v < v_end; bits &= bits - 1) {
        const int64_t col = 8 * byte + __builtin_ctz(bits);
        if (col < cols) out[col] = *v++;
      }
    }
  }
}

// Dot product of n floats with 8 independent partial sums, so the compiler vectorises it.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

// Each row is expanded chunk by chunk into a small fp32 buffer (zeros, then the kept weights at
// their columns) and dotted with the fp32 tokens, which the caller converted once.
template <typename T>
void gemv_rows(const float* x, const T* values, const uint8_t* meta, const T* bias, T* y,
               int64_t tokens, int64_t rows, int64_t cols, int n, int m, int64_t meta_bytes) {
  constexpr int64_t kChunk = 512;
  const int64_t kv = cols / m * n;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kMaxTokens] = {0.f};
    float buf[kChunk];
    const T* v = values + r * kv;
    const T* const v_end = v + kv;  // a mask with too many set bits must not read past its row
    const uint8_t* mr = meta + r * meta_bytes;
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {  // kChunk is a multiple of 8: whole bytes
      const int64_t len = cols - c0 < kChunk ? cols - c0 : kChunk;
      std::memset(buf, 0, sizeof(float) * static_cast<size_t>(len));
      for (int64_t byte = 0; byte < (len + 7) / 8; ++byte) {
        for (unsigned bits = mr[c0 / 8 + byte]; bits && v < v_end; bits &= bits - 1) {
          const int64_t col = 8 * byte + __builtin_ctz(bits);
          if (col < len) buf[col] = to_float(*v++);
        }
      }
      for (int64_t t = 0; t < tokens; ++t) acc[t] += dot(buf, x + t * cols + c0, len);
    }
    const float b = bias ? to_float(bias[r]) : 0.f;
    for (int64_t t = 0; t < tokens; ++t) y[t * rows + r] = static_cast<T>(acc[t] + b);
  }
}

#ifdef PYPRUNE_X86
#define PYPRUNE_AVX2 __attribute__((target("avx2,fma,f16c")))

// Half-density patterns (1:2, 2:4, 4:8) keep exactly 4 columns of every 8, so mask byte b of a
// row names the row's values 4b..4b+3 and a 16-column block (two bytes) holds 8 values: one
// vector. Two lane tables (8 KiB each, L1-resident) turn a byte into vpermps indices:
struct HalfDensityTables {
  // take[b]: lanes k and k+4 hold the column of the byte's k-th kept weight, so vpermps of the 8
  // x values of a byte lines up the x each kept weight multiplies (no gather).
  alignas(32) int32_t take[256][8] = {};
  // place[b]: lane c holds the rank of column c among the kept ones (which packed weight goes
  // there), with the sign bit set where column c was pruned (that lane is then zeroed).
  alignas(32) int32_t place[256][8] = {};
  HalfDensityTables() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int bit = 0, k = 0; bit < 8; ++bit) {
        if (!(byte >> bit & 1)) {
          place[byte][bit] = INT32_MIN;
          continue;
        }
        // a byte with more than 4 set bits (an invalid mask) still indexes within its vector
        if (k < 4) take[byte][k] = take[byte][k + 4] = bit;
        place[byte][bit] = k++;
      }
    }
  }
};

const HalfDensityTables& half_density_tables() {
  static const HalfDensityTables tables;
  return tables;
}

PYPRUNE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PYPRUNE_AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
PYPRUNE_AVX2 inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bf16 is the top half of fp32
}
PYPRUNE_AVX2 inline __m256i load_lanes(const int32_t* lanes) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}

PYPRUNE_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Rows per pass for a token count: they share each block of x while their
// kRows * kTokens accumulators stay in the 16 vector registers.
constexpr int rows_per_pass(int tokens) { return tokens <= 2 ? 4 : tokens <= 4 ? 2 : 1; }

// y[t, r0 .. r0+kRows) of kTokens tokens over the 16-column blocks, then the columns past the last
// whole block (cols % 16, from the mask bits). One token: the kept weights multiply x permuted into
// their order (2 vpermps + 1 blend per 8 weights). More tokens: the 8 weights are expanded once
// into the 16 dense columns they came from (2 vpermps), and every token does 2 plain FMAs.
template <typename T, int kTokens, int kRows>
PYPRUNE_AVX2 void half_density_rows(const float* x, const T* values, const uint8_t* meta,
                                    const T* bias, T* y, int64_t r0, int64_t rows, int64_t cols,
                                    int64_t meta_bytes, const HalfDensityTables& tables) {
  const int64_t kv = cols / 2, blocks = cols / 16;
  const T* v[kRows];
  const uint8_t* mask[kRows];
  for (int i = 0; i < kRows; ++i) {
    v[i] = values + (r0 + i) * kv;
    mask[i] = meta + (r0 + i) * meta_bytes;
  }
  __m256 acc[kRows][kTokens];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm256_setzero_ps();
  int64_t j = 0;
  if constexpr (kTokens == 1 && std::is_same_v<T, at::BFloat16>) {
    // bf16, one token: 16 weights (two blocks) per load, widened by interleaving with zeros, which
    // pairs weights 0-3 with 8-11 and 4-7 with 12-15 (mask bytes 0 and 2, 1 and 3): x is permuted
    // in that order instead of widening every 8 weights on their own
    const __m256i zero = _mm256_setzero_si256();
    for (; j + 2 <= blocks; j += 2) {
      const float* xj = x + 16 * j;
      const __m256 x0 = _mm256_loadu_ps(xj), x1 = _mm256_loadu_ps(xj + 8);
      const __m256 x2 = _mm256_loadu_ps(xj + 16), x3 = _mm256_loadu_ps(xj + 24);
      for (int i = 0; i < kRows; ++i) {
        const uint8_t* b = mask[i] + 2 * j;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[i] + 8 * j));
        const __m256 lo = _mm256_blend_ps(_mm256_permutevar8x32_ps(x0, load_lanes(tables.take[b[0]])),
                                          _mm256_permutevar8x32_ps(x2, load_lanes(tables.take[b[2]])), 0xF0);
        const __m256 hi = _mm256_blend_ps(_mm256_permutevar8x32_ps(x1, load_lanes(tables.take[b[1]])),
                                          _mm256_permutevar8x32_ps(x3, load_lanes(tables.take[b[3]])), 0xF0);
        acc[i][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w)), lo, acc[i][0]);
        acc[i][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w)), hi, acc[i][0]);
      }
    }
  }
  for (; j < blocks; ++j) {
    if constexpr (kTokens == 1) {
      const __m256 x_lo = _mm256_loadu_ps(x + 16 * j), x_hi = _mm256_loadu_ps(x + 16 * j + 8);
      for (int i = 0; i < kRows; ++i) {
        const __m256 lo = _mm256_permutevar8x32_ps(x_lo, load_lanes(tables.take[mask[i][2 * j]]));
        const __m256 hi = _mm256_permutevar8x32_ps(x_hi, load_lanes(tables.take[mask[i][2 * j + 1]]));
        acc[i][0] = _mm256_fmadd_ps(load8(v[i] + 8 * j), _mm256_blend_ps(lo, hi, 0xF0), acc[i][0]);
      }
    } else {
      for (int i = 0; i < kRows; ++i) {
        const __m256 w = load8(v[i] + 8 * j);
        const __m256i place_lo = load_lanes(tables.place[mask[i][2 * j]]);
        const __m256i place_hi = _mm256_add_epi32(load_lanes(tables.place[mask[i][2 * j + 1]]),
                                                  _mm256_set1_epi32(4));
        const __m256 w_lo = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_srai_epi32(place_lo, 31)),
                                             _mm256_permutevar8x32_ps(w, place_lo));
        const __m256 w_hi = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_srai_epi32(place_hi, 31)),
                                             _mm256_permutevar8x32_ps(w, place_hi));
        for (int t = 0; t < kTokens; ++t) {
          const float* xt = x + t * cols + 16 * j;
          acc[i][t] = _mm256_fmadd_ps(w_lo, _mm256_loadu_ps(xt), acc[i][t]);
          acc[i][t] = _mm256_fmadd_ps(w_hi, _mm256_loadu_ps(xt + 8), acc[i][t]);
        }
      }
    }
  }
  for (int i = 0; i < kRows; ++i) {
    float sum[kTokens];
    for (int t = 0; t < kTokens; ++t) sum[t] = horizontal_sum(acc[i][t]);
    const T* w = v[i] + 8 * blocks;
    const T* const w_end = v[i] + kv;  // a mask with too many set bits must not read past its row
    for (int64_t byte = 2 * blocks; byte < meta_bytes; ++byte) {
      for (unsigned bits = mask[i][byte]; bits && w < w_end; bits &= bits - 1) {
        const int64_t col = 8 * byte + __builtin_ctz(bits);
        if (col >= cols) break;
        const float weight = to_float(*w++);
        for (int t = 0; t < kTokens; ++t) sum[t] += weight * x[t * cols + col];
      }
    }
    const float b = bias ? to_float(bias[r0 + i]) : 0.f;
    for (int t = 0; t < kTokens; ++t) y[t * rows + r0 + i] = static_cast<T>(sum[t] + b);
  }
}

// All rows, kRows at a time over the threads, the last rows % kRows one by one. Chunks of 16
// passes are handed out dynamically: on a shared machine a descheduled thread does not hold half
// the rows (with a static split the call waits for it).
template <typename T, int kTokens>
PYPRUNE_AVX2 void gemv_half_density_avx2(const float* x, const T* values, const uint8_t* meta,
                                         const T* bias, T* y, int64_t rows, int64_t cols,
                                         int64_t meta_bytes) {
  constexpr int kRows = rows_per_pass(kTokens);
  const HalfDensityTables& tables = half_density_tables();
  const int64_t passes = (rows + kRows - 1) / kRows;
#pragma omp parallel for schedule(dynamic, 16) if (rows * cols >= kParallelMin)
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t r0 = p * kRows;
    if (r0 + kRows <= rows) {
      half_density_rows<T, kTokens, kRows>(x, values, meta, bias, y, r0, rows, cols, meta_bytes, tables);
    } else {
      for (int64_t r = r0; r < rows; ++r)
        half_density_rows<T, kTokens, 1>(x, values, meta, bias, y, r, rows, cols, meta_bytes, tables);
    }
  }
}

template <typename T>
void gemv_half_density(const float* x, const T* values, const uint8_t* meta, const T* bias, T* y,
                       int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes) {
  switch (tokens) {
#define PYPRUNE_TOKENS(count) \
  case count:                 \
    return gemv_half_density_avx2<T, count>(x, values, meta, bias, y, rows, cols, meta_bytes);
    PYPRUNE_TOKENS(1) PYPRUNE_TOKENS(2) PYPRUNE_TOKENS(3) PYPRUNE_TOKENS(4)
    PYPRUNE_TOKENS(5) PYPRUNE_TOKENS(6) PYPRUNE_TOKENS(7) PYPRUNE_TOKENS(8)
#undef PYPRUNE_TOKENS
  }
  TORCH_CHECK(false, "nm_linear: the AVX2 kernel takes 1 to ", kMaxTokens, " tokens, got ", tokens);
}

#endif

// Half-density patterns (1:2, 2:4, 4:8: m divides 8, so every mask byte keeps exactly 4 columns;
// 3:6 keeps 3 or 5 in some bytes) of fp32/fp16/bf16 weights take the best kernel cpu_isa() allows:
// "avx512_bf16_dot" (bf16), "avx512_expand" (any token count in one pass over the weights), or
// "avx2_permute" for one token and "avx2_expand" for more (chunks of kMaxTokens; a last chunk of one
// token is permuted). Anything else takes the generic kernel.
const char* gemv_path(int64_t tokens, int64_t n, int64_t m, at::ScalarType dtype) {
  const CpuIsa isa = cpu_isa();
  if (2 * n != m || 8 % m != 0 || dtype == at::kDouble || isa == CpuIsa::kGeneric) return "generic";
  if (isa == CpuIsa::kAvx512Bf16 && dtype == at::kBFloat16) return "avx512_bf16_dot";
  if (isa >= CpuIsa::kAvx512) return "avx512_expand";
  return tokens == 1 ? "avx2_permute" : "avx2_expand";
}

void check_gemv_inputs(const torch::Tensor& x, const torch::Tensor& values,
                       const torch::Tensor& meta, int64_t n, int64_t m) {
  check_compressed("nm_linear", values, meta, n, m);
  const int64_t cols = values.size(1) / n * m;
  check::tensor("nm_linear", "x", x, 2);
  TORCH_CHECK(x.size(1) == cols, "nm_linear: x must have ", cols, " columns");
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "nm_linear: x and values must share a dtype");
}

// x [tokens, cols] @ (W ⊙ mask)ᵀ + bias straight from the compressed form (fp32 accumulation).
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                   int64_t n, int64_t m, const c10::optional<torch::Tensor>& bias);

// Larger x: W decompressed kBlockBytes at a time (a block the allocator reuses, warm in cache) and
// multiplied by BLAS, so no dense copy of W is ever allocated.
torch::Tensor blocked(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                      int64_t n, int64_t m, const c10::optional<torch::Tensor>& bias) {
  const int64_t n_out = values.size(0);
  const int64_t row_bytes = values.size(1) / n * m * values.element_size();
  const int64_t block = std::max<int64_t>(1, kBlockBytes / row_bytes);
  torch::Tensor out_t = torch::empty({n_out, x.size(0)}, x.options());
  for (int64_t r0 = 0; r0 < n_out; r0 += block) {
    const int64_t r1 = std::min(n_out, r0 + block);
    torch::Tensor out_block = out_t.slice(0, r0, r1);
    at::mm_out(out_block, nm_decompress(values.slice(0, r0, r1), meta.slice(0, r0, r1), n, m), x.t());
  }
  if (bias.has_value() && bias->defined()) out_t.add_(bias->unsqueeze(1));
  return out_t.t().contiguous();
}

}  // namespace

std::string nm_linear_path(const torch::Tensor& x, const torch::Tensor& values,
                                const torch::Tensor& meta, int64_t n, int64_t m) {
  check_gemv_inputs(x, values, meta, n, m);
  return gemv_path(x.size(0), n, m, x.scalar_type());
}

torch::Tensor nm_decompress(const torch::Tensor& values, const torch::Tensor& meta, int64_t n,
                            int64_t m) {
  check_compressed("nm_decompress", values, meta, n, m);
  const int64_t rows = values.size(0), cols = values.size(1) / n * m;
  torch::Tensor dense = torch::empty({rows, cols}, values.options());
  if (dense.numel() == 0) return dense;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "nm_decompress", [&] {
    decompress_rows<scalar_t>(values.data_ptr<scalar_t>(), meta.data_ptr<uint8_t>(),
                              dense.data_ptr<scalar_t>(), rows, cols, static_cast<int>(n),
                              static_cast<int>(m), meta.size(1));
  });
  return dense;
}

torch::Tensor nm_linear(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                        int64_t n, int64_t m, const c10::optional<torch::Tensor>& bias) {
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  TORCH_CHECK(!out_shape.empty(), "nm_linear: x must have at least 1 dim");
  out_shape.back() = values.size(0);
  if (x.numel() == 0) return torch::empty(out_shape, x.options());  // as F.linear: no kernel
  const torch::Tensor rows = x.contiguous().reshape({-1, x.size(-1)});
  const torch::Tensor v = values.contiguous(), mt = meta.contiguous();
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous();
  const torch::Tensor out = rows.size(0) <= kGemvMaxRows ? gemv(rows, v, mt, n, m, b) : blocked(rows, v, mt, n, m, b);
  return out.reshape(out_shape);
}

namespace {

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                   int64_t n, int64_t m, const c10::optional<torch::Tensor>& bias) {
  check_gemv_inputs(x, values, meta, n, m);
  const int64_t rows = values.size(0), cols = values.size(1) / n * m;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check::tensor("nm_linear", "bias", *bias, 1, {x.scalar_type()});
    TORCH_CHECK(bias->size(0) == rows, "nm_linear: bias must have ", rows, " entries, got ", bias->size(0));
  }
  const int64_t tokens = x.size(0);
  torch::Tensor y = torch::empty({tokens, rows}, x.options());
  if (y.numel() == 0) return y;
  const std::string path = gemv_path(tokens, n, m, x.scalar_type());
  const int64_t meta_bytes = meta.size(1);
#ifdef PYPRUNE_X86
  if (path == "avx512_bf16_dot") {  // bf16 x as it is: vdpbf16ps multiplies bf16 pairs
    const torch::Tensor xc = x.contiguous();
    gemv_half_density_avx512_bf16(xc.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(),
                                  meta.data_ptr<uint8_t>(), has_bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                                  y.data_ptr<at::BFloat16>(), tokens, rows, cols, meta_bytes);
    return y;
  }
#endif
  const torch::Tensor x_float = x.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "nm_linear", [&] {
    const scalar_t* b = has_bias ? bias->data_ptr<scalar_t>() : nullptr;
#ifdef PYPRUNE_X86
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (path == "avx512_expand") {  // every token in one pass over the weights
        gemv_half_density_avx512<scalar_t>(x_float.data_ptr<float>(), values.data_ptr<scalar_t>(),
                                           meta.data_ptr<uint8_t>(), b, y.data_ptr<scalar_t>(), tokens, rows,
                                           cols, meta_bytes);
        return;
      }
    }
#endif
    for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
      const int64_t count = std::min(kMaxTokens, tokens - t0);
      const float* xc = x_float.data_ptr<float>() + t0 * cols;
      scalar_t* yc = y.data_ptr<scalar_t>() + t0 * rows;
#ifdef PYPRUNE_X86
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (path != "generic") {  // avx2_permute / avx2_expand
          gemv_half_density<scalar_t>(xc, values.data_ptr<scalar_t>(), meta.data_ptr<uint8_t>(), b, yc,
                                      count, rows, cols, meta_bytes);
          continue;
        }
      }
#endif
      gemv_rows<scalar_t>(xc, values.data_ptr<scalar_t>(), meta.data_ptr<uint8_t>(), b, yc, count, rows,
                          cols, static_cast<int>(n), static_cast<int>(m), meta_bytes);
    }
  });
  return y;
}

}  // namespace

}  // namespace pyprune_cpu
