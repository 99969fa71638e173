// N:M pruning masks on the CPU (pyprune._C).
//
// nm_mask(src, act_sqnorm, n, m, score_kind) -> bool mask [rows, cols]
//
// Every group of m consecutive elements of a row keeps exactly its n highest scores; among equal
// scores the lower index wins. Element i of a group is kept iff
//     rank_i = #{j < i : s_j >= s_i} + #{j > i : s_j > s_i}  <  n,
// which is exactly the order a stable descending sort gives (pyprune.reference.nm_mask).
//
// Scores are fp32 and bitwise equal to the reference:
//   score_kind 0: s = float(src)
//   score_kind 1: s = |float(src)|
//   score_kind 2: s = |float(src)| * sqrt(act_sqnorm[col])      (Wanda)
//
// Layout of the work: the input is cut into blocks of whole groups (groups never cross a row
// since cols % m == 0; for score_kind 2 blocks never cross a row either, so the column of every
// element is known). Each block is converted to fp32 scores in a small stack buffer (one
// contiguous, vectorised pass that also detects NaN), then ranked: m = 2, 4, 8 use the pairwise
// rank unrolled at compile time (vectorised across groups), any other m <= 32 a padded SIMD path
// (8, 16 or 32 lanes). Blocks are distributed over OpenMP threads. On x86-64 the block routine
// is also compiled for AVX2 and AVX-512 (256-bit vectors) and picked at run time; every variant
// performs the same IEEE operations (exact conversion, fabs, one correctly rounded multiply; the
// sqrt is computed once per column), so results never depend on the variant chosen.

#include "ops.h"
#include "scores.h"

#include <torch/extension.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pyprune_cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Block kernel.

// Elements per block (a multiple of m is taken below). Small enough to stay in L1 with the
// output, large enough to amortise the per-block work.
constexpr int kBlock = 2048;

struct BlockArgs {
  const void* src;        // first element of the block
  const float* colscale;  // sqrt(act_sqnorm) at the block's first column (score_kind 2 only)
  uint8_t* out;           // first output byte of the block
  int64_t len;            // elements in the block, a multiple of m, <= kBlock
  int n;
  int m;
};

// Returns nonzero when the block contains a NaN score.
using BlockFn = int (*)(const BlockArgs&);

template <Dt D, int KIND>
PYPRUNE_ALWAYS_INLINE int scores_pass(const BlockArgs& a, float* __restrict buf) {
  using T = typename Elem<D>::type;
  const T* __restrict x = static_cast<const T*>(a.src);
  const float* __restrict cs = a.colscale;
  const int64_t len = a.len;
  int nan = 0;
  for (int64_t e = 0; e < len; ++e) {
    const float s = score_at<D, KIND>(x, e, cs);
    buf[e] = s;
    nan |= (s != s);
  }
  return nan;
}

// Fixed m: the pairwise rank unrolled at compile time.
template <int M>
PYPRUNE_ALWAYS_INLINE void rank_fixed(const float* __restrict buf, uint8_t* __restrict out,
                                      int64_t groups, int n) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* s = buf + g * M;
    uint8_t* o = out + g * M;
    float v[M];
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i) v[i] = s[i];
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i) {
      int r = 0;
#pragma GCC unroll 32
      for (int j = 0; j < M; ++j) {
        if (j < i) r += (v[j] >= v[i]);
        else if (j > i) r += (v[j] > v[i]);
      }
      o[i] = static_cast<uint8_t>(r < n);
    }
  }
}

// Any m <= MP (MP = 8, 16 or 32), written with GCC/Clang vector extensions of VL fp32 lanes
// (VL = the ISA's native width: 4 for SSE2/NEON, 8 for AVX2, 16 for AVX-512). A group is loaded
// as MP lanes (lanes >= m hold whatever follows it and are ignored), and the ranks of all lanes
// are accumulated at once, one broadcast element j < m at a time:
//     r[i] += (j < i) ? s_j >= s_i : s_j > s_i.
// For the vector holding lanes [b, b + VL) the index test is the same for every lane when j < b
// (>=) or j >= b + VL (>), so only VL values of j need both comparisons.
// The MP keep bytes are stored at the group's offset in a block-local buffer; the extra bytes are
// overwritten by the next group, so the buffer ends up holding exactly the block's mask.
template <int VL>
struct Vec {
  typedef float f __attribute__((vector_size(4 * VL)));
  typedef int32_t i __attribute__((vector_size(4 * VL)));
  typedef uint8_t u8 __attribute__((vector_size(VL)));
};

