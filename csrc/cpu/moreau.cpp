// MoreauPruner's displacement step on the CPU (pyprune._C); pyprune/ops/moreau.py documents the
// op and pyprune.reference.moreau_step_ is the oracle.
//
// moreau_step_(delta, grad, weight, perturbed, decay, step_size, threshold, group_dim, noise_ratio,
//              seed)
//   d = decay·δ − step_size·g                  (fp32; the scalars are rounded to fp32 first)
//   δ ← d·max(0, 1 − threshold/‖d_S‖₂)        for each row (group_dim 0) or column (1) S;
//                                              δ ← d when threshold == 0
//   perturbed ← W + δ + noise_ratio·|W|·z      (when given; rounded once to perturbed's dtype)
// moreau_perturb_(perturbed, weight, delta, noise_ratio, seed): the last line alone.
// philox_uint32(seed, offsets): the generator's first two words (the tests compare them).
//
// z is Triton's tl.randn(seed, i) at the flat element index i: Philox4x32-10 with counter
// (i mod 2^32, i >> 32, 0, 0) and key (seed mod 2^32, seed >> 32); its first two words become
// uniforms u1, u2 as in tl.random.uint_to_uniform_float, and z = sqrt(−2 ln max(u1, 1e-7)) ·
// cos(fl(2π)·u2). Words and uniforms are bit-identical to Triton and the reference; ln and cos are
// branch-free polynomials here (within 2 ulp), so z agrees with them to about 1e-6.
//
// Work comes in spans of at most kSpan elements. A span stages g and W as fp32 in small buffers
// (staging.h), so every arithmetic loop is a plain fp32 loop the compiler vectorises. The noise is
// the costly part (ten Philox rounds per element): on AVX2 machines the words come from an
// intrinsics kernel (8 counters at a time) and Box–Muller is compiled for AVX2, picked at run
// time. No loop contracts to FMA (no target enables it), so d is bitwise the reference's and both
// variants give the same bits.
//   threshold 0   one pass over flat spans.
//   rows          a task per row: pass 1 adds d² into kSpan lane sums, pass 2 recomputes d
//                 (the same instructions, so the same bits) from the row, still in cache, scales
//                 it and writes δ and perturbed. Recomputing costs nothing in memory traffic and
//                 δ is written once.
//   columns       pass 1 sums d² per column over fixed blocks of kRowBlock rows; the blocks are
//                 added in order; pass 2 scales each row's d by its columns' factors.
// Partitions are fixed, never derived from the thread count, so results do not depend on it.

#include "cpu_isa.h"
#include "ops.h"
#include "parallel.h"
#include "scores.h"
#include "staging.h"

#include <torch/types.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PYPRUNE_MOREAU_X86 1
#endif

namespace pyprune_cpu {
namespace {

// Elements per span: 2 KB per fp32 staging buffer, so a span's buffers stay in L1.
constexpr int64_t kSpan = 512;
// Rows per block of column sums (pass 1 of column groups).
constexpr int64_t kRowBlock = 64;

struct StepArgs {
  float* delta;
  const void* grad;
  const void* weight;
  void* perturbed;  // null: no perturbed write
  Dt grad_dt, weight_dt, perturbed_dt;
  float decay, step_size, noise_ratio;
  uint64_t seed;
};

// ---------------------------------------------------------------------------------------------
// z: Philox4x32-10 and Box–Muller, as triton/language/random.py defines them.

constexpr uint32_t kPhiloxMultiplier0 = 0xD2511F53u;
constexpr uint32_t kPhiloxMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyStep0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyStep1 = 0xBB67AE85u;
// tl.random.uint_to_uniform_float: (2^31 − 1)·scale < 1 after fp32 rounding.
constexpr float kUniformScale = 4.6566127342e-10f;
constexpr float kMinUniform = 1.0e-7f;
constexpr float kTwoPi = 6.283185307179586f;
// ln 2 = kLn2Hi + kLn2Lo; kLn2Hi has 9 significant bits, so e·kLn2Hi is exact for |e| < 2^15.
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;

// The first two output words for counter (c0, c1, 0, 0) and key (k0, k1).
PYPRUNE_ALWAYS_INLINE void philox_words(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1,
                                        uint32_t& word0, uint32_t& word1) {
  uint32_t c2 = 0, c3 = 0;
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxMultiplier0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxMultiplier1) * c2;
    c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    k0 += kPhiloxKeyStep0;
    k1 += kPhiloxKeyStep1;
  }
  word0 = c0;
  word1 = c1;
}

