// Exact top-k pruning masks on the CPU (pyprune._C).
//
// topk_mask(src, act_sqnorm, keep, per_row, score_kind) -> bool mask [rows, cols]
//
// Keeps exactly `keep` highest fp32 scores of every row (per_row) or of the whole tensor; among
// equal scores the lower (row-major) index wins, which is the order a stable descending sort
// gives (pyprune.reference.keep_top). Scores are those of nm_mask (scores.h), bit for bit.
//
// Selection without sorting. Every score is mapped to a uint32 key whose unsigned order is the
// float order (-0.0 is first turned into +0.0 so that the two tie, as they do in torch). With T
// the keep-th largest key, the kept set is
//     every key > T,  plus the first `take` keys == T in index order,
// where take = keep - #{key > T}. T is found by radix select:
//   per row    one thread per row; the row's keys go to a thread-local buffer, a histogram of
//              their top 11 bits finds the bucket that holds the keep-th key, the keys of that
//              bucket (a few percent of a row of weights) are compacted and std::nth_element
//              picks T among them.
//   per tensor all threads on every pass; three histogram passes over key bits 31-21, 20-10 and
//              9-0, each counting only the keys in the bucket chosen by the pass before, fix T
//              exactly. Keys are recomputed from the input on each pass rather than stored (no
//              buffer the size of the tensor). When some keys equal to T must be dropped, a
//              counting pass gives every block how many of them lie before it.
// The row selection and the per-tensor select are declared in topk_select.h: admm.cpp runs them
// on the fp32 v of SAFE's dual update.

#include "ops.h"
#include "scores.h"
#include "topk_select.h"

#include <torch/types.h>

