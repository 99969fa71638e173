// pyprune._C_cuda: the CUDA implementations of the pyprune ops, registered with PyTorch's dispatcher
// under the schemas pyprune/ops/library.py declares (importing the module registers them), with their
// argument checks. The kernels are plain CUDA behind extern "C" launchers; this file is the only one
// that sees torch, and it is compiled by the host compiler.

#include <torch/extension.h>
#include <torch/library.h>

// c10::cuda::getCurrentCUDAStream is the function at::cuda::getCurrentCUDAStream names
// (ATen/cuda/CUDAContext.h); this header spares the build the cuBLAS/cuSPARSE/cuSOLVER headers
// that CUDAContext.h pulls in and this file does not use.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../cpu/checks.h"
#include "../score_kind.h"

using pyprune::ScoreKind;

extern "C" cudaError_t pyprune_nm_mask_cuda(const void* src, int dtype, const float* act_sqnorm,
                                            uint8_t* out, int* nan_flag, int64_t rows,
                                            int64_t cols, int n, int m, int score_kind,
                                            cudaStream_t stream);

extern "C" cudaError_t pyprune_sparse24_linear_cuda(const void* x, const void* values,
                                                    const void* meta, const void* bias, void* y,
                                                    int dtype, int64_t tokens,
                                                    int64_t out_features, int64_t K,
                                                    cudaStream_t stream);
extern "C" cudaError_t pyprune_sparse24_compress_cuda(const void* w, const uint8_t* mask,
                                                      void* values, void* meta, int* bad_group,
                                                      int64_t rows, int64_t cols,
                                                      cudaStream_t stream);

