// pyprune._C: the CPU implementations of the pyprune ops, registered with PyTorch's dispatcher under
// the schemas pyprune/ops/library.py declares (importing the module registers them; the schemas live
// in Python so that a build without this extension still defines and runs every op), and the few
// helpers that are not ops, bound as plain functions.
//
// Each op below takes the op's own argument form (any leading dims, reads that may be
// non-contiguous, the statistic in any float dtype) and hands its kernel the plain 2-D contiguous
// tensors it works on; checks on argument values that the fake kernels cannot see (act_sqnorm,
// channel indices) run here, with the Python implementations' messages.
#include "checks.h"
#include "ops.h"

#include <torch/extension.h>  // PYBIND11_MODULE, for the helpers that are not ops
#include <torch/library.h>

#include <string>

namespace pyprune_cpu {
namespace {

// t [..., cols] as contiguous rows [rows, cols].
torch::Tensor rows_of(const torch::Tensor& t) { return t.contiguous().reshape({-1, t.size(-1)}); }

// act_sqnorm checked and as the kernels read it (fp32, contiguous).
c10::optional<torch::Tensor> statistic(const c10::optional<torch::Tensor>& act_sqnorm) {
  if (!act_sqnorm.has_value() || !act_sqnorm->defined()) return c10::nullopt;
  check::sums_of_squares("act_sqnorm", *act_sqnorm);
  return act_sqnorm->to(at::kFloat).contiguous();
}

torch::Tensor nm_mask_op(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                         int64_t n, int64_t m, int64_t kind) {
  return nm_mask(rows_of(src), statistic(act_sqnorm), n, m, kind).reshape(src.sizes());
}

torch::Tensor topk_mask_op(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                           int64_t keep, bool per_row, int64_t kind) {
  return topk_mask(rows_of(src), statistic(act_sqnorm), keep, per_row, kind).reshape(src.sizes());
}

void accumulate_abs_outer_op(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b,
                             double alpha) {
  accumulate_abs_outer_(acc, rows_of(a), rows_of(b), alpha);
}

void moreau_perturb_op(const torch::Tensor& perturbed, const torch::Tensor& weight,
                       const torch::Tensor& delta, double noise_ratio, int64_t seed) {
  moreau_perturb_(perturbed, weight.contiguous(), delta, noise_ratio, seed);
}

void moreau_step_op(const torch::Tensor& delta, const torch::Tensor& grad, const torch::Tensor& weight,
                    const c10::optional<torch::Tensor>& perturbed, double decay, double step_size,
                    double threshold, int64_t group_dim, double noise_ratio, int64_t seed) {
  moreau_step_(delta, grad.contiguous(), weight.contiguous(), perturbed, decay, step_size, threshold,
               group_dim, noise_ratio, seed);
}

torch::Tensor nm_decompress_op(const torch::Tensor& values, const torch::Tensor& meta, int64_t n,
                               int64_t m) {
  return nm_decompress(values.contiguous(), meta.contiguous(), n, m);
}

torch::Tensor channel_penalty_op(const torch::Tensor& grad, const torch::Tensor& weight,
                                 const torch::Tensor& channels, int64_t dim, double lam,
                                 c10::string_view norm) {
  check::index_values("channels", channels, weight.size(dim), "weight's dim " + std::to_string(dim));
  if (weight.dim() == 1) {  // one row whose columns are the channels
    return channel_penalty_(grad.unsqueeze(0), weight.unsqueeze(0).contiguous(), channels.contiguous(), 1,
                            lam, norm == c10::string_view("l1"));
  }
  return channel_penalty_(grad, weight.contiguous(), channels.contiguous(), dim, lam, norm == c10::string_view("l1"));
}

torch::Tensor admm_dual_update_op(const torch::Tensor& v, const torch::Tensor& keep, const torch::Tensor& x,
                                  const c10::optional<torch::Tensor>& act_sqnorm, int64_t n, int64_t m,
                                  int64_t keep_count, bool per_row) {
  return admm_dual_update_(v, keep, x.contiguous(), statistic(act_sqnorm), n, m, keep_count, per_row);
}

torch::Tensor sam_perturb_op(at::TensorList params, at::TensorList grads, at::TensorList anchors, double rho) {
  return sam_perturb_(params.vec(), grads.vec(), anchors.vec(), rho);
}

void sam_adam_step_op(at::TensorList params, at::TensorList grads, at::TensorList anchors, at::TensorList vs,
                      at::TensorList keeps, at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
                      double beta1, double beta2, double eps, double weight_decay, double lam, int64_t step) {
  sam_adam_step_(params.vec(), grads.vec(), anchors.vec(), vs.vec(), keeps.vec(), exp_avgs.vec(),
                 exp_avg_sqs.vec(), lr, beta1, beta2, eps, weight_decay, lam, step);
}

}  // namespace
}  // namespace pyprune_cpu

// The list must agree with pyprune/ops/implementations.py (tests/ops/test_registration.py checks it).
TORCH_LIBRARY_IMPL(pyprune, CPU, m) {
  using namespace pyprune_cpu;
  m.impl("nm_mask", &nm_mask_op);
  m.impl("topk_mask", &topk_mask_op);
  m.impl("accumulate_abs_outer_", &accumulate_abs_outer_op);
  m.impl("moreau_perturb_", &moreau_perturb_op);
  m.impl("moreau_step_", &moreau_step_op);
  m.impl("nm_decompress", &nm_decompress_op);
  m.impl("nm_linear", &nm_linear);
  m.impl("channel_penalty_", &channel_penalty_op);
  m.impl("admm_dual_update_", &admm_dual_update_op);
  m.impl("sam_perturb_", &sam_perturb_op);
  m.impl("sam_adam_step_", &sam_adam_step_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyprune CPU kernels (C++/OpenMP), registered as the CPU implementations of torch.ops.pyprune.*";
  m.def("openmp_threads", &pyprune_cpu::openmp_threads,
        "Number of OpenMP threads the CPU kernels use (1 when built without OpenMP).");
  m.def("nm_linear_path", &pyprune_cpu::nm_linear_path, py::arg("x"), py::arg("values"),
        py::arg("meta"), py::arg("n"), py::arg("m"),
        "Which kernel nm_linear's GEMV runs for a 2-D x of at most 256 rows: 'avx512_bf16_dot' (bf16, "
        "half-density pattern), 'avx512_expand', 'avx2_permute' (one token), 'avx2_expand' (more "
        "tokens, 8 at a time) or 'generic'.");
  m.def("cpu_isa", &pyprune_cpu::cpu_isa_report, py::arg("detected") = false,
        "The instruction-set level nm_linear's GEMV runs here: 'generic', 'avx2' (AVX2+FMA+F16C), "
        "'avx512' (+AVX512F) or 'avx512_bf16' (+AVX512 BW/VBMI2/BF16), detected at run time "
        "and capped by PYPRUNE_MAX_CPU_ISA / limit_cpu_isa; detected=True: the CPU's own level, uncapped.");
  m.def("limit_cpu_isa", &pyprune_cpu::limit_cpu_isa, py::arg("isa"),
        "Cap the level nm_linear's GEMV runs at (generic, avx2, avx512, avx512_bf16; a cap above the CPU's "
        "level runs the CPU's); returns the previous cap.");
  m.def("philox_uint32", &pyprune_cpu::philox_uint32, py::arg("seed"), py::arg("offsets"),
        "[n, 2] int64: the first two uint32 words of Philox4x32-10 at each offset (the generator "
        "behind moreau_step_'s noise; tl.randint4x(seed, offsets)[:2]).");
}