#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyprune_cpu {
namespace topk {
namespace {

// `take` meaning "every key equal to T" (no need to count them).
constexpr int64_t kAllEqual = std::numeric_limits<int64_t>::max();

// fp32 -> uint32 with a < b (as floats, NaN excluded) iff key(a) < key(b) (as integers):
// negative floats get all their bits flipped, the others only the sign bit.
PYPRUNE_ALWAYS_INLINE uint32_t order_key(float s) {
  const uint32_t u = float_to_bits(s + 0.0f);  // -0.0 + 0.0 = +0.0: signed zeros tie
  const uint32_t flip = static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u;
  return u ^ flip;
}

template <Dt D, int KIND>
int keys_of(const void* src, const float* colscale, int64_t len, uint32_t* __restrict keys) {
  using T = typename Elem<D>::type;
  const T* __restrict x = static_cast<const T*>(src);
  int nan = 0;
  for (int64_t e = 0; e < len; ++e) {
    const float s = score_at<D, KIND>(x, e, colscale);
    keys[e] = order_key(s);
    nan |= (s != s);
  }
  return nan;
}

template <Dt D>
KeysFn keys_for_kind(int64_t kind) {
  switch (kind) {
    case ScoreKind::GIVEN: return &keys_of<D, ScoreKind::GIVEN>;
    case ScoreKind::MAGNITUDE: return &keys_of<D, ScoreKind::MAGNITUDE>;
    default: return &keys_of<D, ScoreKind::WANDA>;
  }
}

// The bucket holding the k-th largest key (1 <= k <= total count), found from the top;
// *above receives the number of keys in the buckets above it.
template <typename Count>
uint32_t bucket_of_kth(const Count* hist, int bins, int64_t k, int64_t* above) {
  int64_t count = 0;
  int d = bins - 1;
  while (count + static_cast<int64_t>(hist[d]) < k) count += hist[d--];
  *above = count;
  return static_cast<uint32_t>(d);
}

// The kept set of a row or tensor: keys > threshold and the first take_equal keys ==
// threshold in index order (all of them when take_equal is kAllEqual).
struct Boundary {
  uint32_t threshold;
  int64_t take_equal;
};

// Mask bytes of `len` keys for the boundary (threshold, take_equal), where take_equal counts
// the keys equal to the threshold that are kept within these `len` keys.
void write_mask(const uint32_t* __restrict keys, int64_t len, uint32_t threshold,
                int64_t take_equal, uint8_t* __restrict out) {
  if (take_equal >= len) {  // every equal key is kept
    for (int64_t e = 0; e < len; ++e) out[e] = keys[e] >= threshold;
    return;
  }
  for (int64_t e = 0; e < len; ++e) out[e] = keys[e] > threshold;
  for (int64_t e = 0; e < len && take_equal > 0; ++e) {
    if (keys[e] == threshold) {
      out[e] = 1;
      --take_equal;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per row.

// The boundary of the k highest of `len` keys, 1 <= k < len. hist: kTopBins scratch counts,
// candidates: len scratch keys.
Boundary select_in_row(const uint32_t* __restrict keys, int64_t len, int64_t k,
                       uint32_t* __restrict hist, uint32_t* __restrict candidates) {
  std::memset(hist, 0, kTopBins * sizeof *hist);
  for (int64_t e = 0; e < len; ++e) ++hist[keys[e] >> kTopShift];
  int64_t above;
  const uint32_t bucket = bucket_of_kth(hist, kTopBins, k, &above);
  // Branch-free compaction of the bucket's keys (a write for every key, kept or not).
  int64_t count = 0;
  for (int64_t e = 0; e < len; ++e) {
    candidates[count] = keys[e];
    count += (keys[e] >> kTopShift) == bucket;
  }
  const int64_t rank = k - above;  // T is the rank-th largest candidate, 1 <= rank <= count
  std::nth_element(candidates, candidates + (rank - 1), candidates + count,
                   std::greater<uint32_t>());
  const uint32_t threshold = candidates[rank - 1];
  int64_t greater = 0, equal = 0;
  for (int64_t i = 0; i < count; ++i) {
    greater += candidates[i] > threshold;
    equal += candidates[i] == threshold;
  }
  const int64_t take = rank - greater;
  return {threshold, take == equal ? kAllEqual : take};
}

// ---------------------------------------------------------------------------------------------
// Per tensor.

// hist[d] = number of keys with (key & prefix_mask) == prefix and digit d, the digit being the
// `bins` (a power of two) values of the key bits from `shift` up. Returns nonzero on NaN.
int tensor_histogram(const Source& src, uint32_t prefix, uint32_t prefix_mask, int shift,
                     int bins, int64_t* hist) {
  std::fill(hist, hist + bins, 0);
  const int threads = src.numel >= kParallelMin ? max_threads() : 1;
  const uint32_t digit_mask = static_cast<uint32_t>(bins - 1);
  int nan_found = 0;
#pragma omp parallel num_threads(threads) reduction(| : nan_found)
  {
    alignas(64) uint32_t keys[kBlock];
    alignas(64) uint32_t local[kTopBins] = {};  // per-thread counts, merged below
#pragma omp for schedule(dynamic, 8) nowait
    for (int64_t b = 0; b < src.blocks(); ++b) {
      const int64_t len = src.block_len(b);
      nan_found |= src.keys(b * kBlock, len, keys);
      for (int64_t e = 0; e < len; ++e)
        local[(keys[e] >> shift) & digit_mask] += (keys[e] & prefix_mask) == prefix;
    }
#pragma omp critical(pyprune_topk_histogram)
    for (int d = 0; d < bins; ++d) hist[d] += local[d];
  }
  return nan_found;
}

// The boundary of the k highest keys of the tensor, 1 <= k < numel, given the histogram of the
// top digit (the first pass, which the caller has already made).
Boundary select_in_tensor(const Source& src, int64_t k, const int64_t* top_hist) {
  int64_t above;
  uint32_t prefix = bucket_of_kth(top_hist, kTopBins, k, &above) << kTopShift;
  uint32_t prefix_mask = ~0u << kTopShift;
  k -= above;
  int64_t equal = 0;
  int64_t hist[kTopBins];
  struct Digit { int shift, bits; };
  for (const Digit digit : {Digit{10, 11}, Digit{0, 10}}) {  // key bits 20-10, then 9-0
    const int bins = 1 << digit.bits;
    tensor_histogram(src, prefix, prefix_mask, digit.shift, bins, hist);
    const uint32_t bucket = bucket_of_kth(hist, bins, k, &above);
    k -= above;
    prefix |= bucket << digit.shift;
    prefix_mask |= static_cast<uint32_t>(bins - 1) << digit.shift;
    equal = hist[bucket];
  }
  return {prefix, k == equal ? kAllEqual : k};
}

void tensor_write_mask(const Source& src, const Boundary& boundary, uint8_t* out) {
  const int64_t blocks = src.blocks();
  const int threads = src.numel >= kParallelMin ? max_threads() : 1;
  const uint32_t threshold = boundary.threshold;
  // take[b]: keys equal to the threshold kept in block b.
  std::vector<int64_t> take(static_cast<size_t>(blocks), kAllEqual);
  if (boundary.take_equal != kAllEqual) {
#pragma omp parallel num_threads(threads)
    {
      alignas(64) uint32_t keys[kBlock];
#pragma omp for schedule(dynamic, 8)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t len = src.block_len(b);
        src.keys(b * kBlock, len, keys);
        int64_t equal = 0;
        for (int64_t e = 0; e < len; ++e) equal += keys[e] == threshold;
        take[b] = equal;
      }
    }
    int64_t remaining = boundary.take_equal;  // handed out to the blocks in index order
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t here = std::min(take[b], remaining);
      remaining -= here;
      take[b] = here == take[b] ? kAllEqual : here;
    }
  }
#pragma omp parallel num_threads(threads)
  {
    alignas(64) uint32_t keys[kBlock];
#pragma omp for schedule(dynamic, 8)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t len = src.block_len(b);
      src.keys(b * kBlock, len, keys);
      write_mask(keys, len, threshold, take[b], out + b * kBlock);
    }
  }
}

}  // namespace

KeysFn keys_for(Dt d, int64_t kind) {
  switch (d) {
    case Dt::F32: return keys_for_kind<Dt::F32>(kind);
    case Dt::F16: return keys_for_kind<Dt::F16>(kind);
    default: return keys_for_kind<Dt::BF16>(kind);
  }
}

void select_row(const uint32_t* keys, int64_t len, int64_t keep, uint32_t* scratch, uint8_t* out) {
  if (keep == 0 || keep == len) {
    std::memset(out, keep == len, static_cast<size_t>(len));
    return;
  }
  const Boundary b = select_in_row(keys, len, keep, /*hist=*/scratch + len, /*candidates=*/scratch);
  write_mask(keys, len, b.threshold, b.take_equal, out);
}

int topk_tensor(const Source& src, int64_t keep, uint8_t* out) {
  int64_t top_hist[kTopBins];
  // The first pass also finds NaN, so it runs even when keep is 0 or everything.
  if (tensor_histogram(src, 0, 0, kTopShift, kTopBins, top_hist)) return 1;
  if (keep == 0 || keep == src.numel) {
    std::memset(out, keep != 0, static_cast<size_t>(src.numel));
    return 0;
  }
  tensor_write_mask(src, select_in_tensor(src, keep, top_hist), out);
  return 0;
}

}  // namespace topk

