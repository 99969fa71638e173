// The compressed N:M form on the CPU: decompression, and a GEMV for decode-size inputs that reads
// only the kept weights.
//
// Format (pyprune.ops.nm_compress): values [rows, cols·n/m] hold the kept weights of each row in
// column order; meta [rows, ceil(cols/8)] uint8 is the keep mask, column 8b+j in bit j of byte b
// (bits past the last column are 0). Groups never reorder values, so the i-th set bit of a row's
// mask holds the row's i-th value whatever n and m are: both kernels walk the mask bytes.

#include "ops.h"

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYPRUNE_X86 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyprune_cpu {
namespace {

constexpr int64_t kMaxTokens = 8;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

void check_compressed(const char* op, const torch::Tensor& values, const torch::Tensor& meta,
                      int64_t n, int64_t m) {
  TORCH_CHECK(values.device().is_cpu() && meta.device().is_cpu(), op,
              ": values and meta must be CPU tensors");
  TORCH_CHECK(values.dim() == 2 && values.is_contiguous(), op, ": values must be 2-D contiguous");
  TORCH_CHECK(meta.dim() == 2 && meta.is_contiguous() && meta.scalar_type() == at::kByte, op,
              ": meta must be 2-D contiguous uint8");
  TORCH_CHECK(n >= 1 && n < m && m <= 32, op, ": need 1 <= n < m <= 32, got n=", n, ", m=", m);
  TORCH_CHECK(values.size(1) % n == 0, op, ": values must have a multiple of n columns");
  const int64_t cols = values.size(1) / n * m;
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
// Half-density patterns (1:2, 2:4, 4:8) keep exactly 4 columns of every 8, so each mask byte
// names 4 consecutive values: a table gives the byte's 4 set-bit positions, two bytes make the 8
// gather indices of one AVX2 vector, and the kept weights are multiplied with no expansion.
struct HalfDensityTable {
  alignas(16) int32_t positions[256][4] = {};
  HalfDensityTable() {
    for (int byte = 0; byte < 256; ++byte) {
      if (__builtin_popcount(byte) != 4) continue;  // never looked up for a valid mask
      for (int bit = 0, k = 0; bit < 8; ++bit)
        if (byte >> bit & 1) positions[byte][k++] = bit;
    }
  }
};

const HalfDensityTable& half_density_table() {
  static const HalfDensityTable table;
  return table;
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bf16 is the top half of fp32
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const double*) {
  return _mm256_setzero_ps();  // never called: the caller sends double down the generic path
}

__attribute__((target("avx2,fma,f16c"))) inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Needs n/m = 1/2 with m dividing 8 and cols % 16 == 0; x in fp32.
template <typename T>
__attribute__((target("avx2,fma,f16c")))
void gemv_half_density_avx2(const float* x, const T* values, const uint8_t* meta, const T* bias, T* y,
                            int64_t tokens, int64_t rows, int64_t cols, int64_t meta_bytes) {
  const HalfDensityTable& table = half_density_table();
  const int64_t kv = cols / 2;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    __m256 acc[kMaxTokens];
    for (int64_t t = 0; t < tokens; ++t) acc[t] = _mm256_setzero_ps();
    const T* v = values + r * kv;
    const uint8_t* mr = meta + r * meta_bytes;
    for (int64_t j = 0; j < cols / 16; ++j) {
      const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(table.positions[mr[2 * j]]));
      const __m128i hi = _mm_add_epi32(
          _mm_load_si128(reinterpret_cast<const __m128i*>(table.positions[mr[2 * j + 1]])),
          _mm_set1_epi32(8));
      const __m256i index = _mm256_add_epi32(_mm256_set_m128i(hi, lo),
                                             _mm256_set1_epi32(static_cast<int>(16 * j)));
      const __m256 w = load8(v + 8 * j);
      for (int64_t t = 0; t < tokens; ++t)
        acc[t] = _mm256_fmadd_ps(w, _mm256_i32gather_ps(x + t * cols, index, 4), acc[t]);
    }
    const float b = bias ? to_float(bias[r]) : 0.f;
    for (int64_t t = 0; t < tokens; ++t) y[t * rows + r] = static_cast<T>(horizontal_sum(acc[t]) + b);
  }
}

bool has_avx2_fma_f16c() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

// Whether a GEMV of these shapes runs gemv_half_density_avx2: one gather per token and vector
// wins for 1-2 tokens, the expanded buffer of gemv_rows above that.
bool takes_avx2_gather(int64_t tokens, int64_t rows, int64_t cols, int64_t n, int64_t m,
                       at::ScalarType dtype) {
#ifdef PYPRUNE_X86
  // m must divide 8 (1:2, 2:4, 4:8) so that every mask byte holds exactly 4 kept columns: 3:6
  // keeps 3 or 5 in some bytes.
  return tokens <= 2 && 2 * n == m && 8 % m == 0 && cols % 16 == 0 && dtype != at::kDouble &&
         rows < (int64_t{1} << 31) / 16 && has_avx2_fma_f16c();
#else
  return false;
#endif
}

void check_gemv_inputs(const torch::Tensor& x, const torch::Tensor& values,
                       const torch::Tensor& meta, int64_t n, int64_t m) {
  check_compressed("nm_linear_gemv", values, meta, n, m);
  const int64_t cols = values.size(1) / n * m;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "nm_linear_gemv: x must be a 2-D contiguous CPU tensor");
  TORCH_CHECK(x.size(1) == cols, "nm_linear_gemv: x must have ", cols, " columns");
  TORCH_CHECK(x.size(0) <= kMaxTokens, "nm_linear_gemv: x may have at most ", kMaxTokens, " rows");
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "nm_linear_gemv: x and values must share a dtype");
}

}  // namespace