// The word as int32, negatives bit-inverted (x ^ (x >> 31) == ~x for x < 0), times the scale.
PYPRUNE_ALWAYS_INLINE float uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  x ^= x >> 31;
  return static_cast<float>(x) * kUniformScale;
}

// max(u, kMinUniform) for u >= 0: the bit patterns of non-negative floats order like their values,
// and an integer select keeps the loop free of branches.
PYPRUNE_ALWAYS_INLINE float at_least_min_uniform(float u) {
  const uint32_t bits = float_to_bits(u), floor_bits = float_to_bits(kMinUniform);
  const uint32_t below = 0u - static_cast<uint32_t>(bits < floor_bits);
  return bits_to_float((floor_bits & below) | (bits & ~below));
}

// ln u for u in [1e-7, 1): u = m·2^e with m in [√½, √2), ln m = 2·atanh(s), s = (m−1)/(m+1),
// |s| < 0.172, whose odd series to s⁹ is within 2e-9 (relative).
PYPRUNE_ALWAYS_INLINE float log_unit(float u) {
  const uint32_t bits = float_to_bits(u);
  uint32_t mantissa = (bits & 0x007fffffu) | 0x3f800000u;                     // m in [1, 2)
  const uint32_t halve = 0u - static_cast<uint32_t>(mantissa > 0x3fb504f3u);  // m > √2
  mantissa -= halve & 0x00800000u;
  const float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127 +
                                     static_cast<int32_t>(halve & 1u));
  const float f = bits_to_float(mantissa) - 1.0f;
  const float s = f / (2.0f + f);
  const float s2 = s * s;
  const float odd = s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
  return (e * kLn2Lo + (2.0f * s + 2.0f * s * odd)) + e * kLn2Hi;
}

// cos θ for θ in [0, 2π]: θ = q·π/2 + r, |r| ≤ π/4, reduced in double (exact to far below an fp32
// ulp for q ≤ 4), then the Taylor polynomial of cos r or sin r (to r¹⁰ / r⁹: truncation < 3e-9)
// with the quadrant's sign. Selections are bit masks, so there is no branch.
PYPRUNE_ALWAYS_INLINE float cos_0_2pi(float theta) {
  const double t = theta;
  const double q = __builtin_rint(t * 0.63661977236758134);  // 2/π
  const float r = static_cast<float>(t - q * 1.5707963267948966);
  const uint32_t quadrant = static_cast<uint32_t>(static_cast<int32_t>(q));
  const float r2 = r * r;
  const float cos_r =
      1.0f + r2 * (-0.5f + r2 * (1.0f / 24 + r2 * (-1.0f / 720 + r2 * (1.0f / 40320 +
                                                                       r2 * (-1.0f / 3628800)))));
  const float sin_r =
      r + r * r2 * (-1.0f / 6 + r2 * (1.0f / 120 + r2 * (-1.0f / 5040 + r2 * (1.0f / 362880))));
  // quadrant 0: cos r, 1: −sin r, 2: −cos r, 3: sin r, 4: cos r
  const uint32_t odd = 0u - (quadrant & 1u);
  const uint32_t value = (float_to_bits(sin_r) & odd) | (float_to_bits(cos_r) & ~odd);
  return bits_to_float(value ^ (((quadrant + 1u) & 2u) << 30));
}

// The Philox words of n counters (low[i], high[i], 0, 0) under the seed's key.
PYPRUNE_ALWAYS_INLINE void philox_span_scalar(uint64_t seed, const uint32_t* __restrict low,
                                              const uint32_t* __restrict high, int64_t n,
                                              uint32_t* __restrict word0,
                                              uint32_t* __restrict word1) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t i = 0; i < n; ++i) philox_words(low[i], high[i], k0, k1, word0[i], word1[i]);
}

