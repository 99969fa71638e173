// N:M selection shared by the CPU kernels that keep n of every m consecutive elements
// (nm_mask.cpp, admm.cpp): the rank of each element within its group, the cut of a tensor into
// blocks of whole groups, and the run-time choice of a block routine compiled per ISA.
//
// Element i of a group is kept iff
//     rank_i = #{j < i : s_j >= s_i} + #{j > i : s_j > s_i}  <  n,
// which is exactly the order a stable descending sort gives (pyprune.reference.nm_mask).
// m = 2, 4, 8 use the pairwise rank unrolled at compile time (vectorised across groups), any
// other m <= 32 a padded SIMD path (8, 16 or 32 lanes). On x86-64 a block routine is also
// compiled for AVX2 and AVX-512 (256-bit vectors) and picked at run time; a routine must perform
// the same IEEE operations in every variant, so results never depend on the variant chosen.
#pragma once

#include "scores.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pyprune_cpu {
namespace nm {

// Elements per block (a multiple of m is taken). Small enough to stay in L1 with the output,
// large enough to amortise the per-block work.
constexpr int kBlock = 2048;

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

// Keep bytes of the len / m groups of scores in buf into out. buf must hold kBlock + 32 floats:
// the padded path reads up to 32 past the last group, which are zeroed here first.
template <int MV, int VL>
PYPRUNE_ALWAYS_INLINE void rank_block(float* __restrict buf, uint8_t* __restrict out, int64_t len,
                                      int n, int m) {
  if constexpr (MV > 0) {
    rank_fixed<MV>(buf, out, len / MV, n);
  } else {
    for (int i = 0; i < 32; ++i) buf[len + i] = 0.0f;
    alignas(64) uint8_t keep[kBlock + 32];
    constexpr int MP = -MV;
    rank_padded<MP, (VL < MP ? VL : MP)>(buf, keep, len / m, n, m);
    std::memcpy(out, keep, static_cast<size_t>(len));
  }
}

// The blocks of a [rows, cols] tensor (cols % m == 0): whole groups, at most kBlock elements.
// With per-column scales (Wanda) a block never crosses a row, so its first column is known;
// otherwise rows do not matter and the tensor is cut as one long row.
struct Tiling {
  struct Block {
    int64_t start;  // first element (flat index)
    int64_t col;    // its column when blocks follow rows, else 0
    int64_t len;    // elements, a multiple of m
  };
  int64_t block, seg_len, per_seg, tasks;

  Tiling(int64_t rows, int64_t cols, int64_t m, bool by_row)
      : block((kBlock / m) * m),
        seg_len(by_row ? cols : rows * cols),
        per_seg((seg_len + block - 1) / block),
        tasks((by_row ? rows : 1) * per_seg) {}

  Block at(int64_t t) const {
    const int64_t seg = t / per_seg;
    const int64_t off = (t - seg * per_seg) * block;
    return {seg * seg_len + off, off, std::min(block, seg_len - off)};
  }
};

enum class Isa { Default, Avx2, Avx512 };

inline Isa detect_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2")) return Isa::Avx2;
#endif
  return Isa::Default;
}

inline Isa cached_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

// A block routine K: K::Args, and K::run<D, KIND, MV, VL>(args) -> nonzero on a NaN score, always
// inlined, for the source dtype D, score kind KIND (a ScoreKind), MV > 0 the fixed
// m = MV or MV < 0 any m <= -MV (padded), and VL fp32 vector lanes.
template <class K, Dt D, int KIND, int MV>
int run_default(const typename K::Args& a) { return K::template run<D, KIND, MV, 4>(a); }

#if defined(__x86_64__) && defined(__GNUC__)
#define PYPRUNE_NM_X86_DISPATCH 1
template <class K, Dt D, int KIND, int MV>
__attribute__((target("avx2"))) int run_avx2(const typename K::Args& a) {
  return K::template run<D, KIND, MV, 8>(a);
}
template <class K, Dt D, int KIND, int MV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))
int run_avx512(const typename K::Args& a) {
  return K::template run<D, KIND, MV, 8>(a);  // 256-bit vectors: 512-bit ones are slower here
}
#endif

// The variant of K for this CPU, dtype, score kind and m.
template <class K>
struct Dispatch {
  using Fn = int (*)(const typename K::Args&);

  template <Dt D, int KIND, int MV>
  static Fn for_isa(Isa isa) {
#ifdef PYPRUNE_NM_X86_DISPATCH
    if (isa == Isa::Avx512) return &run_avx512<K, D, KIND, MV>;
    if (isa == Isa::Avx2) return &run_avx2<K, D, KIND, MV>;
#endif
    (void)isa;
    return &run_default<K, D, KIND, MV>;
  }

  template <Dt D, int KIND>
  static Fn for_m(Isa isa, int m) {
    switch (m) {
      case 2: return for_isa<D, KIND, 2>(isa);
      case 4: return for_isa<D, KIND, 4>(isa);
      case 8: return for_isa<D, KIND, 8>(isa);
      default:
        if (m <= 8) return for_isa<D, KIND, -8>(isa);
        if (m <= 16) return for_isa<D, KIND, -16>(isa);
        return for_isa<D, KIND, -32>(isa);
    }
  }

  // K::kMinKind: the lowest score kind K supports (kinds below it are not compiled).
  template <Dt D>
  static Fn for_kind(Isa isa, int kind, int m) {
    if constexpr (K::kMinKind == ScoreKind::GIVEN) {
      if (kind == ScoreKind::GIVEN) return for_m<D, ScoreKind::GIVEN>(isa, m);
    }
    return kind == ScoreKind::MAGNITUDE ? for_m<D, ScoreKind::MAGNITUDE>(isa, m)
                                        : for_m<D, ScoreKind::WANDA>(isa, m);
  }

  static Fn pick(Dt d, int kind, int m) {
    const Isa isa = cached_isa();
    switch (d) {
      case Dt::F32: return for_kind<Dt::F32>(isa, kind, m);
      case Dt::F16: return for_kind<Dt::F16>(isa, kind, m);
      default: return for_kind<Dt::BF16>(isa, kind, m);
    }
  }
};

}  // namespace nm
}  // namespace pyprune_cpu
