// pyprune._C_cuda: argument checks and Python bindings for the CUDA kernels in csrc/cuda/*.cu.
// The kernels are plain CUDA behind extern "C" launchers; this file is the only one that sees
// torch, and it is compiled by the host compiler.

#include <torch/extension.h>

// c10::cuda::getCurrentCUDAStream is the function at::cuda::getCurrentCUDAStream names
// (ATen/cuda/CUDAContext.h); this header spares the build the cuBLAS/cuSPARSE/cuSOLVER headers
// that CUDAContext.h pulls in and this file does not use.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>
#include <cuda_runtime.h>

#include <cstdint>

extern "C" cudaError_t pyprune_nm_mask_cuda(const void* src, int dtype, const float* act_sqnorm,
                                            uint8_t* out, int* nan_flag, int64_t rows,
                                            int64_t cols, int n, int m, int score_kind,
                                            cudaStream_t stream);

namespace pyprune_cuda {

namespace {

constexpr const char* kNanMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores";
constexpr const char* kNanWandaMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores (w/act_sqnorm produce NaN "
    "scores: NaN in w or act_sqnorm, a negative act_sqnorm, or inf * 0)";

}  // namespace

// Bool N:M keep mask of a 2-D CUDA tensor; same contract as pyprune._C.nm_mask.
torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
                      int64_t n, int64_t m, int64_t score_kind) {
  TORCH_CHECK(src.is_cuda(), "nm_mask: src must be a CUDA tensor");
  TORCH_CHECK(src.dim() == 2, "nm_mask: src must be 2-D, got ", src.dim(), "-D");
  TORCH_CHECK(src.is_contiguous(), "nm_mask: src must be contiguous");
  const auto st = src.scalar_type();
  int dtype = -1;
  if (st == at::kFloat) dtype = 0;
  else if (st == at::kHalf) dtype = 1;
  else if (st == at::kBFloat16) dtype = 2;
  TORCH_CHECK(dtype >= 0, "nm_mask: src dtype must be float32, float16 or bfloat16, got ", st);
  TORCH_CHECK(m >= 2 && m <= 32, "nm_mask: m must be in [2, 32], got ", m);
  TORCH_CHECK(n >= 1 && n < m, "nm_mask: n must be in [1, m), got n=", n, ", m=", m);
  TORCH_CHECK(score_kind >= 0 && score_kind <= 2, "nm_mask: score_kind must be 0, 1 or 2, got ",
              score_kind);
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  TORCH_CHECK(cols % m == 0, "nm_mask: cols (", cols, ") must be a multiple of m (", m, ")");

  const c10::cuda::CUDAGuard device_guard(src.device());

  torch::Tensor act;
  if (score_kind == 2) {
    TORCH_CHECK(act_sqnorm.has_value() && act_sqnorm->defined(),
                "nm_mask: score_kind 2 (Wanda) needs act_sqnorm");
    act = *act_sqnorm;
    TORCH_CHECK(act.is_cuda() && act.device() == src.device(),
                "nm_mask: act_sqnorm must be on the same CUDA device as src");
    TORCH_CHECK(act.scalar_type() == at::kFloat, "nm_mask: act_sqnorm must be float32");
    TORCH_CHECK(act.dim() == 1 && act.size(0) == cols,
                "nm_mask: act_sqnorm must be 1-D of length ", cols);
    act = act.contiguous();
  }

  torch::Tensor out = torch::empty({rows, cols}, src.options().dtype(torch::kBool));
  if (out.numel() == 0) return out;
  torch::Tensor nan_flag = torch::zeros({1}, src.options().dtype(torch::kInt));

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  const cudaError_t err = pyprune_nm_mask_cuda(
      src.data_ptr(), dtype, score_kind == 2 ? act.data_ptr<float>() : nullptr,
      reinterpret_cast<uint8_t*>(out.data_ptr<bool>()), nan_flag.data_ptr<int>(), rows, cols,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(score_kind), stream);
  TORCH_CHECK(err == cudaSuccess, "nm_mask: CUDA kernel launch failed: ", cudaGetErrorString(err));

  // .item() waits for the kernel on the current stream.
  TORCH_CHECK_VALUE(nan_flag.item<int>() == 0, score_kind == 2 ? kNanWandaMessage : kNanMessage);
  return out;
}

}  // namespace pyprune_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyprune CUDA kernels";
  m.def("nm_mask", &pyprune_cuda::nm_mask, py::arg("src"), py::arg("act_sqnorm"), py::arg("n"),
        py::arg("m"), py::arg("score_kind"),
        "Bool N:M keep mask of a 2-D CUDA tensor: in every m consecutive elements of a row keep "
        "the n highest fp32 scores (lower index wins ties). score_kind 0: src are the scores; 1: "
        "|src|; 2: |src| * sqrt(act_sqnorm[col]) (Wanda). Raises ValueError on NaN scores.");
}