#ifdef PYPRUNE_MOREAU_X86
// (high, low) words of the 32x32-bit products a·m in 8 lanes: vpmuludq multiplies the even lanes,
// so the odd lanes are shifted down for a second multiply and the halves blended back.
__attribute__((target("avx2"))) inline void mul_wide8(__m256i a, __m256i m, __m256i& high,
                                                      __m256i& low) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  high = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  low = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// philox_span_scalar, 8 counters at a time (GCC's own vectorisation of it is 3x slower: it
// shuffles every 64-bit product apart and back together).
__attribute__((target("avx2"))) void philox_span_avx2(uint64_t seed, const uint32_t* low,
                                                      const uint32_t* high, int64_t n,
                                                      uint32_t* word0, uint32_t* word1) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxMultiplier0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxMultiplier1));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + i));
    __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + i));
    __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
      __m256i high0, low0, high2, low2;
      mul_wide8(c0, m0, high0, low0);
      mul_wide8(c2, m1, high2, low2);
      c0 = _mm256_xor_si256(_mm256_xor_si256(high2, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c2 = _mm256_xor_si256(_mm256_xor_si256(high0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c1 = low2;
      c3 = low0;
      k0 += kPhiloxKeyStep0;
      k1 += kPhiloxKeyStep1;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(word0 + i), c0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(word1 + i), c1);
  }
  philox_span_scalar(seed, low + i, high + i, n - i, word0 + i, word1 + i);
}
#endif

// z from the two words of each element (Box–Muller, first output).
PYPRUNE_ALWAYS_INLINE void box_muller(const uint32_t* __restrict word0,
                                      const uint32_t* __restrict word1, int64_t n,
                                      float* __restrict z) {
  for (int64_t i = 0; i < n; ++i) {
    const float u1 = at_least_min_uniform(uniform(word0[i]));
    const float theta = kTwoPi * uniform(word1[i]);
    z[i] = std::sqrt(-2.0f * log_unit(u1)) * cos_0_2pi(theta);  // sqrt arg > 0: u1 < 1
  }
}

// The Philox counters of flat indices first .. first + n − 1.
PYPRUNE_ALWAYS_INLINE void counters(int64_t first, int64_t n, uint32_t* __restrict low,
                                    uint32_t* __restrict high) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t index = static_cast<uint64_t>(first + i);
    low[i] = static_cast<uint32_t>(index);
    high[i] = static_cast<uint32_t>(index >> 32);
  }
}

// ---------------------------------------------------------------------------------------------
// Span operations.

// d = decay·δ − step_size·g
void displaced(const StepArgs& a, int64_t start, int64_t n, float* __restrict d) {
  load_span(a.grad, a.grad_dt, start, n, d);
  const float* __restrict delta = a.delta + start;
  const float decay = a.decay, step_size = a.step_size;
  for (int64_t i = 0; i < n; ++i) d[i] = decay * delta[i] - step_size * d[i];
}

// perturbed = W + δ + noise_ratio·|W|·z
template <bool kAvx2>
PYPRUNE_ALWAYS_INLINE void perturb_body(const StepArgs& a, int64_t start, int64_t n,
                                        const float* __restrict delta) {
  alignas(64) uint32_t low[kSpan] = {}, high[kSpan] = {};  // {}: GCC cannot see counters fill them
  alignas(64) uint32_t word0[kSpan], word1[kSpan];
  alignas(64) float w[kSpan];
  alignas(64) float z[kSpan];
  counters(start, n, low, high);
#ifdef PYPRUNE_MOREAU_X86
  if constexpr (kAvx2) philox_span_avx2(a.seed, low, high, n, word0, word1);
  else philox_span_scalar(a.seed, low, high, n, word0, word1);
#else
  philox_span_scalar(a.seed, low, high, n, word0, word1);
#endif
  box_muller(word0, word1, n, z);
  load_span(a.weight, a.weight_dt, start, n, w);
  const float ratio = a.noise_ratio;
  for (int64_t i = 0; i < n; ++i) w[i] = w[i] + delta[i] + ratio * std::fabs(w[i]) * z[i];
  store_span(a.perturbed, a.perturbed_dt, start, n, w);
}

using PerturbFn = void (*)(const StepArgs&, int64_t, int64_t, const float*);

void perturb_default(const StepArgs& a, int64_t start, int64_t n, const float* delta) {
  perturb_body<false>(a, start, n, delta);
}

