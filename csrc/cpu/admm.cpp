// SAFE's dual update (z-step + u-step) on the compact state (v, keep), on the CPU (pyprune._C);
// spec §1.8 and kernel K6.
//
// admm_dual_update_(v, keep, x, act_sqnorm, n, m, keep_count, per_row) -> ‖x − v⊙keep‖² (0-d fp32)
// N:M when m > 0 (keep_count and per_row unused), top-k otherwise (n and m are 0).
//
// In place: v ← x + v⊙¬keep (fp32), then keep ← the support of the projection of v: the n
// highest of every m consecutive scores of a row, or the keep_count highest of every row / of
// the tensor. Scores are |v| (SAFE) or |v|·sqrt(act_sqnorm[col]) (SAFE⁺, Wanda-P), bitwise those
// of pyprune.reference (scores.h); among equal scores the lower index is kept.
//
// N:M        one pass. Each block of whole groups (nm::Tiling, ~2K elements) is updated and
//            scored into a stack buffer, ranked straight into keep by the ranking of nm_mask
//            (nm::rank_block, compiled per ISA by nm::Dispatch), and its residual summed while
//            the block is still in L1.
// top-k row  one thread per row: update the row, compute its keys (the keys of topk_mask),
//            select in the row (topk::select_row), sum its residual; the row stays in cache.
// top-k      an update pass over the tensor, the radix select of topk_mask over v
// tensor     (topk::topk_tensor: three histogram passes, a fourth when ties straddle the
//            threshold, and the mask pass), then a residual pass.
//
// The residual is summed in 16 fp32 lanes per block or row and the blocks are added in fp64 in
// index order, so it does not depend on the number of threads. A NaN score raises ValueError
// after the update (v and keep then hold that update).

#include "nm_select.h"
#include "ops.h"
#include "scores.h"
#include "topk_select.h"

#include <torch/types.h>

