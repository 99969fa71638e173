// N:M pruning masks on the CPU (pyprune._C).
//
// nm_mask(src, act_sqnorm, n, m, score_kind) -> bool mask [rows, cols]
//
// Every group of m consecutive elements of a row keeps exactly its n highest scores; among equal
// scores the lower index wins (the rank rule of nm_select.h, the order of a stable descending
// sort: pyprune.reference.nm_mask).
//
// Scores are fp32 and bitwise equal to the reference:
//   ScoreKind::GIVEN:     s = float(src)
//   ScoreKind::MAGNITUDE: s = |float(src)|
//   ScoreKind::WANDA:     s = |float(src)| * sqrt(act_sqnorm[col])
//
// Layout of the work: the input is cut into blocks of whole groups (nm::Tiling). Each block is
// converted to fp32 scores in a small stack buffer (one contiguous, vectorised pass that also
// detects NaN), then ranked (nm::rank_block). Blocks are distributed over OpenMP threads. The
// block routine is compiled per ISA (nm::Dispatch); every variant performs the same IEEE
// operations (exact conversion, fabs, one correctly rounded multiply; the sqrt is computed once
// per column), so results never depend on the variant chosen.

#include "nm_select.h"
#include "ops.h"
#include "parallel.h"
#include "scores.h"

#include <torch/types.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>

namespace pyprune_cpu {
namespace {

struct MaskBlock {
  struct Args {
    const void* src;        // first element of the block
    const float* colscale;  // sqrt(act_sqnorm) at the block's first column (ScoreKind::WANDA only)
    uint8_t* out;           // first output byte of the block
    int64_t len;            // elements in the block, a multiple of m, <= nm::kBlock
    int n;
    int m;
  };
  static constexpr int kMinKind = ScoreKind::GIVEN;

  // Returns nonzero when the block contains a NaN score.
  template <Dt D, int KIND, int MV, int VL>
  static PYPRUNE_ALWAYS_INLINE int run(const Args& a) {
    using T = typename Elem<D>::type;
    const T* __restrict x = static_cast<const T*>(a.src);
    const float* __restrict cs = a.colscale;
    // nm::kBlock scores, plus room for the padded read of the last group.
    alignas(64) float buf[nm::kBlock + 32];
    const int64_t len = a.len;
    int nan = 0;
    for (int64_t e = 0; e < len; ++e) {
      const float s = score_at<D, KIND>(x, e, cs);
      buf[e] = s;
      nan |= (s != s);
    }
    nm::rank_block<MV, VL>(buf, a.out, len, a.n, a.m);
    return nan;
  }
};

}  // namespace

torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                      int64_t n, int64_t m, int64_t score_kind) {
  const Dt d = source_dtype(src, "nm_mask");
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  check::nm("nm_mask", n, m, cols);
  const torch::Tensor scale = wanda_column_scale(act_sqnorm, cols, score_kind, "nm_mask");

  torch::Tensor out = torch::empty({rows, cols}, src.options().dtype(torch::kBool));
  if (rows == 0 || cols == 0) return out;

  const auto fn = nm::Dispatch<MaskBlock>::pick(d, static_cast<int>(score_kind), static_cast<int>(m));
  const int64_t esize = src.element_size();
  const char* sbase = static_cast<const char*>(src.data_ptr());
  uint8_t* obase = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const float* cbase = score_kind == ScoreKind::WANDA ? scale.data_ptr<float>() : nullptr;
  const nm::Tiling tiling(rows, cols, m, /*by_row=*/score_kind == ScoreKind::WANDA);
  const int ni = static_cast<int>(n), mi = static_cast<int>(m);
  int nan_found = 0;

  // Dynamic chunks of 16 blocks (~32K elements): even when another process holds a core, the
  // threads that do run take the remaining work instead of waiting at the barrier.
#pragma omp parallel for schedule(dynamic, 16) reduction(| : nan_found) if (rows * cols >= 32768)
  for (int64_t t = 0; t < tiling.tasks; ++t) {
    const nm::Tiling::Block blk = tiling.at(t);
    MaskBlock::Args a;
    a.src = sbase + blk.start * esize;
    a.colscale = cbase ? cbase + blk.col : nullptr;
    a.out = obase + blk.start;
    a.len = blk.len;
    a.n = ni;
    a.m = mi;
    nan_found |= fn(a);
  }

  TORCH_CHECK_VALUE(!nan_found, nan_message(score_kind));
  return out;
}

int64_t openmp_threads() { return max_threads(); }

}  // namespace pyprune_cpu