#ifdef PYPRUNE_MOREAU_X86
__attribute__((target("avx2"))) void perturb_avx2(const StepArgs& a, int64_t start, int64_t n,
                                                  const float* delta) {
  perturb_body<true>(a, start, n, delta);
}
#endif

PerturbFn perturb_fn() {
#ifdef PYPRUNE_MOREAU_X86
  if (cpu_has_avx2()) return &perturb_avx2;
#endif
  return &perturb_default;
}

// δ ← d, then perturbed from the new δ.
void finish(const StepArgs& a, PerturbFn perturb, int64_t start, int64_t n, const float* d) {
  std::memcpy(a.delta + start, d, sizeof(float) * static_cast<size_t>(n));
  if (a.perturbed != nullptr) perturb(a, start, n, d);
}

// max(0, 1 − threshold/‖d_S‖₂), computed as the reference does (fp32 sqrt, compare, divide).
float shrink_factor(double sum_squares, float threshold) {
  const float norm = std::sqrt(static_cast<float>(sum_squares));
  return norm > threshold ? 1.0f - threshold / norm : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// The three layouts of the work.

void step_flat(const StepArgs& a, PerturbFn perturb, int64_t numel) {
  const int64_t spans = (numel + kSpan - 1) / kSpan;
#pragma omp parallel for schedule(dynamic, 16) if (numel >= kParallelMin)
  for (int64_t s = 0; s < spans; ++s) {
    alignas(64) float d[kSpan];
    const int64_t start = s * kSpan, n = std::min(kSpan, numel - start);
    displaced(a, start, n, d);
    finish(a, perturb, start, n, d);
  }
}

void step_rows(const StepArgs& a, PerturbFn perturb, int64_t rows, int64_t cols, float threshold) {
#pragma omp parallel for schedule(dynamic, 1) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float d[kSpan];
    alignas(64) float lanes[kSpan] = {0.0f};
    const int64_t row_start = r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kSpan) {
      const int64_t n = std::min(kSpan, cols - c0);
      displaced(a, row_start + c0, n, d);
      for (int64_t i = 0; i < n; ++i) lanes[i] += d[i] * d[i];
    }
    double sum = 0.0;
    for (int64_t i = 0; i < std::min(kSpan, cols); ++i) sum += lanes[i];
    const float scale = shrink_factor(sum, threshold);
    for (int64_t c0 = 0; c0 < cols; c0 += kSpan) {
      const int64_t n = std::min(kSpan, cols - c0);
      displaced(a, row_start + c0, n, d);
      for (int64_t i = 0; i < n; ++i) d[i] *= scale;
      finish(a, perturb, row_start + c0, n, d);
    }
  }
}

void step_columns(const StepArgs& a, PerturbFn perturb, int64_t rows, int64_t cols,
                  float threshold) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const bool parallel = rows * cols >= kParallelMin;
  std::vector<float> partial(static_cast<size_t>(blocks * cols), 0.0f);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    alignas(64) float d[kSpan];
    float* __restrict sums = partial.data() + b * cols;
    for (int64_t r = b * kRowBlock; r < std::min(rows, (b + 1) * kRowBlock); ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kSpan) {
        const int64_t n = std::min(kSpan, cols - c0);
        displaced(a, r * cols + c0, n, d);
        for (int64_t i = 0; i < n; ++i) sums[c0 + i] += d[i] * d[i];
      }
    }
  }
  std::vector<float> scale(static_cast<size_t>(cols));
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; ++b) sum += partial[b * cols + c];
    scale[c] = shrink_factor(sum, threshold);
  }