template <int MP, int VL>
PYPRUNE_ALWAYS_INLINE void rank_padded(const float* __restrict buf, uint8_t* __restrict keepbuf,
                                       int64_t groups, int n, int m) {
  using vf = typename Vec<VL>::f;
  using vi = typename Vec<VL>::i;
  using vu8 = typename Vec<VL>::u8;
  constexpr int NV = MP / VL;
  static_assert(NV * VL == MP, "MP must be a multiple of VL");
  vi iota;
  for (int l = 0; l < VL; ++l) iota[l] = l;
  const vi nv = vi{} + n;
  for (int64_t g = 0; g < groups; ++g) {
    const float* s = buf + g * m;
    uint8_t* o = keepbuf + g * m;
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) {
      const int b = k * VL;
      if (b >= m) break;
      vf v;
      std::memcpy(&v, s + b, sizeof v);
      vi r = vi{};
      const int lo = b < m ? b : m;
      const int hi = b + VL < m ? b + VL : m;
      for (int j = 0; j < lo; ++j) r -= (vf{} + s[j]) >= v;  // j below every lane
      for (int j = lo; j < hi; ++j) {                          // j among the lanes
        const vf sj = vf{} + s[j];
        r -= (sj > v) | ((sj == v) & (iota > (vi{} + (j - b))));
      }
      for (int j = hi; j < m; ++j) r -= (vf{} + s[j]) > v;  // j above every lane
      // Comparisons give -1 (true) / 0 per lane, so r holds the rank.
      const vu8 keep = __builtin_convertvector((r < nv) & 1, vu8);
      std::memcpy(o + b, &keep, sizeof keep);
    }
  }
}

// MV > 0: the fixed m = MV; MV < 0: any m <= -MV, padded. VL: native vector lanes.
template <Dt D, int KIND, int MV, int VL>
PYPRUNE_ALWAYS_INLINE int block_body(const BlockArgs& a) {
  // kBlock scores, plus room for the padded read of the last group.
  alignas(64) float buf[kBlock + 32];
  const int nan = scores_pass<D, KIND>(a, buf);
  if constexpr (MV > 0) {
    rank_fixed<MV>(buf, a.out, a.len / MV, a.n);
  } else {
    // The last group's padded load reads up to 32 floats past the scores: make them defined.
    for (int i = 0; i < 32; ++i) buf[a.len + i] = 0.0f;
    alignas(64) uint8_t keep[kBlock + 32];
    constexpr int MP = -MV;
    rank_padded<MP, (VL < MP ? VL : MP)>(buf, keep, a.len / a.m, a.n, a.m);
    std::memcpy(a.out, keep, static_cast<size_t>(a.len));
  }
  return nan;
}

template <Dt D, int KIND, int MV>
int block_default(const BlockArgs& a) { return block_body<D, KIND, MV, 4>(a); }

#if defined(__x86_64__) && defined(__GNUC__)
#define PYPRUNE_X86_DISPATCH 1
template <Dt D, int KIND, int MV>
__attribute__((target("avx2"))) int block_avx2(const BlockArgs& a) {
  return block_body<D, KIND, MV, 8>(a);
}
template <Dt D, int KIND, int MV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))
int block_avx512(const BlockArgs& a) {
  return block_body<D, KIND, MV, 8>(a);  // 256-bit vectors: 512-bit ones are slower here
}
#endif

enum class Isa { Default, Avx2, Avx512 };

Isa detect_isa() {
#ifdef PYPRUNE_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2")) return Isa::Avx2;
#endif
  return Isa::Default;
}