namespace {

int topk_rows(topk::KeysFn keys_fn, const char* src, int64_t esize, const float* colscale,
              int64_t rows, int64_t cols, int64_t keep, uint8_t* out) {
  topk::RowPass pass(rows, cols);
  const int64_t chunk = pass.chunk;
  int nan_found = 0;
#pragma omp parallel num_threads(pass.threads) reduction(| : nan_found)
  {
    uint32_t* keys = pass.scratch.mine();
#pragma omp for schedule(dynamic, chunk)
    for (int64_t r = 0; r < rows; ++r) {
      // A row with NaN is selected too (by the NaN's key); the call then raises.
      nan_found |= keys_fn(src + r * cols * esize, colscale, cols, keys);
      topk::select_row(keys, cols, keep, keys + cols, out + r * cols);
    }
  }
  return nan_found;
}

}  // namespace

torch::Tensor topk_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                        int64_t keep, bool per_row, int64_t score_kind) {
  const Dt d = source_dtype(src, "topk_mask");
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  const int64_t count = per_row ? cols : rows * cols;
  TORCH_CHECK(count < (int64_t{1} << 32), "topk_mask: at most 2**32 - 1 elements per selection, got ",
              count);
  TORCH_CHECK(keep >= 0 && keep <= count, "topk_mask: keep must be in [0, ", count, "], got ",
              keep);
  const torch::Tensor scale = wanda_column_scale(act_sqnorm, cols, score_kind, "topk_mask");

  torch::Tensor out = torch::empty({rows, cols}, src.options().dtype(torch::kBool));
  if (rows == 0 || cols == 0) return out;

  const topk::KeysFn keys_fn = topk::keys_for(d, score_kind);
  const char* data = static_cast<const char*>(src.data_ptr());
  const float* colscale = scale.defined() ? scale.data_ptr<float>() : nullptr;
  uint8_t* obase = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const int nan_found =
      per_row ? topk_rows(keys_fn, data, src.element_size(), colscale, rows, cols, keep, obase)
              : topk::topk_tensor({keys_fn, data, src.element_size(), colscale, cols, rows * cols},
                                  keep, obase);
  TORCH_CHECK_VALUE(!nan_found, nan_message(score_kind));
  return out;
}

}  // namespace pyprune_cpu