#pragma omp parallel for schedule(dynamic, 4) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float d[kSpan];
    for (int64_t c0 = 0; c0 < cols; c0 += kSpan) {
      const int64_t n = std::min(kSpan, cols - c0);
      displaced(a, r * cols + c0, n, d);
      for (int64_t i = 0; i < n; ++i) d[i] *= scale[c0 + i];
      finish(a, perturb, r * cols + c0, n, d);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks (pyprune.ops validates first; these guard direct calls).

Dt float_dtype(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  check::tensor("moreau", name, t, -1, check::floats());
  check::same_shape("moreau", name, t, "delta", like);
  return dt_of(t);
}

void check_delta(const torch::Tensor& delta) { check::tensor("moreau", "delta", delta, 2, {at::kFloat}); }

StepArgs make_args(const torch::Tensor& delta, const torch::Tensor& weight,
                   const c10::optional<torch::Tensor>& perturbed, double noise_ratio,
                   int64_t seed) {
  check_delta(delta);
  check::at_least<int64_t>("moreau", "seed", seed, 0);
  StepArgs a{};
  a.delta = delta.data_ptr<float>();
  a.weight = weight.data_ptr();
  a.weight_dt = float_dtype(weight, "weight", delta);
  if (perturbed.has_value() && perturbed->defined()) {
    a.perturbed = perturbed->data_ptr();
    a.perturbed_dt = float_dtype(*perturbed, "perturbed", delta);
  }
  a.noise_ratio = static_cast<float>(noise_ratio);
  a.seed = static_cast<uint64_t>(seed);
  return a;
}

}  // namespace

void moreau_step_(const torch::Tensor& delta, const torch::Tensor& grad,
                  const torch::Tensor& weight, const c10::optional<torch::Tensor>& perturbed,
                  double decay, double step_size, double threshold, int64_t group_dim,
                  double noise_ratio, int64_t seed) {
  StepArgs a = make_args(delta, weight, perturbed, noise_ratio, seed);
  a.grad = grad.data_ptr();
  a.grad_dt = float_dtype(grad, "grad", delta);
  a.decay = static_cast<float>(decay);
  a.step_size = static_cast<float>(step_size);
  check::at_least("moreau", "threshold", threshold, 0.0);
  check::dim01("moreau", "group_dim", group_dim);
  const int64_t rows = delta.size(0), cols = delta.size(1);
  if (rows * cols == 0) return;
  const float thr = static_cast<float>(threshold);
  const PerturbFn perturb = perturb_fn();
  if (thr == 0.0f) step_flat(a, perturb, rows * cols);
  else if (group_dim == 0) step_rows(a, perturb, rows, cols, thr);
  else step_columns(a, perturb, rows, cols, thr);
}

void moreau_perturb_(const torch::Tensor& perturbed, const torch::Tensor& weight,
                     const torch::Tensor& delta, double noise_ratio, int64_t seed) {
  const StepArgs a = make_args(delta, weight, perturbed, noise_ratio, seed);
  const int64_t numel = delta.numel();
  const PerturbFn perturb = perturb_fn();
  const int64_t spans = (numel + kSpan - 1) / kSpan;
#pragma omp parallel for schedule(dynamic, 16) if (numel >= kParallelMin)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t start = s * kSpan;
    perturb(a, start, std::min(kSpan, numel - start), a.delta + start);
  }
}

torch::Tensor philox_uint32(int64_t seed, const torch::Tensor& offsets) {
  check::at_least<int64_t>("philox_uint32", "seed", seed, 0);
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong,
              "philox_uint32: offsets must be an int64 CPU tensor");
  const torch::Tensor flat = offsets.contiguous().reshape({-1});
  torch::Tensor out = torch::empty({flat.numel(), 2}, flat.options());
  const int64_t* in = flat.data_ptr<int64_t>();
  int64_t* words = out.data_ptr<int64_t>();
  alignas(64) uint32_t low[kSpan], high[kSpan], word0[kSpan], word1[kSpan];
  for (int64_t start = 0; start < flat.numel(); start += kSpan) {
    const int64_t n = std::min(kSpan, flat.numel() - start);
    for (int64_t i = 0; i < n; ++i) {
      low[i] = static_cast<uint32_t>(in[start + i]);
      high[i] = static_cast<uint32_t>(static_cast<uint64_t>(in[start + i]) >> 32);
    }
    // the same word generator as the noise on this machine
    const uint64_t key = static_cast<uint64_t>(seed);
#ifdef PYPRUNE_MOREAU_X86
    if (cpu_has_avx2()) philox_span_avx2(key, low, high, n, word0, word1);
    else philox_span_scalar(key, low, high, n, word0, word1);
#else
    philox_span_scalar(key, low, high, n, word0, word1);
#endif
    for (int64_t i = 0; i < n; ++i) {
      words[2 * (start + i)] = word0[i];
      words[2 * (start + i) + 1] = word1[i];
    }
  }
  return out;
}

}  // namespace pyprune_cpu