#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace pyprune_cpu {
namespace {

constexpr const char* kNanMessage =
    "scores of v = x + u (and act_sqnorm) contain NaN; scores must be finite or ±inf";

// x + v⊙¬keep for one element. v is multiplied by 0/1 as the reference does (a dropped -3.0
// gives -0.0, an inf NaN), so the result is bitwise the reference's.
PYPRUNE_ALWAYS_INLINE float updated(float v, uint8_t keep, float x) {
  return v * static_cast<float>(keep ^ 1) + x;
}

template <Dt D>
PYPRUNE_ALWAYS_INLINE void update_v(const typename Elem<D>::type* __restrict x, float* __restrict v,
                                    const uint8_t* __restrict keep, int64_t len) {
  for (int64_t e = 0; e < len; ++e) v[e] = updated(v[e], keep[e], Elem<D>::load(x, e));
}

// Σ (x − v⊙keep)² over len elements: 16 fp32 partial sums (independent, so they vectorise),
// added in fp64.
template <Dt D>
PYPRUNE_ALWAYS_INLINE double residual(const typename Elem<D>::type* __restrict x,
                                      const float* __restrict v, const uint8_t* __restrict keep,
                                      int64_t len) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t e = 0;
  for (; e + kLanes <= len; e += kLanes) {
#pragma GCC unroll 16
    for (int l = 0; l < kLanes; ++l) {
      const float d = Elem<D>::load(x, e + l) - v[e + l] * static_cast<float>(keep[e + l]);
      lanes[l] += d * d;
    }
  }
  for (; e < len; ++e) {
    const float d = Elem<D>::load(x, e) - v[e] * static_cast<float>(keep[e]);
    lanes[0] += d * d;
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// The N:M block routine (see nm_select.h for the dispatch).
struct DualBlock {
  struct Args {
    const void* x;          // first element of the block, of x's dtype
    float* v;               // the same elements of v
    uint8_t* keep;          // and of keep
    const float* colscale;  // sqrt(act_sqnorm) at the block's first column (Wanda only)
    int64_t len;            // elements in the block, a multiple of m, <= nm::kBlock
    int n;
    int m;
    double* residual;       // receives the block's Σ (x − v⊙keep)²
  };
  static constexpr int kMinKind = ScoreKind::MAGNITUDE;  // |v| or Wanda

  // Returns nonzero when the block contains a NaN score.
  template <Dt D, int KIND, int MV, int VL>
  static PYPRUNE_ALWAYS_INLINE int run(const Args& a) {
    using T = typename Elem<D>::type;
    const T* __restrict x = static_cast<const T*>(a.x);
    float* __restrict v = a.v;
    uint8_t* __restrict keep = a.keep;
    const int64_t len = a.len;
    alignas(64) float scores[nm::kBlock + 32];  // room for the padded read of the last group
    int nan = 0;
    for (int64_t e = 0; e < len; ++e) {
      v[e] = updated(v[e], keep[e], Elem<D>::load(x, e));
      const float s = score_at<Dt::F32, KIND>(v, e, a.colscale);
      scores[e] = s;
      nan |= (s != s);
    }
    nm::rank_block<MV, VL>(scores, keep, len, a.n, a.m);
    *a.residual = residual<D>(x, v, keep, len);
    return nan;
  }
};

// The state of one call: raw pointers into v, keep and x (row-major [rows, cols]).
struct State {
  const char* x;
  float* v;
  uint8_t* keep;
  const float* colscale;  // sqrt(act_sqnorm) per column, or nullptr
  int64_t rows;
  int64_t cols;

  int64_t numel() const { return rows * cols; }
  int kind() const { return colscale ? ScoreKind::WANDA : ScoreKind::MAGNITUDE; }
};

// Checks v, keep and x and returns the call's state and x's dtype; `scale` keeps the column
// scales alive.
State check_state(const torch::Tensor& v, const torch::Tensor& keep, const torch::Tensor& x,
                  const c10::optional<torch::Tensor>& act_sqnorm, const char* op, Dt* dtype,
                  torch::Tensor* scale) {
  *dtype = source_dtype(x, op, "x");
  TORCH_CHECK(x.numel() > 0, op, ": x must not be empty");
  check::tensor(op, "v", v, 2, {at::kFloat});
  check::tensor(op, "keep", keep, 2, {at::kBool});
  check::same_shape(op, "v", v, "x", x);
  check::same_shape(op, "keep", keep, "x", x);
  const bool wanda = act_sqnorm.has_value() && act_sqnorm->defined();
  *scale = wanda_column_scale(act_sqnorm, x.size(1), wanda ? 2 : 1, op);
  return {static_cast<const char*>(x.data_ptr()), v.data_ptr<float>(),
          reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()),
          wanda ? scale->data_ptr<float>() : nullptr, x.size(0), x.size(1)};
}

// Σ of the partial sums in index order, as a 0-d fp32 tensor; raises on NaN scores.
torch::Tensor finish(const std::vector<double>& partial, int nan_found) {
  TORCH_CHECK_VALUE(!nan_found, kNanMessage);
  double total = 0.0;
  for (const double p : partial) total += p;
  return torch::full({}, static_cast<float>(total), torch::dtype(torch::kFloat));
}

template <Dt D>
int update_topk_rows(const State& s, int64_t keep_count, std::vector<double>* partial) {
  using T = typename Elem<D>::type;
  const T* x = reinterpret_cast<const T*>(s.x);
  const int64_t cols = s.cols;
  const topk::KeysFn keys_fn = topk::keys_for(Dt::F32, s.kind());
  topk::RowPass pass(s.rows, cols);
  const int64_t chunk = pass.chunk;
  int nan_found = 0;
#pragma omp parallel num_threads(pass.threads) reduction(| : nan_found)
  {
    uint32_t* keys = pass.scratch.mine();
#pragma omp for schedule(dynamic, chunk)
    for (int64_t r = 0; r < s.rows; ++r) {
      const T* xr = x + r * cols;
      float* vr = s.v + r * cols;
      uint8_t* kr = s.keep + r * cols;
      update_v<D>(xr, vr, kr, cols);
      nan_found |= keys_fn(vr, s.colscale, cols, keys);
      topk::select_row(keys, cols, keep_count, keys + cols, kr);
      (*partial)[r] = residual<D>(xr, vr, kr, cols);
    }
  }
  return nan_found;
}

template <Dt D>
int update_topk_tensor(const State& s, int64_t keep_count, std::vector<double>* partial) {
  using T = typename Elem<D>::type;
  const T* x = reinterpret_cast<const T*>(s.x);
  const topk::Source v_keys{topk::keys_for(Dt::F32, s.kind()), reinterpret_cast<const char*>(s.v),
                            sizeof(float), s.colscale, s.cols, s.numel()};
  const int64_t blocks = v_keys.blocks();
  const bool parallel = s.numel() >= kParallelMin;
#pragma omp parallel for schedule(dynamic, 8) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * topk::kBlock;
    update_v<D>(x + start, s.v + start, s.keep + start, v_keys.block_len(b));
  }
  const int nan_found = topk::topk_tensor(v_keys, keep_count, s.keep);
#pragma omp parallel for schedule(dynamic, 8) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * topk::kBlock;
    (*partial)[b] = residual<D>(x + start, s.v + start, s.keep + start, v_keys.block_len(b));
  }
  return nan_found;
}