namespace pyprune_cuda {

namespace {

constexpr const char* kNanMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores";
constexpr const char* kNanWandaMessage =
    "scores contain NaN; pyprune masks need finite or ±inf scores (w/act_sqnorm produce NaN "
    "scores: NaN in w or act_sqnorm, a negative act_sqnorm, or inf * 0)";

}  // namespace

// Bool N:M keep mask of a 2-D contiguous CUDA tensor.
torch::Tensor nm_mask_rows(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm,
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
  TORCH_CHECK(score_kind >= ScoreKind::GIVEN && score_kind <= ScoreKind::WANDA,
              "nm_mask: score_kind must be ", int(ScoreKind::GIVEN), " (GIVEN), ",
              int(ScoreKind::MAGNITUDE), " (MAGNITUDE) or ", int(ScoreKind::WANDA), " (WANDA), got ",
              score_kind);
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  TORCH_CHECK(cols % m == 0, "nm_mask: cols (", cols, ") must be a multiple of m (", m, ")");

  const c10::cuda::CUDAGuard device_guard(src.device());

  torch::Tensor act;
  if (score_kind == ScoreKind::WANDA) {
    TORCH_CHECK(act_sqnorm.has_value() && act_sqnorm->defined(),
                "nm_mask: score_kind WANDA needs act_sqnorm");
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
      src.data_ptr(), dtype, score_kind == ScoreKind::WANDA ? act.data_ptr<float>() : nullptr,
      reinterpret_cast<uint8_t*>(out.data_ptr<bool>()), nan_flag.data_ptr<int>(), rows, cols,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(score_kind), stream);
  TORCH_CHECK(err == cudaSuccess, "nm_mask: CUDA kernel launch failed: ", cudaGetErrorString(err));

  // .item() waits for the kernel on the current stream.
  TORCH_CHECK_VALUE(nan_flag.item<int>() == 0, score_kind == ScoreKind::WANDA ? kNanWandaMessage : kNanMessage);
  return out;
}

namespace {

int half_dtype(const torch::Tensor& t, const char* op, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16, op, ": ", name,
              " must be float16 or bfloat16, got ", st);
  return st == at::kHalf ? 1 : 2;
}

void check_cuda_2d(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

}  // namespace

// y = x @ (2:4 W)ᵀ + bias for a 2-D x on sparse tensor cores; see csrc/cuda/sparse24_linear.cu for
// the layout.
torch::Tensor sparse24_linear_rows(const torch::Tensor& x, const torch::Tensor& values,
                              const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias) {
  constexpr const char* op = "sparse24_linear";
  check_cuda_2d(x, op, "x");
  check_cuda_2d(values, op, "values");
  check_cuda_2d(meta, op, "meta");
  const int dtype = half_dtype(x, op, "x");
  TORCH_CHECK(values.scalar_type() == x.scalar_type(), op, ": values must have x's dtype");
  TORCH_CHECK(meta.scalar_type() == at::kShort, op, ": meta must be int16 (sparse24_mma_meta)");
  const int64_t tokens = x.size(0), K = x.size(1), out_features = values.size(0);
  TORCH_CHECK(K % 32 == 0, op, ": in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(values.size(1) == K / 2, op, ": values must be [out, ", K / 2, "], got [",
              values.size(0), ", ", values.size(1), "]");
  TORCH_CHECK(meta.size(0) == out_features && meta.size(1) == K / 16, op, ": meta must be [",
              out_features, ", ", K / 16, "]");
  TORCH_CHECK(x.device() == values.device() && x.device() == meta.device(), op,
              ": x, values and meta must be on one device");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(values.data_ptr()) % 4 == 0,
              op, ": x and values must be 4-byte aligned (pairs are loaded as 32-bit words)");
  int major = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                     x.device().index()) == cudaSuccess,
              op, ": cannot query the device's compute capability");
  TORCH_CHECK(major >= 8, op, ": needs sparse tensor cores (sm80 or newer), device is sm", major, "x");
  const void* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.is_cuda() && bias_c.device() == x.device() && bias_c.dim() == 1 &&
                    bias_c.size(0) == out_features && bias_c.scalar_type() == x.scalar_type(),
                op, ": bias must be [", out_features, "] of x's dtype on x's device");
    bias_ptr = bias_c.data_ptr();
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  torch::Tensor y = torch::empty({tokens, out_features}, x.options());
  const cudaError_t err = pyprune_sparse24_linear_cuda(
      x.data_ptr(), values.data_ptr(), meta.data_ptr(), bias_ptr, y.data_ptr(), dtype, tokens,
      out_features, K, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

// (values [rows, cols/2], meta [rows, cols/16] int16) of w ⊙ mask for sparse24_linear.
std::tuple<torch::Tensor, torch::Tensor> sparse24_compress(const torch::Tensor& w_in,
                                                           const torch::Tensor& mask_in) {
  constexpr const char* op = "sparse24_compress";
  const torch::Tensor w = w_in.contiguous(), mask = mask_in.contiguous();
  check_cuda_2d(w, op, "w");
  check_cuda_2d(mask, op, "mask");
  half_dtype(w, op, "w");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == w.sizes() &&
                  mask.device() == w.device(), op, ": mask must be a bool tensor shaped like w");
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(cols % 16 == 0, op, ": w must have a multiple of 16 columns, got ", cols);
  const c10::cuda::CUDAGuard device_guard(w.device());
  torch::Tensor values = torch::empty({rows, cols / 2}, w.options());
  torch::Tensor meta = torch::empty({rows, cols / 16}, w.options().dtype(torch::kShort));
  torch::Tensor bad = torch::zeros({1}, w.options().dtype(torch::kInt));
  const cudaError_t err = pyprune_sparse24_compress_cuda(
      w.data_ptr(), reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()), values.data_ptr(),
      meta.data_ptr(), bad.data_ptr<int>(), rows, cols,
      c10::cuda::getCurrentCUDAStream(w.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  TORCH_CHECK_VALUE(bad.item<int>() == 0, op, ": mask must keep exactly 2 of every 4 elements");
  return {values, meta};
}

// The ops' own argument forms (any leading dims, reads that may be non-contiguous) over the 2-D kernels.
torch::Tensor nm_mask(const torch::Tensor& src, const c10::optional<torch::Tensor>& act_sqnorm, int64_t n,
                      int64_t m, int64_t kind) {
  c10::optional<torch::Tensor> act;
  if (act_sqnorm.has_value() && act_sqnorm->defined()) {
    pyprune_cpu::check::sums_of_squares("act_sqnorm", *act_sqnorm);
    act = act_sqnorm->to(at::kFloat).contiguous();
  }
  return nm_mask_rows(src.contiguous().reshape({-1, src.size(-1)}), act, n, m, kind).reshape(src.sizes());
}

torch::Tensor sparse24_linear(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                              const c10::optional<torch::Tensor>& bias) {
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  TORCH_CHECK(!out_shape.empty(), "sparse24_linear: x must have at least 1 dim");
  out_shape.back() = values.size(0);
  if (x.numel() == 0) return torch::empty(out_shape, x.options());  // as F.linear: no kernel
  const torch::Tensor rows = x.contiguous().reshape({-1, x.size(-1)});
  return sparse24_linear_rows(rows, values.contiguous(), meta.contiguous(), bias).reshape(out_shape);
}

}  // namespace pyprune_cuda

// The list must agree with pyprune/ops/implementations.py (tests/ops/test_registration.py checks it).
TORCH_LIBRARY_IMPL(pyprune, CUDA, m) {
  m.impl("nm_mask", &pyprune_cuda::nm_mask);
  m.impl("sparse24_linear", &pyprune_cuda::sparse24_linear);
  m.impl("sparse24_compress", &pyprune_cuda::sparse24_compress);
}

// A module to import: importing it registers the kernels above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyprune CUDA kernels, registered as the CUDA implementations of torch.ops.pyprune.*";
}
