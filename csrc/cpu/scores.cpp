// COPAL's sensitivity accumulation on the CPU (pyprune._C); pyprune/ops/scores.py documents the
// op and pyprune.reference.accumulate_abs_outer_ is the oracle.
//
// accumulate_abs_outer_(acc, a, b, alpha):  acc [M, D] += alpha·|a|ᵀ|b|,  a [T, M], b [T, D]
//
// The tokens are streamed in chunks of kChunkTokens: each chunk of a and of b is converted to
// fp32 absolute values in two small buffers (one pass, OpenMP), then one BLAS GEMM
// (at::addmm_, beta = 1) adds alpha·|a_chunk|ᵀ|b_chunk| into acc; the transpose is a GEMM flag,
// not a copy. So no full-size |a| or |b| exists: the buffers hold kChunkTokens·(M + D) floats
// (31 MB for LLaMA-7B's MLP shapes). Each chunk costs one read-modify-write of acc, small against
// the GEMM's 2·chunk flops per element of acc at 512 tokens (addmm_ on 4096×4096, 2048 tokens, 2
// threads: 512- and 1024-token chunks within 3% of one 2048-token GEMM, 256-token chunks ~30%
// slower).

#include "ops.h"
#include "parallel.h"
#include "scores.h"

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pyprune_cpu {
namespace {

constexpr int64_t kChunkTokens = 512;
// Elements converted per OpenMP task.
constexpr int64_t kSpan = 16384;

template <Dt D>
void abs_to_float(const void* src, int64_t count, float* __restrict dst) {
  const auto* __restrict s = static_cast<const typename Elem<D>::type*>(src);
  const int64_t spans = (count + kSpan - 1) / kSpan;
#pragma omp parallel for schedule(static) if (count >= kParallelMin)
  for (int64_t span = 0; span < spans; ++span) {
    const int64_t end = std::min(count, (span + 1) * kSpan);
    for (int64_t i = span * kSpan; i < end; ++i) dst[i] = std::fabs(Elem<D>::load(s, i));
  }
}

// dst[0, count) = |src[start, start + count)| as fp32 (src a contiguous CPU tensor).
void abs_to_float(const torch::Tensor& src, int64_t start, int64_t count, float* dst) {
  const auto st = src.scalar_type();
  const auto* base = static_cast<const char*>(src.data_ptr()) + start * src.element_size();
  if (st == at::kFloat) abs_to_float<Dt::F32>(base, count, dst);
  else if (st == at::kHalf) abs_to_float<Dt::F16>(base, count, dst);
  else abs_to_float<Dt::BF16>(base, count, dst);
}

void check_operand(const torch::Tensor& t, const char* name, int64_t tokens, int64_t features) {
  check::tensor("accumulate_abs_outer_", name, t, 2, check::floats());
  TORCH_CHECK(t.size(0) == tokens && t.size(1) == features, "accumulate_abs_outer: ", name,
              " must have shape [", tokens, ", ", features, "], got ", t.sizes());
}

}  // namespace

void accumulate_abs_outer_(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b,
                           double alpha) {
  check::tensor("accumulate_abs_outer_", "acc", acc, 2, {at::kFloat});
  check::tensor("accumulate_abs_outer_", "a", a, 2, check::floats());
  const int64_t tokens = a.size(0), M = acc.size(0), D = acc.size(1);
  check_operand(a, "a", tokens, M);
  check_operand(b, "b", tokens, D);
  if (tokens == 0 || M == 0 || D == 0) return;
  const int64_t chunk = std::min(kChunkTokens, tokens);
  torch::Tensor a_abs = torch::empty({chunk, M}, acc.options());
  torch::Tensor b_abs = torch::empty({chunk, D}, acc.options());
  for (int64_t first = 0; first < tokens; first += chunk) {
    const int64_t n = std::min(chunk, tokens - first);
    abs_to_float(a, first * M, n * M, a_abs.data_ptr<float>());
    abs_to_float(b, first * D, n * D, b_abs.data_ptr<float>());
    acc.addmm_(a_abs.narrow(0, 0, n).t(), b_abs.narrow(0, 0, n), /*beta=*/1, /*alpha=*/alpha);
  }
}

}  // namespace pyprune_cpu