template <Dt D>
int update_topk(const State& s, int64_t keep_count, bool per_row, std::vector<double>* partial) {
  return per_row ? update_topk_rows<D>(s, keep_count, partial)
                 : update_topk_tensor<D>(s, keep_count, partial);
}

}  // namespace

namespace {

constexpr const char* kOp = "admm_dual_update_";

torch::Tensor dual_update_nm(const torch::Tensor& v, const torch::Tensor& keep,
                             const torch::Tensor& x, const c10::optional<torch::Tensor>& act_sqnorm,
                             int64_t n, int64_t m) {
  const char* op = kOp;
  Dt d;
  torch::Tensor scale;
  const State s = check_state(v, keep, x, act_sqnorm, op, &d, &scale);
  check::nm(op, n, m, s.cols);

  const auto fn = nm::Dispatch<DualBlock>::pick(d, s.kind(), static_cast<int>(m));
  const int64_t esize = x.element_size();
  const nm::Tiling tiling(s.rows, s.cols, m, /*by_row=*/s.colscale != nullptr);
  std::vector<double> partial(static_cast<size_t>(tiling.tasks));
  const int ni = static_cast<int>(n), mi = static_cast<int>(m);
  int nan_found = 0;
  // Dynamic chunks of 16 blocks, as in nm_mask: threads that do run take the remaining work.
#pragma omp parallel for schedule(dynamic, 16) reduction(| : nan_found) if (s.numel() >= 32768)
  for (int64_t t = 0; t < tiling.tasks; ++t) {
    const nm::Tiling::Block blk = tiling.at(t);
    DualBlock::Args a;
    a.x = s.x + blk.start * esize;
    a.v = s.v + blk.start;
    a.keep = s.keep + blk.start;
    a.colscale = s.colscale ? s.colscale + blk.col : nullptr;
    a.len = blk.len;
    a.n = ni;
    a.m = mi;
    a.residual = &partial[t];
    nan_found |= fn(a);
  }
  return finish(partial, nan_found);
}

torch::Tensor dual_update_topk(const torch::Tensor& v, const torch::Tensor& keep,
                               const torch::Tensor& x,
                               const c10::optional<torch::Tensor>& act_sqnorm, int64_t keep_count,
                               bool per_row) {
  const char* op = kOp;
  Dt d;
  torch::Tensor scale;
  const State s = check_state(v, keep, x, act_sqnorm, op, &d, &scale);
  const int64_t count = per_row ? s.cols : s.numel();
  TORCH_CHECK(count < (int64_t{1} << 32), op, ": at most 2**32 - 1 elements per selection, got ",
              count);
  TORCH_CHECK(keep_count >= 0 && keep_count <= count, op, ": keep_count must be in [0, ", count,
              "], got ", keep_count);

  const int64_t parts = per_row ? s.rows : (s.numel() + topk::kBlock - 1) / topk::kBlock;
  std::vector<double> partial(static_cast<size_t>(parts));
  const int nan_found =
      d == Dt::F32   ? update_topk<Dt::F32>(s, keep_count, per_row, &partial)
      : d == Dt::F16 ? update_topk<Dt::F16>(s, keep_count, per_row, &partial)
                     : update_topk<Dt::BF16>(s, keep_count, per_row, &partial);
  return finish(partial, nan_found);
}

}  // namespace

torch::Tensor admm_dual_update_(const torch::Tensor& v, const torch::Tensor& keep,
                                const torch::Tensor& x,
                                const c10::optional<torch::Tensor>& act_sqnorm, int64_t n,
                                int64_t m, int64_t keep_count, bool per_row) {
  return m > 0 ? dual_update_nm(v, keep, x, act_sqnorm, n, m)
               : dual_update_topk(v, keep, x, act_sqnorm, keep_count, per_row);
}

}  // namespace pyprune_cpu
