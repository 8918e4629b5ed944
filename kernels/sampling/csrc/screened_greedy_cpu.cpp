// Greedy tokens of an fp32 LM head without its full fp32 logits: the logits from a bfloat16 GEMM (twice as fast on
// CPUs with native bf16 dot products) screen out every token that cannot be the fp32 maximum, and only the few
// left are computed exactly, as fp32 dot products of the hidden state and the fp32 head rows.
//
// Why it is exact: with bf16 inputs (8 significant bits) and fp32 accumulation, a bf16 logit a_i differs from the
// real h . w_i by at most 2^-7 sum_j |h_j w_ij| (both factors rounded) + K 2^-24 sum_j |h_j w_ij| (the sum) +
// 2^-8 |a_i| (the bf16 output), and sum_j |h_j w_ij| <= |h| |w_i|. Taking twice that, bound_i = 2^-6 |h| |w_i| +
// 2^-7 |a_i|: the real maximum lies at or above L = max_i (a_i - bound_i), so every token whose real logit can
// reach the maximum has a_i + bound_i >= L. Those candidates are computed in fp32 and the first maximal one wins,
// as torch.argmax picks among equal values.
//
//   screened_greedy_cpu(approx [B, V] bfloat16, hidden [B, H] float32, weight [V, H] float32, row_norms [V] float32)
//       -> [B] int64: the token of each row; -1 where a candidate's fp32 logit is NaN or infinite (the row's
//          logits are not finite); -2 where the screen cannot tell (a bf16 logit is NaN or infinite): the caller
//          then computes the full logits.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

using loraplex::BFloat16;
using loraplex::check_rows;
using loraplex::load_f32;
using loraplex::Vec;

constexpr float kProductBound = 1.f / 64;  // 2^-6: twice the bf16 products' and the fp32 sum's relative error
constexpr float kOutputBound = 1.f / 128;  // 2^-7: twice the bf16 output's rounding

float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// The screen's bound on |a_i - h . w_i|: scale |w_i| + kOutputBound |a_i| (scale = kProductBound |h|), for a vector
// of tokens and for one.
inline Vec bound(const Vec& a, const Vec& norm, const Vec& scale) {
  return at::vec::fmadd(scale, norm, Vec(kOutputBound) * a.abs());
}
inline float bound(float a, float norm, float scale) { return scale * norm + kOutputBound * std::abs(a); }

int64_t screened_row(const BFloat16* approx, const float* h, const float* weight, const float* norms, int64_t vocab,
                     int64_t hidden) {
  const float h_norm = std::sqrt(dot(h, h, hidden));
  if (!std::isfinite(h_norm)) return -1;  // a NaN or an infinity in the hidden state reaches every logit
  const float h_scale = kProductBound * h_norm;
  const Vec scale(h_scale);
  constexpr int64_t kLanes = Vec::size();
  const int64_t body = vocab / kLanes * kLanes;
  Vec lowest(-std::numeric_limits<float>::infinity()), poison(0.f);
  for (int64_t i = 0; i < body; i += kLanes) {  // L = max_i (a_i - bound_i)
    const Vec a = load_f32(approx + i);
    poison = poison + a * Vec(0.f);  // 0 for finite values, NaN from the first NaN or infinity on
    lowest = at::vec::maximum(lowest, a - bound(a, Vec::loadu(norms + i), scale));
  }
  float lane[kLanes];
  poison.store(lane);
  for (int64_t l = 0; l < kLanes; ++l)
    if (lane[l] != 0.f) return -2;
  float floor = lowest.reduce_max();
  for (int64_t i = body; i < vocab; ++i) {
    const float a = static_cast<float>(approx[i]);
    if (!std::isfinite(a)) return -2;
    floor = std::max(floor, a - bound(a, norms[i], h_scale));
  }
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_at = -1;
  auto consider = [&](int64_t i) {  // ascending i: the first of equal maxima stays
    const float exact = dot(h, weight + i * hidden, hidden);
    if (!std::isfinite(exact)) return false;
    if (exact > best) best = exact, best_at = i;
    return true;
  };
  const Vec vfloor(floor);
  for (int64_t i = 0; i < body; i += kLanes) {
    const Vec a = load_f32(approx + i);
    const Vec upper = a + bound(a, Vec::loadu(norms + i), scale);
    const int below = (upper >= vfloor).zero_mask();  // bit l set: lane l cannot reach the maximum
    if (below == (1 << kLanes) - 1) continue;
    for (int64_t l = 0; l < kLanes; ++l)
      if (!(below >> l & 1) && !consider(i + l)) return -1;
  }
  for (int64_t i = body; i < vocab; ++i) {
    const float a = static_cast<float>(approx[i]);
    if (a + bound(a, norms[i], h_scale) >= floor && !consider(i)) return -1;
  }
  return best_at;
}

}  // namespace

at::Tensor screened_greedy_cpu(const at::Tensor& approx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& row_norms) {
  check_rows(approx, "approx", at::kBFloat16);
  check_rows(hidden, "hidden");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight: contiguous [V, H] float32");
  TORCH_CHECK(row_norms.dim() == 1 && row_norms.scalar_type() == at::kFloat && row_norms.is_contiguous(),
              "row_norms: contiguous [V] float32");
  const int64_t num_rows = approx.size(0), vocab = approx.size(1), dim = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == num_rows, "hidden has ", hidden.size(0), " rows, approx ", num_rows);
  TORCH_CHECK(weight.size(0) == vocab && weight.size(1) == dim && row_norms.size(0) == vocab,
              "weight must be [", vocab, ", ", dim, "] and row_norms [", vocab, "]");
  auto out = at::empty({num_rows}, approx.options().dtype(at::kLong));
  const BFloat16* a = approx.data_ptr<at::BFloat16>();
  const float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* norms = row_norms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t a_stride = approx.stride(0), h_stride = hidden.stride(0);
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      tokens[b] = screened_row(a + b * a_stride, h + b * h_stride, w, norms, vocab, dim);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("screened_greedy_cpu(Tensor approx, Tensor hidden, Tensor weight, Tensor row_norms) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("screened_greedy_cpu", &screened_greedy_cpu); }
