// pyprune._C: Python bindings of the CPU kernels (C++/OpenMP).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyprune CPU kernels (C++/OpenMP)";
  m.def("nm_mask", &pyprune_cpu::nm_mask, py::arg("src"), py::arg("act_sqnorm"), py::arg("n"),
        py::arg("m"), py::arg("score_kind"),
        "Bool N:M keep mask of a 2-D CPU tensor: in every m consecutive elements of a row keep the "
        "n highest fp32 scores (lower index wins ties). score_kind (pyprune.ops.conventions.ScoreKind) "
        "GIVEN: src are the scores; MAGNITUDE: |src|; WANDA: |src| * sqrt(act_sqnorm[col]). Raises ValueError on NaN scores.");
  m.def("topk_mask", &pyprune_cpu::topk_mask, py::arg("src"), py::arg("act_sqnorm"),
        py::arg("keep"), py::arg("per_row"), py::arg("score_kind"),
        "Bool top-k keep mask of a 2-D CPU tensor: keep exactly `keep` highest fp32 scores of "
        "every row (per_row) or of the whole tensor, lower index first among equal scores, by "
        "radix select (no sort). score_kind as in nm_mask. Raises ValueError on NaN scores.");
  m.def("openmp_threads", &pyprune_cpu::openmp_threads,
        "Number of OpenMP threads the CPU kernels use (1 when built without OpenMP).");
  m.def("nm_decompress", &pyprune_cpu::nm_decompress, py::arg("values"), py::arg("meta"),
        py::arg("n"), py::arg("m"),
        "Dense W ⊙ mask [rows, cols] from the compressed N:M form (values, packed-mask meta).");
  m.def("nm_linear_gemv", &pyprune_cpu::nm_linear_gemv, py::arg("x"), py::arg("values"),
        py::arg("meta"), py::arg("n"), py::arg("m"), py::arg("bias"),
        "x [tokens, K] @ (W ⊙ mask)ᵀ + bias straight from the compressed form, 8 tokens at a time: only "
        "the kept weights are read (fp32 accumulation).");
  m.def("nm_linear_gemv_path", &pyprune_cpu::nm_linear_gemv_path, py::arg("x"), py::arg("values"),
        py::arg("meta"), py::arg("n"), py::arg("m"),
        "Which kernel nm_linear_gemv runs for these arguments: 'avx512_bf16_dot' (bf16, "
        "half-density pattern), 'avx512_expand', 'avx2_permute' (one token), 'avx2_expand' (more "
        "tokens, 8 at a time) or 'generic'.");
  m.def("cpu_isa", &pyprune_cpu::cpu_isa_report, py::arg("detected") = false,
        "The instruction-set level nm_linear_gemv runs here: 'generic', 'avx2' (AVX2+FMA+F16C), "
        "'avx512' (+AVX512F) or 'avx512_bf16' (+AVX512 BW/VBMI2/BF16), detected at run time "
        "and capped by PYPRUNE_MAX_CPU_ISA / limit_cpu_isa; detected=True: the CPU's own level, uncapped.");
  m.def("limit_cpu_isa", &pyprune_cpu::limit_cpu_isa, py::arg("isa"),
        "Cap the level nm_linear_gemv runs at (generic, avx2, avx512, avx512_bf16; a cap above the CPU's "
        "level runs the CPU's); returns the previous cap.");
  m.def("channel_penalty_", &pyprune_cpu::channel_penalty_, py::arg("grad"), py::arg("weight"),
        py::arg("channels"), py::arg("dim"), py::arg("lam"), py::arg("l1"),
        "DReSS penalty in place: for each channel c (a row for dim 0, a column for dim 1) grad[c] "
        "+= lam * W[c] / ||W[c]||_2 (none where the norm is 0), or lam * sign(W[c]) when l1; "
        "returns the fp32 norms (l2, or l1 when l1) in channels order.");
  m.def("moreau_step_", &pyprune_cpu::moreau_step_, py::arg("delta"), py::arg("grad"),
        py::arg("weight"), py::arg("perturbed"), py::arg("decay"), py::arg("step_size"),
        py::arg("threshold"), py::arg("group_dim"), py::arg("noise_ratio"), py::arg("seed"),
        "MoreauPruner step in place: delta = GST_threshold(decay * delta - step_size * grad) per "
        "row (group_dim 0) or column (1), then perturbed = weight + delta + noise_ratio * |weight| "
        "* z with z = tl.randn(seed, flat index) (when perturbed is not None).");
  m.def("moreau_perturb_", &pyprune_cpu::moreau_perturb_, py::arg("perturbed"), py::arg("weight"),
        py::arg("delta"), py::arg("noise_ratio"), py::arg("seed"),
        "perturbed = weight + delta + noise_ratio * |weight| * z in place, z as in moreau_step_.");
  m.def("philox_uint32", &pyprune_cpu::philox_uint32, py::arg("seed"), py::arg("offsets"),
        "[n, 2] int64: the first two uint32 words of Philox4x32-10 at each offset (the generator "
        "behind moreau_step_'s noise; tl.randint4x(seed, offsets)[:2]).");
  m.def("admm_dual_update_", &pyprune_cpu::admm_dual_update_, py::arg("v"), py::arg("keep"),
        py::arg("x"), py::arg("act_sqnorm"), py::arg("n"), py::arg("m"), py::arg("keep_count"),
        py::arg("per_row"),
        "SAFE's dual update in place: v = x + v * ~keep (fp32), keep = the n highest of every m "
        "consecutive scores |v| (or |v| * sqrt(act_sqnorm[col])) of a row when m > 0 (one pass), "
        "else the keep_count highest scores of every row (per_row) or of the tensor; lower index "
        "first among ties; returns ||x - v * keep||^2 as a 0-d float32 tensor. Raises ValueError "
        "on NaN scores.");
  m.def("accumulate_abs_outer_", &pyprune_cpu::accumulate_abs_outer_, py::arg("acc"), py::arg("a"),
        py::arg("b"), py::arg("alpha"),
        "acc [M, D] += alpha * |a|^T |b| in place for a [T, M], b [T, D] (COPAL's accumulation): "
        "tokens streamed in chunks converted to fp32 |.|, one BLAS GEMM per chunk into acc.");
  m.def("sam_perturb_", &pyprune_cpu::sam_perturb_, py::arg("params"), py::arg("grads"),
        py::arg("anchors"), py::arg("rho"),
        "SAM ascent over all the tensors at once: anchors[i] <- params[i] (exact copy), then x += "
        "rho * g / ||g||_2 (fp32, rounded once; no move when the norm is 0) with the norm over "
        "every grad; returns the fp32 norm (0-d).");
  m.def("sam_adam_step_", &pyprune_cpu::sam_adam_step_, py::arg("params"), py::arg("grads"),
        py::arg("anchors"), py::arg("vs"), py::arg("keeps"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("lam"), py::arg("step"),
        "SAFE's penalised Adam step over all the tensors at once: x = anchor, G = g + lam * (x + v "
        "* (1 - 2 keep)), decoupled weight decay, Adam moments (fp32) with bias correction for "
        "step; x rounded once to its dtype.");
}
