// SAFE's x-step over all the tensors of a block on the CPU (pyprune._C); pyprune/ops/sam.py
// documents the ops and pyprune.reference.sam_perturb_ / sam_adam_step_ are the oracles.
//
// sam_perturb_(params, grads, anchors, rho) -> ‖g‖₂ (fp32, 0-d)
//   ‖g‖₂ over every tensor; anchor ← x (a byte copy); x ← x + (rho/‖g‖₂)·g in fp32, rounded once
//   to x's dtype; x is not touched when ‖g‖₂ is 0.
// sam_adam_step_(params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps,
//                weight_decay, lam, step)
//   x = anchor;  G = g + lam·(x + v·(1 − 2·keep));  x ← x·(1 − lr·weight_decay)
//   m ← β₁·m + (1 − β₁)·G;  s ← β₂·s + (1 − β₂)·G²
//   x ← x − lr·(m/(1 − β₁^step)) / (sqrt(s/(1 − β₂^step)) + eps), rounded once to x's dtype
// The scalars are rounded to fp32 as the reference's eager arithmetic rounds them.
//
// Multi-tensor form: one table of chunks (tensor, start, length) of at most kChunk elements over
// all the tensors, and one OpenMP loop over it; the schedule is dynamic because a block's tensors
// and the table's last chunk of each differ in size. A chunk is walked in spans of kSpan staged as
// fp32 (staging.h; fp32 tensors are read and updated in place), so every arithmetic loop is a
// plain fp32 loop the compiler vectorises. The norm is two-stage: each chunk sums g² into kSpan
// fp32 lanes combined in double, then the chunks' sums are added in table order in double. The
// partition never depends on the thread count, so neither does any result.

#include "ops.h"
#include "parallel.h"
#include "scores.h"
#include "staging.h"

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pyprune_cpu {
namespace {

// Elements per chunk (the unit of parallel work): 128 KB of an fp32 tensor.
constexpr int64_t kChunk = 32768;
// Elements per span: 2 KB per fp32 staging buffer, so a span's buffers stay in L1.
constexpr int64_t kSpan = 512;

struct Chunk {
  int64_t tensor, start, length;
};

// The chunks of tensors of these sizes, tensor by tensor.
std::vector<Chunk> chunk_table(const std::vector<torch::Tensor>& tensors) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(tensors.size()); ++t) {
    const int64_t numel = tensors[t].numel();
    for (int64_t start = 0; start < numel; start += kChunk) {
      chunks.push_back({t, start, std::min(kChunk, numel - start)});
    }
  }
  return chunks;
}

int64_t total_numel(const std::vector<torch::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

// One list's tensors as (address, dtype) pairs.
struct List {
  std::vector<void*> data;
  std::vector<Dt> dt;
};

// Checks `tensors` against `params` (count, shape, CPU, contiguous; dtype `only` when given, else
// fp32/fp16/bf16) and returns their addresses and dtypes (pyprune.ops validates first; this guards
// direct calls).
List checked_list(const std::vector<torch::Tensor>& tensors, const char* name,
                  const std::vector<torch::Tensor>& params, const char* op,
                  c10::optional<at::ScalarType> only = c10::nullopt) {
  TORCH_CHECK(!params.empty(), op, ": params must not be empty");
  TORCH_CHECK(tensors.size() == params.size(), op, ": ", name, " must hold ", params.size(),
              " tensors, got ", tensors.size());
  List list;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& t = tensors[i];
    const std::string where = std::string(name) + "[" + std::to_string(i) + "]";
    const std::string like = "params[" + std::to_string(i) + "]";
    check::same_shape(op, where.c_str(), t, like.c_str(), params[i]);
    if (only.has_value()) {
      check::tensor(op, where.c_str(), t, -1, {*only});
      list.dt.push_back(Dt::F32);  // unused for the fp32 and bool lists
    } else {
      check::tensor(op, where.c_str(), t, -1, check::floats());
      list.dt.push_back(dt_of(t));
    }
    list.data.push_back(t.data_ptr());
  }
  return list;
}