template <Dt D, int KIND, int MV>
BlockFn pick_isa(Isa isa) {
#ifdef PYPRUNE_X86_DISPATCH
  if (isa == Isa::Avx512) return &block_avx512<D, KIND, MV>;
  if (isa == Isa::Avx2) return &block_avx2<D, KIND, MV>;
#endif
  (void)isa;
  return &block_default<D, KIND, MV>;
}

template <Dt D, int KIND>
BlockFn pick_m(Isa isa, int m) {
  switch (m) {
    case 2: return pick_isa<D, KIND, 2>(isa);
    case 4: return pick_isa<D, KIND, 4>(isa);
    case 8: return pick_isa<D, KIND, 8>(isa);
    default:
      if (m <= 8) return pick_isa<D, KIND, -8>(isa);
      if (m <= 16) return pick_isa<D, KIND, -16>(isa);
      return pick_isa<D, KIND, -32>(isa);
  }
}

template <Dt D>
BlockFn pick_kind(Isa isa, int kind, int m) {
  switch (kind) {
    case 0: return pick_m<D, 0>(isa, m);
    case 1: return pick_m<D, 1>(isa, m);
    default: return pick_m<D, 2>(isa, m);
  }
}

BlockFn pick(Isa isa, Dt d, int kind, int m) {
  switch (d) {
    case Dt::F32: return pick_kind<Dt::F32>(isa, kind, m);
    case Dt::F16: return pick_kind<Dt::F16>(isa, kind, m);
    default: return pick_kind<Dt::BF16>(isa, kind, m);
  }
}

Isa cached_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

}  // namespace

torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                      int64_t n, int64_t m, int64_t score_kind) {
  const Dt d = source_dtype(src, "nm_mask");
  TORCH_CHECK(m >= 2 && m <= 32, "nm_mask: m must be in [2, 32], got ", m);
  TORCH_CHECK(n >= 1 && n < m, "nm_mask: n must be in [1, m), got n=", n, ", m=", m);
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  TORCH_CHECK(cols % m == 0, "nm_mask: cols (", cols, ") must be a multiple of m (", m, ")");
  const torch::Tensor scale = wanda_column_scale(act_sqnorm, cols, score_kind, "nm_mask");

  torch::Tensor out = torch::empty({rows, cols}, src.options().dtype(torch::kBool));
  if (rows == 0 || cols == 0) return out;

  const BlockFn fn = pick(cached_isa(), d, static_cast<int>(score_kind), static_cast<int>(m));
  const int64_t esize = src.element_size();
  const char* sbase = static_cast<const char*>(src.data_ptr());
  uint8_t* obase = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const float* cbase = score_kind == 2 ? scale.data_ptr<float>() : nullptr;

  // Blocks: whole groups, never crossing a row. With score_kind 0/1 rows do not matter, so the
  // tensor is one long row; with score_kind 2 every row is cut separately.
  const int64_t block = (kBlock / m) * m;
  const int64_t seg_len = score_kind == 2 ? cols : rows * cols;  // elements of a "row"
  const int64_t segs = score_kind == 2 ? rows : 1;
  const int64_t per_seg = (seg_len + block - 1) / block;
  const int64_t tasks = segs * per_seg;
  const int ni = static_cast<int>(n), mi = static_cast<int>(m);
  int nan_found = 0;

  // Dynamic chunks of 16 blocks (~32K elements): even when another process holds a core, the
  // threads that do run take the remaining work instead of waiting at the barrier.
#pragma omp parallel for schedule(dynamic, 16) reduction(| : nan_found) if (rows * cols >= 32768)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t seg = t / per_seg;
    const int64_t off = (t - seg * per_seg) * block;
    const int64_t start = seg * seg_len + off;
    BlockArgs a;
    a.src = sbase + start * esize;
    a.colscale = cbase ? cbase + off : nullptr;
    a.out = obase + start;
    a.len = std::min(block, seg_len - off);
    a.n = ni;
    a.m = mi;
    nan_found |= fn(a);
  }

  TORCH_CHECK_VALUE(!nan_found, nan_message(score_kind));
  return out;
}

int64_t openmp_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace pyprune_cpu