bool cpu_has_avx2_fma_f16c() {
#ifdef PYPRUNE_X86
  return has_avx2_fma_f16c();
#else
  return false;
#endif
}

std::string nm_linear_gemv_path(const torch::Tensor& x, const torch::Tensor& values,
                                const torch::Tensor& meta, int64_t n, int64_t m) {
  check_gemv_inputs(x, values, meta, n, m);
  return takes_avx2_gather(x.size(0), values.size(0), values.size(1) / n * m, n, m, x.scalar_type())
             ? "avx2_gather"
             : "generic";
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

torch::Tensor nm_linear_gemv(const torch::Tensor& x, const torch::Tensor& values,
                             const torch::Tensor& meta, int64_t n, int64_t m,
                             const c10::optional<torch::Tensor>& bias) {
  check_gemv_inputs(x, values, meta, n, m);
  const int64_t rows = values.size(0), cols = values.size(1) / n * m;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == rows &&
                    bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "nm_linear_gemv: bias must be a contiguous [", rows, "] CPU tensor of x's dtype");
  }
  torch::Tensor y = torch::empty({x.size(0), rows}, x.options());
  if (y.numel() == 0) return y;
  const torch::Tensor x_float = x.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "nm_linear_gemv", [&] {
#ifdef PYPRUNE_X86
    // the choice nm_linear_gemv_path reports
    if (takes_avx2_gather(x.size(0), rows, cols, n, m, x.scalar_type())) {
      gemv_half_density_avx2<scalar_t>(x_float.data_ptr<float>(), values.data_ptr<scalar_t>(),
                                       meta.data_ptr<uint8_t>(),
                                       has_bias ? bias->data_ptr<scalar_t>() : nullptr,
                                       y.data_ptr<scalar_t>(), x.size(0), rows, cols, meta.size(1));
      return;
    }
#endif
    gemv_rows<scalar_t>(x_float.data_ptr<float>(), values.data_ptr<scalar_t>(), meta.data_ptr<uint8_t>(),
                        has_bias ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(),
                        x.size(0), rows, cols, static_cast<int>(n), static_cast<int>(m), meta.size(1));
  });
  return y;
}

}  // namespace pyprune_cpu