// ---------------------------------------------------------------------------------------------
// sam_perturb

// Σ g² over one chunk, in kSpan fp32 lanes combined in double.
double chunk_sum_squares(const void* grad, Dt dt, int64_t start, int64_t length) {
  alignas(64) float lanes[kSpan] = {0.0f};
  alignas(64) float buffer[kSpan];
  for (int64_t s0 = 0; s0 < length; s0 += kSpan) {
    const int64_t n = std::min(kSpan, length - s0);
    const float* __restrict g = staged_span(grad, dt, start + s0, n, buffer);
    for (int64_t i = 0; i < n; ++i) lanes[i] += g[i] * g[i];
  }
  double sum = 0.0;
  for (int64_t i = 0; i < kSpan; ++i) sum += lanes[i];
  return sum;
}

// anchor ← x, then x ← x + scale·g over one chunk (x left as it is when `move` is false).
void perturb_chunk(const List& params, const List& grads, const List& anchors, const Chunk& c,
                   int64_t element_size, float scale, bool move) {
  void* x_base = params.data[c.tensor];
  std::memcpy(static_cast<char*>(anchors.data[c.tensor]) + c.start * element_size,
              static_cast<const char*>(x_base) + c.start * element_size,
              static_cast<size_t>(c.length * element_size));
  if (!move) return;
  const Dt x_dt = params.dt[c.tensor], g_dt = grads.dt[c.tensor];
  alignas(64) float x_buffer[kSpan], g_buffer[kSpan];
  for (int64_t s0 = 0; s0 < c.length; s0 += kSpan) {
    const int64_t start = c.start + s0, n = std::min(kSpan, c.length - s0);
    float* __restrict x = staged_span(x_base, x_dt, start, n, x_buffer);
    const float* __restrict g = staged_span(grads.data[c.tensor], g_dt, start, n, g_buffer);
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] + scale * g[i];
    if (x_dt != Dt::F32) store_span(x_base, x_dt, start, n, x);
  }
}

// ---------------------------------------------------------------------------------------------
// sam_adam_step

struct AdamScalars {
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, decay, lam;
};

struct AdamLists {
  List params, grads, anchors, vs, keeps, exp_avgs, exp_avg_sqs;
};

// The Adam step on n staged elements (fp32 in, fp32 out; keep is torch.bool's 0/1 byte, read as
// uint8_t because GCC does not vectorise bool loads).
void adam_elements(const float* __restrict anchor, const float* __restrict g,
                   const float* __restrict v, const uint8_t* __restrict keep, float* __restrict m,
                   float* __restrict sq, float* __restrict x, int64_t n, const AdamScalars c) {
  for (int64_t i = 0; i < n; ++i) {
    const float x0 = anchor[i];
    // x − z + u = x + v·(1 − 2·keep); the factor is ±1, so the product is exact
    const float G = g[i] + c.lam * (x0 + v[i] * (1.0f - 2.0f * static_cast<float>(keep[i])));
    const float m_new = m[i] * c.beta1 + c.one_minus_beta1 * G;
    const float sq_new = sq[i] * c.beta2 + c.one_minus_beta2 * G * G;
    m[i] = m_new;
    sq[i] = sq_new;
    x[i] = x0 * c.decay - c.lr * (m_new / c.bias1) / (std::sqrt(sq_new / c.bias2) + c.eps);
  }
}

void adam_span(const AdamLists& l, int64_t t, int64_t start, int64_t n, const AdamScalars& s) {
  alignas(64) float anchor_buffer[kSpan], g_buffer[kSpan], x_buffer[kSpan];
  const Dt x_dt = l.params.dt[t];
  float* x = x_dt == Dt::F32 ? static_cast<float*>(l.params.data[t]) + start : x_buffer;
  adam_elements(staged_span(l.anchors.data[t], l.anchors.dt[t], start, n, anchor_buffer),
                staged_span(l.grads.data[t], l.grads.dt[t], start, n, g_buffer),
                static_cast<const float*>(l.vs.data[t]) + start,
                static_cast<const uint8_t*>(l.keeps.data[t]) + start,
                static_cast<float*>(l.exp_avgs.data[t]) + start,
                static_cast<float*>(l.exp_avg_sqs.data[t]) + start, x, n, s);
  if (x_dt != Dt::F32) store_span(l.params.data[t], x_dt, start, n, x);
}

}  // namespace

