// DReSS's channel penalty on the CPU (pyprune._C); pyprune/ops/penalty.py documents the op and
// pyprune.reference.channel_penalty_ is the oracle.
//
// channel_penalty_(grad, weight, channels, dim, lam, l1) -> norms [n] fp32
//   norms[k] = ‖W[slice c_k]‖₂                 (or ‖·‖₁ when l1)
//   grad[slice c_k] += lam·W/norms[k]           (ℓ2; nothing where the norm is 0)
//                      lam·sign(W)              (ℓ1)
// with slice c a row (dim 0) or a column (dim 1) of row-major [rows, cols] tensors; weight and
// grad may each be fp32/fp16/bf16. Each grad element is updated in fp32 and rounded once.
//
//   rows     a task per channel: pass 1 sums |w| or w² into kLanes fp32 lane sums (ℓ1 updates
//            grad in the same pass), pass 2 (ℓ2) adds scale·w to the row, still in cache.
//   columns  the rows in fixed blocks of kRowBlock, a task per block: pass 1 sums each channel's
//            terms of the block into its own fp32 row of partial sums (ℓ1 updates grad there),
//            the blocks' sums are added in order per channel, then pass 2 (ℓ2) walks the blocks
//            again. When the channels are a range (DReSS's default, the last p·d indices) the
//            inner loops are unit-stride and vectorise; otherwise they gather.
// Partitions never depend on the thread count, so neither do the results. Lane and block sums are
// combined in double, then rounded to fp32.

#include "checks.h"
#include "ops.h"
#include "parallel.h"

#include <torch/types.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace pyprune_cpu {
namespace {

// Lane sums per row: enough independent accumulators for the compiler to vectorise.
constexpr int64_t kLanes = 64;
// Rows per block of column sums.
constexpr int64_t kRowBlock = 128;

template <bool kL1>
inline float norm_term(float w) {
  return kL1 ? std::fabs(w) : w * w;
}

// lam·sign(w), sign(0) = 0.
inline float l1_step(float w, float lam) { return w > 0.0f ? lam : (w < 0.0f ? -lam : 0.0f); }

template <typename G>
inline void add_to(G& g, float step) {
  g = static_cast<G>(static_cast<float>(g) + step);
}

// The final norm from its sum, and the ℓ2 gradient's factor lam/norm (0 where the norm is 0).
template <bool kL1>
inline float finish_norm(double sum, float lam, float* scale) {
  const float total = static_cast<float>(sum);
  if (kL1) return total;
  const float norm = std::sqrt(total);
  *scale = norm > 0.0f ? lam / norm : 0.0f;
  return norm;
}

template <typename W, typename G, bool kL1>
void penalty_rows(const W* weight, G* grad, const int64_t* channels, float* norms, int64_t n,
                  int64_t cols, float lam) {
#pragma omp parallel for schedule(dynamic, 1) if (n * cols >= kParallelMin)
  for (int64_t k = 0; k < n; ++k) {
    const W* __restrict w = weight + channels[k] * cols;
    G* __restrict g = grad + channels[k] * cols;
    float lanes[kLanes] = {0.0f};
    for (int64_t j0 = 0; j0 < cols; j0 += kLanes) {
      const int64_t width = std::min(kLanes, cols - j0);
      for (int64_t i = 0; i < width; ++i) {
        const float x = static_cast<float>(w[j0 + i]);
        lanes[i] += norm_term<kL1>(x);
        if (kL1) add_to(g[j0 + i], l1_step(x, lam));
      }
    }
    double sum = 0.0;
    for (int64_t i = 0; i < kLanes; ++i) sum += lanes[i];
    float scale = 0.0f;
    norms[k] = finish_norm<kL1>(sum, lam, &scale);
    if (kL1 || scale == 0.0f) continue;
    for (int64_t j = 0; j < cols; ++j) add_to(g[j], scale * static_cast<float>(w[j]));
  }
}

// Channel k's column: first + k for a range, channels[k] otherwise.
template <bool kRange>
inline int64_t column(const int64_t* channels, int64_t first, int64_t k) {
  return kRange ? first + k : channels[k];
}

template <typename W, typename G, bool kL1, bool kRange>
void penalty_columns(const W* weight, G* grad, const int64_t* channels, float* norms, int64_t n,
                     int64_t rows, int64_t cols, float lam) {
  const int64_t first = channels[0];
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const bool parallel = n * rows >= kParallelMin;
  std::vector<float> partial(static_cast<size_t>(blocks * n), 0.0f);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    float* __restrict sums = partial.data() + b * n;
    for (int64_t r = b * kRowBlock; r < std::min(rows, (b + 1) * kRowBlock); ++r) {
      const W* __restrict w = weight + r * cols;
      G* __restrict g = grad + r * cols;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t c = column<kRange>(channels, first, k);
        const float x = static_cast<float>(w[c]);
        sums[k] += norm_term<kL1>(x);
        if (kL1) add_to(g[c], l1_step(x, lam));
      }
    }
  }
  std::vector<float> scale(static_cast<size_t>(n), 0.0f);
  bool any_step = false;
  for (int64_t k = 0; k < n; ++k) {
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; ++b) sum += partial[b * n + k];
    norms[k] = finish_norm<kL1>(sum, lam, &scale[k]);
    any_step = any_step || scale[k] != 0.0f;
  }
  if (kL1 || !any_step) return;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = b * kRowBlock; r < std::min(rows, (b + 1) * kRowBlock); ++r) {
      const W* __restrict w = weight + r * cols;
      G* __restrict g = grad + r * cols;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t c = column<kRange>(channels, first, k);
        add_to(g[c], scale[k] * static_cast<float>(w[c]));
      }
    }
  }
}

