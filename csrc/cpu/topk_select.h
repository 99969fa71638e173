// Exact top-k selection shared by the CPU kernels that keep the k highest scores of each row or
// of a whole tensor (topk_mask.cpp, admm.cpp). Keys, ties and the radix select are described in
// topk_mask.cpp; the functions declared here are defined there.
#pragma once

#include "parallel.h"
#include "scores.h"

#include <algorithm>
#include <cstdint>

namespace pyprune_cpu {
namespace topk {

// Elements per block of the per-tensor passes: 16 KB of keys, which stay in L1.
constexpr int64_t kBlock = 4096;
// First radix digit: the top 11 key bits.
constexpr int kTopBits = 11;
constexpr int kTopShift = 32 - kTopBits;
constexpr int kTopBins = 1 << kTopBits;

// Order keys of `len` consecutive elements of one row starting at `src`; colscale points at the
// sqrt(act_sqnorm) of their first column (ScoreKind::WANDA). Returns nonzero on a NaN score.
using KeysFn = int (*)(const void* src, const float* colscale, int64_t len, uint32_t* keys);

// The keys function of source dtype d and score kind (GIVEN, MAGNITUDE or WANDA; scores.h).
KeysFn keys_for(Dt d, int64_t kind);

// uint32 scratch that select_row needs for rows of `len` keys.
inline int64_t row_scratch_size(int64_t len) { return len + kTopBins; }

// The set-up of a parallel pass that selects within each row of a [rows, cols] tensor: the
// threads, the rows per scheduling chunk (about 64K elements) and each thread's scratch (the
// row's keys, then select_row's scratch).
struct RowPass {
  RowPass(int64_t rows, int64_t cols)
      : threads(rows * cols >= kParallelMin ? max_threads() : 1),
        chunk(std::max<int64_t>(1, 65536 / cols)),
        scratch(threads, cols + row_scratch_size(cols)) {}
  int threads;
  int64_t chunk;
  PerThreadScratch<uint32_t> scratch;
};

// Keep bytes of the `keep` highest of `len` keys (0 <= keep <= len; lower index first among
// equal keys) into out.
void select_row(const uint32_t* keys, int64_t len, int64_t keep, uint32_t* scratch, uint8_t* out);

// A whole [rows, cols] tensor as a source of keys, recomputed from the data on every pass.
struct Source {
  KeysFn keys_fn;
  const char* data;
  int64_t esize;
  const float* colscale;  // ScoreKind::WANDA only
  int64_t cols;
  int64_t numel;

  int64_t blocks() const { return (numel + kBlock - 1) / kBlock; }
  int64_t block_len(int64_t b) const { return std::min(kBlock, numel - b * kBlock); }

  // Keys of elements [start, start + len) of the flattened tensor. Only the Wanda score
  // depends on the column, so only then is the range cut at row ends.
  int keys(int64_t start, int64_t len, uint32_t* out) const {
    if (!colscale) return keys_fn(data + start * esize, nullptr, len, out);
    int nan = 0;
    for (int64_t done = 0; done < len;) {
      const int64_t e = start + done;
      const int64_t col = e % cols;
      const int64_t seg = std::min(len - done, cols - col);
      nan |= keys_fn(data + e * esize, colscale + col, seg, out + done);
      done += seg;
    }
    return nan;
  }
};

// Keep bytes of the `keep` highest keys of the whole tensor (0 <= keep <= numel) into out, all
// threads on every pass. Returns nonzero on a NaN score (then out is not written).
int topk_tensor(const Source& src, int64_t keep, uint8_t* out);

}  // namespace topk
}  // namespace pyprune_cpu
