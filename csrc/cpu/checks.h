// Argument checks of the CPU ops in one message form, "<op>: <name> must be ..., got ...".
// The public Python functions validate first (pyprune/ops/_validate.py); these guard calls that reach
// the kernels another way (torch.ops.pyprune.*, a compiled graph).
#pragma once

#include <charconv>
#include <cmath>
#include <string>

#include <torch/types.h>

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

// A float as Python's repr writes it (-1.0, 0.5, nan), so C++ and Python errors read alike.
inline std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::string s(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  return s.find_first_of(".e") == std::string::npos ? s + ".0" : s;
}

// Every entry of an activation statistic (a sum of squares, e.g. act_sqnorm) is >= 0; the message
// is pyprune.ops._validate.sums_of_squares's. Any device: the kernels' callers on CPU and CUDA.
inline void sums_of_squares(const char* name, const torch::Tensor& value) {
  const torch::Tensor bad = (value >= 0).logical_not();
  if (!bad.any().item<bool>()) return;
  const int64_t column = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(false, name, " must be >= 0 (a sum of squares of activations); got ",
                    py_float(value[column].item<double>()), " at column ", column);
}

// Distinct positions in [0, size) of `dim_name`; the messages are pyprune.ops._validate.index_values's.
inline void index_values(const char* name, const torch::Tensor& value, int64_t size, const std::string& dim_name) {
  if (value.numel() == 0) return;
  const int64_t low = value.min().item<int64_t>(), high = value.max().item<int64_t>();
  TORCH_CHECK_VALUE(low >= 0 && high < size, name, " must hold positions in [0, ", size, ") of ", dim_name,
                    "; got values in [", low, ", ", high, "]");
  TORCH_CHECK_VALUE(std::get<0>(at::_unique(value)).numel() == value.numel(), name,
                    " must not repeat a position");
}

}  // namespace pyprune_cpu::check
