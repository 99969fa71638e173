// Argument checks of the CPU ops in one message form, "<op>: <name> must be ..., got ...".
// The Python ops validate first (pyprune/ops/_validate.py); these guard direct calls to pyprune._C.
#pragma once

#include <string>

#include <torch/extension.h>

namespace pyprune_cpu::check {

inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kBool: return "bool";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    default: return c10::toString(t);
  }
}

// float32, float16 and bfloat16: the dtypes of weights, scores and activations.
inline c10::ArrayRef<at::ScalarType> floats() {
  static constexpr at::ScalarType kFloats[] = {at::kFloat, at::kHalf, at::kBFloat16};
  return kFloats;
}

// `t` is a contiguous CPU tensor, of `dim` dimensions unless dim < 0, of one of `dtypes` unless empty.
inline void tensor(const char* op, const char* name, const torch::Tensor& t, int64_t dim = -1,
                   c10::ArrayRef<at::ScalarType> dtypes = {}) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(dim < 0 || t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  if (dtypes.size() == 0) return;
  std::string allowed;
  for (const auto d : dtypes) {
    if (t.scalar_type() == d) return;
    allowed += (allowed.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  TORCH_CHECK(false, op, ": ", name, " dtype must be one of ", allowed, ", got ", dtype_name(t.scalar_type()));
}

inline void same_shape(const char* op, const char* name, const torch::Tensor& t, const char* like_name,
                       const torch::Tensor& like) {
  TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have the shape of ", like_name, " ",
              like.sizes(), ", got ", t.sizes());
}

// An N:M pattern over rows of `cols` columns: 2 <= m <= 32, 1 <= n < m, m divides cols.
inline void nm(const char* op, int64_t n, int64_t m, int64_t cols) {
  TORCH_CHECK(m >= 2 && m <= 32, op, ": m must be in [2, 32], got ", m);
  TORCH_CHECK(n >= 1 && n < m, op, ": n must be in [1, m), got n=", n, ", m=", m);
  TORCH_CHECK(cols % m == 0, op, ": cols (", cols, ") must be a multiple of m (", m, ")");
}

template <typename T>
inline void at_least(const char* op, const char* name, T value, T low) {
  TORCH_CHECK(value >= low, op, ": ", name, " must be >= ", low, ", got ", value);
}

// A dimension index of a 2-D tensor.
inline void dim01(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(value == 0 || value == 1, op, ": ", name, " must be 0 or 1, got ", value);
}

}  // namespace pyprune_cpu::check