// f(T{}) for the element type T of a float32/float16/bfloat16 tensor.
template <typename F>
void with_float_type(const torch::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default:
      check::tensor("channel_penalty_", name, t, -1, check::floats());
  }
}

// Whether the channels are first, first + 1, ..., first + n − 1.
bool is_range(const int64_t* channels, int64_t n) {
  for (int64_t k = 1; k < n; ++k) {
    if (channels[k] != channels[0] + k) return false;
  }
  return true;
}

}  // namespace

torch::Tensor channel_penalty_(const torch::Tensor& grad, const torch::Tensor& weight,
                               const torch::Tensor& channels, int64_t dim, double lam, bool l1) {
  const char* op = "channel_penalty_";
  check::tensor(op, "weight", weight, 2, check::floats());
  check::tensor(op, "grad", grad, 2, check::floats());
  check::same_shape(op, "grad", grad, "weight", weight);
  check::dim01(op, "dim", dim);
  check::at_least(op, "lam", lam, 0.0);
  check::tensor(op, "channels", channels, 1, {at::kLong});
  TORCH_CHECK(channels.numel() > 0, op, ": channels must not be empty");
  const int64_t rows = weight.size(0), cols = weight.size(1), n = channels.numel();
  const int64_t* ch = channels.data_ptr<int64_t>();
  const int64_t extent = dim == 0 ? rows : cols;
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(ch[k] >= 0 && ch[k] < extent, "channel_penalty_: channels must be in [0, ",
                extent, "), got ", ch[k]);
  }
  torch::Tensor norms = torch::empty({n}, weight.options().dtype(at::kFloat));
  float* out = norms.data_ptr<float>();
  const float lam_f = static_cast<float>(lam);
  const bool range = is_range(ch, n);
  with_float_type(weight, "weight", [&](auto w_type) {
    with_float_type(grad, "grad", [&](auto g_type) {
      using W = decltype(w_type);
      using G = decltype(g_type);
      const W* w = static_cast<const W*>(weight.data_ptr());
      G* g = static_cast<G*>(grad.data_ptr());
      if (dim == 0) {
        if (l1) penalty_rows<W, G, true>(w, g, ch, out, n, cols, lam_f);
        else penalty_rows<W, G, false>(w, g, ch, out, n, cols, lam_f);
      } else if (range) {
        if (l1) penalty_columns<W, G, true, true>(w, g, ch, out, n, rows, cols, lam_f);
        else penalty_columns<W, G, false, true>(w, g, ch, out, n, rows, cols, lam_f);
      } else {
        if (l1) penalty_columns<W, G, true, false>(w, g, ch, out, n, rows, cols, lam_f);
        else penalty_columns<W, G, false, false>(w, g, ch, out, n, rows, cols, lam_f);
      }
    });
  });
  return norms;
}

}  // namespace pyprune_cpu
