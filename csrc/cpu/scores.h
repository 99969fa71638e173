// fp32 scores of fp32/fp16/bf16 elements, shared by the CPU mask kernels (nm_mask.cpp,
// topk_mask.cpp, admm.cpp) so that every kernel computes bitwise the same score as the reference,
// for the score kinds of ../score_kind.h:
//   GIVEN:     s = float(src)
//   MAGNITUDE: s = |float(src)|
//   WANDA:     s = |float(src)| * sqrt(act_sqnorm[col])
// The conversions are exact, fabs is exact, and the Wanda factor is the correctly rounded fp32
// sqrt taken once per column followed by one correctly rounded multiply, exactly what
// pyprune.reference.wanda_score computes.
#pragma once

#include "../score_kind.h"
#include "checks.h"

#include <torch/types.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pyprune_cpu {

using pyprune::ScoreKind;

#define PYPRUNE_ALWAYS_INLINE inline __attribute__((always_inline))

enum class Dt { F32, F16, BF16 };

// The Dt of a tensor whose dtype check::floats() admitted.
inline Dt dt_of(const torch::Tensor& t) {
  const auto st = t.scalar_type();
  return st == at::kFloat ? Dt::F32 : st == at::kHalf ? Dt::F16 : Dt::BF16;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE binary16 -> binary32, exact for every input (normals, subnormals, ±0, ±inf, NaN payloads).
// Selections are done with bit masks rather than ?: so the compiler never turns them into
// branches (it will not if-convert around a floating-point multiply), keeping the loop
// vectorisable.
inline float half_to_float(uint16_t h) {
  const uint32_t mag = static_cast<uint32_t>(h) & 0x7fffu;
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  // Normal numbers: move exponent+fraction into place and rebias 15 -> 127.
  uint32_t bits = (mag << 13) + (112u << 23);
  // Inf/NaN: the exponent must become 255, i.e. rebias once more.
  bits += (112u << 23) & (0u - static_cast<uint32_t>(mag >= 0x7c00u));
  // Zero and subnormals: value = fraction * 2^-24, computed exactly in fp32 (no denormals).
  const uint32_t sub =
      float_to_bits(static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-8f);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(mag < 0x0400u);
  bits = (sub & is_sub) | (bits & ~is_sub);
  return bits_to_float(bits | sign);
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

template <Dt D> struct Elem;
template <> struct Elem<Dt::F32> {
  using type = float;
  static inline float load(const float* p, int64_t i) { return p[i]; }
};
template <> struct Elem<Dt::F16> {
  using type = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }
};
template <> struct Elem<Dt::BF16> {
  using type = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
};

// The fp32 score of element e; colscale[e] = sqrt(act_sqnorm) of its column (WANDA only).
template <Dt D, int KIND>
PYPRUNE_ALWAYS_INLINE float score_at(const typename Elem<D>::type* __restrict x, int64_t e,
                                     const float* __restrict colscale) {
  float s = Elem<D>::load(x, e);
  if constexpr (KIND != ScoreKind::GIVEN) s = std::fabs(s);
  if constexpr (KIND == ScoreKind::WANDA) s = s * colscale[e];
  return s;
}

// The element type of a 2-D contiguous CPU source tensor; raises (naming `op` and the argument
// `name`) otherwise.
inline Dt source_dtype(const torch::Tensor& src, const char* op, const char* name = "src") {
  check::tensor(op, name, src, 2, check::floats());
  return dt_of(src);
}

// sqrt(act_sqnorm) per column (fp32 [cols]) for ScoreKind::WANDA; an undefined tensor otherwise.
inline torch::Tensor wanda_column_scale(const c10::optional<torch::Tensor>& act_sqnorm,
                                        int64_t cols, int64_t score_kind, const char* op) {
  TORCH_CHECK(score_kind >= ScoreKind::GIVEN && score_kind <= ScoreKind::WANDA, op,
              ": score_kind must be ", int(ScoreKind::GIVEN), " (GIVEN), ", int(ScoreKind::MAGNITUDE),
              " (MAGNITUDE) or ", int(ScoreKind::WANDA), " (WANDA), got ", score_kind);
  if (score_kind != ScoreKind::WANDA) return torch::Tensor();
  TORCH_CHECK(act_sqnorm.has_value() && act_sqnorm->defined(), op,
              ": score_kind WANDA needs act_sqnorm");
  const torch::Tensor& a = *act_sqnorm;
  TORCH_CHECK(a.device().is_cpu(), op, ": act_sqnorm must be a CPU tensor");
  TORCH_CHECK(a.scalar_type() == at::kFloat, op, ": act_sqnorm must be float32");
  TORCH_CHECK(a.dim() == 1 && a.size(0) == cols, op, ": act_sqnorm must be 1-D of length ", cols);
  const torch::Tensor ac = a.contiguous();
  torch::Tensor scale = torch::empty({cols}, ac.options());
  const float* ap = ac.data_ptr<float>();
  float* sp = scale.data_ptr<float>();
  for (int64_t c = 0; c < cols; ++c) sp[c] = std::sqrt(ap[c]);  // IEEE, correctly rounded
  return scale;
}

constexpr const char* kNanMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores";
constexpr const char* kNanWandaMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores (w/act_sqnorm produce NaN "
    "scores: NaN in w or act_sqnorm, a negative act_sqnorm, or inf * 0)";

inline const char* nan_message(int64_t score_kind) {
  return score_kind == ScoreKind::WANDA ? kNanWandaMessage : kNanMessage;
}

}  // namespace pyprune_cpu