torch::Tensor sam_perturb_(const std::vector<torch::Tensor>& params,
                           const std::vector<torch::Tensor>& grads,
                           const std::vector<torch::Tensor>& anchors, double rho) {
  constexpr const char* op = "sam_perturb_";
  const List x = checked_list(params, "params", params, op);
  const List g = checked_list(grads, "grads", params, op);
  const List a = checked_list(anchors, "anchors", params, op);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(anchors[i].scalar_type() == params[i].scalar_type(), op, ": anchors[", i,
                "] must have the dtype of params[", i, "]");
  }
  check::at_least(op, "rho", rho, 0.0);
  const std::vector<Chunk> chunks = chunk_table(params);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  const bool parallel = total_numel(params) >= kParallelMin;

  std::vector<double> partial(chunks.size());
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t k = 0; k < n_chunks; ++k) {
    const Chunk& c = chunks[k];
    partial[k] = chunk_sum_squares(g.data[c.tensor], g.dt[c.tensor], c.start, c.length);
  }
  double sum = 0.0;
  for (const double p : partial) sum += p;
  const float norm = std::sqrt(static_cast<float>(sum));

  const bool move = norm > 0.0f;
  const float scale = move ? static_cast<float>(rho) / norm : 0.0f;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t k = 0; k < n_chunks; ++k) {
    const Chunk& c = chunks[k];
    perturb_chunk(x, g, a, c, params[c.tensor].element_size(), scale, move);
  }
  return torch::full({}, norm, torch::dtype(torch::kFloat32));
}

void sam_adam_step_(const std::vector<torch::Tensor>& params,
                    const std::vector<torch::Tensor>& grads,
                    const std::vector<torch::Tensor>& anchors,
                    const std::vector<torch::Tensor>& vs,
                    const std::vector<torch::Tensor>& keeps,
                    const std::vector<torch::Tensor>& exp_avgs,
                    const std::vector<torch::Tensor>& exp_avg_sqs, double lr, double beta1,
                    double beta2, double eps, double weight_decay, double lam, int64_t step) {
  constexpr const char* op = "sam_adam_step_";
  const AdamLists l{checked_list(params, "params", params, op),
                    checked_list(grads, "grads", params, op),
                    checked_list(anchors, "anchors", params, op),
                    checked_list(vs, "vs", params, op, at::kFloat),
                    checked_list(keeps, "keeps", params, op, at::kBool),
                    checked_list(exp_avgs, "exp_avgs", params, op, at::kFloat),
                    checked_list(exp_avg_sqs, "exp_avg_sqs", params, op, at::kFloat)};
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, op,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(eps > 0.0, op, ": eps must be > 0, got ", eps);
  const AdamScalars s{static_cast<float>(lr),
                      static_cast<float>(beta1),
                      static_cast<float>(1.0 - beta1),
                      static_cast<float>(beta2),
                      static_cast<float>(1.0 - beta2),
                      static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(step))),
                      static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step))),
                      static_cast<float>(eps),
                      static_cast<float>(1.0 - lr * weight_decay),
                      static_cast<float>(lam)};
  const std::vector<Chunk> chunks = chunk_table(params);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 1) if (total_numel(params) >= kParallelMin)
  for (int64_t k = 0; k < n_chunks; ++k) {
    const Chunk& c = chunks[k];
    for (int64_t s0 = 0; s0 < c.length; s0 += kSpan) {
      adam_span(l, c.tensor, c.start + s0, std::min(kSpan, c.length - s0), s);
    }
  }
}

}  // namespace pyprune_cpu
