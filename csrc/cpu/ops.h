// pyprune._C: the CPU kernels. csrc/cpu/library.cpp registers them under the pyprune ops' schemas,
// each behind the op's own argument form (any leading dims, non-contiguous reads) where a kernel
// takes plain 2-D contiguous tensors.
//
// The kernels include <torch/types.h> (tensors and factories), not <torch/extension.h>: that one
// adds the whole C++ frontend and Python's headers, 33 s more per file to parse on a Zen 3 EPYC (a
// build is part of every install and CI run); only library.cpp, which binds helpers to Python, does.
#pragma once

#include <torch/types.h>

#include <c10/util/Optional.h>

#include <string>
#include <vector>

namespace pyprune_cpu {

// nm_mask.cpp
torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                      int64_t n, int64_t m, int64_t score_kind);
int64_t openmp_threads();

// topk_mask.cpp
torch::Tensor topk_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                        int64_t keep, bool per_row, int64_t score_kind);

// moreau.cpp
void moreau_step_(const torch::Tensor& delta, const torch::Tensor& grad, const torch::Tensor& weight,
                 const c10::optional<torch::Tensor>& perturbed, double decay, double step_size,
                 double threshold, int64_t group_dim, double noise_ratio, int64_t seed);
void moreau_perturb_(const torch::Tensor& perturbed, const torch::Tensor& weight,
                     const torch::Tensor& delta, double noise_ratio, int64_t seed);
torch::Tensor philox_uint32(int64_t seed, const torch::Tensor& offsets);

// penalty.cpp
torch::Tensor channel_penalty_(const torch::Tensor& grad, const torch::Tensor& weight,
                               const torch::Tensor& channels, int64_t dim, double lam, bool l1);

// nm_linear.cpp
torch::Tensor nm_decompress(const torch::Tensor& values, const torch::Tensor& meta, int64_t n,
                            int64_t m);
// The op itself: x [..., cols] of any row count (a GEMV up to 256 rows, decompressed blocks and BLAS
// beyond).
torch::Tensor nm_linear(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                        int64_t n, int64_t m, const c10::optional<torch::Tensor>& bias);
// "avx512_bf16_dot", "avx512_permute", "avx2_permute" (1 token), "avx2_expand" (more, 8 at a time) or
// "generic": the kernel nm_linear's GEMV runs for a 2-D x of these rows (at most 256).
std::string nm_linear_path(const torch::Tensor& x, const torch::Tensor& values,
                                const torch::Tensor& meta, int64_t n, int64_t m);
// The instruction-set level of nm_linear's GEMV (nm_linear_isa.h): the detected one, or the one the
// kernels run (the detected one capped by PYPRUNE_MAX_CPU_ISA / limit_cpu_isa).
std::string cpu_isa_report(bool detected);
// Caps the level at `name` (generic, avx2, avx512, avx512_bf16); returns the previous cap.
std::string limit_cpu_isa(const std::string& name);

// admm.cpp
torch::Tensor admm_dual_update_(const torch::Tensor& v, const torch::Tensor& keep,
                                const torch::Tensor& x,
                                const c10::optional<torch::Tensor>& act_sqnorm, int64_t n,
                                int64_t m, int64_t keep_count, bool per_row);

// scores.cpp
void accumulate_abs_outer_(const torch::Tensor& acc, const torch::Tensor& a,
                           const torch::Tensor& b, double alpha);

// sam.cpp
torch::Tensor sam_perturb_(const std::vector<torch::Tensor>& params,
                           const std::vector<torch::Tensor>& grads,
                           const std::vector<torch::Tensor>& anchors, double rho);
void sam_adam_step_(const std::vector<torch::Tensor>& params,
                   const std::vector<torch::Tensor>& grads,
                   const std::vector<torch::Tensor>& anchors,
                   const std::vector<torch::Tensor>& vs,
                   const std::vector<torch::Tensor>& keeps,
                   const std::vector<torch::Tensor>& exp_avgs,
                   const std::vector<torch::Tensor>& exp_avg_sqs, double lr, double beta1,
                   double beta2, double eps, double weight_decay, double lam, int64_t step);

}  // namespace pyprune_cpu
