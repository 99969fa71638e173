// pyprune._C: the CPU kernels bound in csrc/cpu/bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <c10/util/Optional.h>

namespace pyprune_cpu {

// nm_mask.cpp
torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                      int64_t n, int64_t m, int64_t score_kind);
int64_t openmp_threads();

// nm_linear.cpp
torch::Tensor nm_decompress(const torch::Tensor& values, const torch::Tensor& meta, int64_t n,
                            int64_t m);
torch::Tensor nm_linear_gemv(const torch::Tensor& x, const torch::Tensor& values,
                             const torch::Tensor& meta, int64_t n, int64_t m,
                             const c10::optional<torch::Tensor>& bias);

}  // namespace pyprune_cpu
