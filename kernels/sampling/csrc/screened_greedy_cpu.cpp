// Greedy tokens of an fp32 LM head without its full fp32 logits: approximate logits from a cheaper GEMM (bfloat16
// where the CPU has native bf16 dot products, int8 where it has VNNI) screen out every token that cannot be the fp32
// maximum, and only the few left are computed exactly, as fp32 dot products of the hidden state and the fp32 head
// rows.
//
// Why it is exact: each screen bounds |a_i - f_i|, a_i its approximate logit of token i and f_i the fp32 dot product
// h . w_i that the screen computes for a candidate, by bound_i. The largest f_i lies at or above L = max_i (a_i -
// bound_i), so every token whose f_i can reach the maximum has a_i + bound_i >= L. Those candidates are computed in
// fp32 and the first maximal one wins, as torch.argmax picks among equal values.
//
// bf16: with bf16 inputs (8 significant bits) and fp32 accumulation, a_i differs from the real h . w_i by at most
// 2^-7 sum_j |h_j w_ij| (both factors rounded) + K 2^-24 sum_j |h_j w_ij| (the sum) + 2^-8 |a_i| (the bf16 output),
// and sum_j |h_j w_ij| <= |h| |w_i|. Taking twice that, bound_i = 2^-6 |h| |w_i| + 2^-7 |a_i|.
//
// int8: the hidden state's channels split in two, a few (its outliers) taken exactly, x_i their fp32 part of the logit
// (a GEMM by the caller), the rest quantized: there h = s_h q_h + e_h (one scale a row, q_h in [-127, 127]) and
// w_i = s_i q_i + e_i (one scale a vocabulary row), their product s_h s_i (q_h . q_i) with the integer dot product
// exact in int32, and a_i = s_h s_i (q_h . q_i) + x_i. On the quantized channels h . w_i - s_h s_i (q_h . q_i) =
// h . e_i + e_h . (s_i q_i), so by Cauchy-Schwarz that error is at most |h| |e_i| + |e_h| |s_i q_i| (h and w_i
// restricted to those channels), the norms of the rounding errors known exactly (e_i's when the head is quantized,
// e_h's with h). The fp32 dot and x_i differ from the real ones by at most K 2^-24 |h| |w_i| each, and a_i's own
// float arithmetic by 4 2^-24 |a_i|: bound_i = 1.0625 (|h| |e_i| + |e_h| |s_i q_i|) + 2K 2^-24 |h| |w_i| (full rows)
// + 2^-20 |a_i|, the slack covering the float arithmetic of the bound and the screen.
//
//   screened_greedy_cpu(approx [B, V] bfloat16, hidden [B, H] float32, weight [V, H] float32, row_norms [V] float32)
//       -> [B] int64
//   screened_greedy_int8_cpu(dots [B, V] int32, exact [B, V] float32 or None (x), hidden [B, H] float32,
//                            hidden_terms [B, 3] float32 (s_h, |e_h|, |h| of the quantized channels),
//                            weight [V, H] float32, weight_terms [4, V] float32 (s_i, |e_i|, |s_i q_i| on the quantized
//                            channels, |w_i|), bf16_logits = False)
//       -> ([B] int64, [B] int64: each row's number of candidates computed in fp32)
//   bf16_logits: the head of a bf16 model (weight float32 or bfloat16), whose logits are its fp32 sums rounded to bf16
//   (h and w_i hold bf16 values): the token is the first maximum of the candidates' fp32 dot products rounded to bf16,
//   as the argmax of the model's own bf16 logits picks among the ties that rounding makes. A token ties the maximum
//   when its f_i rounds to the same bf16 value, so it may lie up to a bf16 spacing and a half below it (at most 1.5
//   2^-7 of it, the spacing below a power of two being half the one above): L is lowered by 2^-6 |L| (and by the
//   smallest normal float, for L near 0) before the candidates are taken. A candidate's fp32 sum runs in another order
//   than the model's GEMM, so where it lies within float rounding of a bf16 rounding boundary the two may round apart.
//   The tokens: each row's; -1 where a candidate's fp32 logit is NaN or infinite (the row's logits are not finite);
//   -2 where the screen cannot tell (an approximate logit is NaN or infinite): the caller then computes the full
//   logits.
//   allowed (either screen): [B, ceil(V / 32)] int32, bit i % 32 of word i / 32 set where row b may take token i
//   (a grammar's mask, llguidance's layout): a refused token screens as kRefused, finite and so low that with its
//   bound it lies below any allowed token's a_i - bound_i, so it is never a candidate and the token is the argmax of
//   the allowed tokens' fp32 logits. A row that allows no token gets any of them: the caller keeps such rows out.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

namespace {

using loraplex::BFloat16;
using loraplex::check_rows;
using loraplex::dispatch_float_bf16;
using loraplex::load_f32;
using loraplex::Vec;

constexpr float kProductBound = 1.f / 64;  // bf16: 2^-6, twice the products' and the fp32 sum's relative error
constexpr float kOutputBound = 1.f / 128;  // bf16: 2^-7, twice the bf16 output's rounding
constexpr float kInt8Slack = 1.0625f;  // int8: the margin on the Cauchy-Schwarz terms for float arithmetic
constexpr float kInt8OutputBound = 1.f / (1 << 20);  // int8: the approximate logit's float products, with margin
constexpr float kUlp = 1.f / (1 << 24);
constexpr float kBf16TieMargin = 1.f / 64;  // bf16 logits: 2^-6, above the 1.5 2^-7 a tie can lie below

constexpr float kRefused = -3.0e38f;  // a refused token's approximate logit: finite, its bound 2^-7 of it at most

// a . b in fp32, b float32 or bfloat16 (widened: the products of bf16 values are exact in fp32).
template <typename W>
float dot(const float* a, const W* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), load_f32(b + j), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; j < n; ++j) sum += a[j] * static_cast<float>(b[j]);
  return sum;
}

// A screen of one row: value(i) gives tokens i .. i + lanes - 1's approximate logits, bound(i, a) their bounds
// (value1 / bound1: one token, for the tail of the vocabulary).
struct Bf16Screen {
  const BFloat16* approx;
  const float* norms;
  float scale;  // kProductBound |h|

  Vec value(int64_t i) const { return load_f32(approx + i); }
  float value1(int64_t i) const { return static_cast<float>(approx[i]); }
  Vec bound(int64_t i, const Vec& a) const {
    return at::vec::fmadd(Vec(scale), Vec::loadu(norms + i), Vec(kOutputBound) * a.abs());
  }
  float bound1(int64_t i, float a) const { return scale * norms[i] + kOutputBound * std::abs(a); }
};

struct Int8Screen {
  const int32_t* dots;
  const float* exact;  // x_i: the logit's part from the channels taken exactly; nullptr: none
  const float* w_scale;  // s_i
  const float* w_error;  // |e_i|
  const float* w_quantized;  // |s_i q_i| on the quantized channels
  const float* w_norm;  // |w_i|
  float h_scale, c_error, c_quantized, c_norm;  // s_h, 1.0625 |h_q|, 1.0625 |e_h|, 2K 2^-24 |h|

  Vec value(int64_t i) const {
    float lane[Vec::size()];
    for (int64_t l = 0; l < Vec::size(); ++l) lane[l] = static_cast<float>(dots[i + l]);
    const Vec a = Vec::loadu(lane) * Vec(h_scale) * Vec::loadu(w_scale + i);
    return exact == nullptr ? a : a + Vec::loadu(exact + i);
  }
  float value1(int64_t i) const {
    const float a = static_cast<float>(dots[i]) * h_scale * w_scale[i];
    return exact == nullptr ? a : a + exact[i];
  }
  Vec bound(int64_t i, const Vec& a) const {
    Vec b = at::vec::fmadd(Vec(c_error), Vec::loadu(w_error + i), Vec(kInt8OutputBound) * a.abs());
    b = at::vec::fmadd(Vec(c_quantized), Vec::loadu(w_quantized + i), b);
    return at::vec::fmadd(Vec(c_norm), Vec::loadu(w_norm + i), b);
  }
  float bound1(int64_t i, float a) const {
    return c_error * w_error[i] + c_quantized * w_quantized[i] + c_norm * w_norm[i] + kInt8OutputBound * std::abs(a);
  }
};

// A screen whose refused tokens (allowed's bit clear) screen as kRefused (see the top of the file). value(i) takes
// i a multiple of the lanes (8 or 16), whose bits then lie in one word.
template <class Inner>
struct MaskedScreen {
  Inner inner;
  const int32_t* allowed;  // [ceil(V / 32)] words

  static constexpr uint32_t kAll = (Vec::size() >= 32) ? ~0u : (1u << Vec::size()) - 1;

  uint32_t lane_bits(int64_t i) const { return (static_cast<uint32_t>(allowed[i >> 5]) >> (i & 31)) & kAll; }
  Vec value(int64_t i) const {
    const uint32_t bits = lane_bits(i);
    if (bits == 0) return Vec(kRefused);
    const Vec a = inner.value(i);
    if (bits == kAll) return a;
    float lane[Vec::size()];
    a.store(lane);
    for (int64_t l = 0; l < Vec::size(); ++l)
      if (!(bits >> l & 1)) lane[l] = kRefused;
    return Vec::loadu(lane);
  }
  float value1(int64_t i) const {
    return (static_cast<uint32_t>(allowed[i >> 5]) >> (i & 31) & 1) ? inner.value1(i) : kRefused;
  }
  Vec bound(int64_t i, const Vec& a) const { return inner.bound(i, a); }
  float bound1(int64_t i, float a) const { return inner.bound1(i, a); }
};

// allowed [B, ceil(V / 32)] int32, or none (checked).
const int32_t* allowed_words(const std::optional<at::Tensor>& allowed, int64_t num_rows, int64_t vocab) {
  if (!allowed.has_value()) return nullptr;
  TORCH_CHECK(allowed->dim() == 2 && allowed->scalar_type() == at::kInt && allowed->is_contiguous() &&
                  allowed->size(0) == num_rows && allowed->size(1) == (vocab + 31) / 32,
              "allowed: contiguous [", num_rows, ", ", (vocab + 31) / 32, "] int32");
  return allowed->data_ptr<int32_t>();
}

// The first token of the row's largest fp32 logit among the screen's candidates (see the top of the file); adds the
// number of candidates to *candidates. bf16_logits: of the largest fp32 logit rounded to bf16, ties taken in.
template <class Screen, typename W>
int64_t screened_row(const Screen& screen, const float* h, const W* weight, int64_t vocab, int64_t hidden,
                     int64_t* candidates, bool bf16_logits = false) {
  constexpr int64_t kLanes = Vec::size();
  const int64_t body = vocab / kLanes * kLanes;
  Vec lowest(-std::numeric_limits<float>::infinity()), poison(0.f);
  for (int64_t i = 0; i < body; i += kLanes) {  // L = max_i (a_i - bound_i)
    const Vec a = screen.value(i);
    poison = poison + a * Vec(0.f);  // 0 for finite values, NaN from the first NaN or infinity on
    lowest = at::vec::maximum(lowest, a - screen.bound(i, a));
  }
  float lane[kLanes];
  poison.store(lane);
  for (int64_t l = 0; l < kLanes; ++l)
    if (lane[l] != 0.f) return -2;
  float floor = lowest.reduce_max();
  for (int64_t i = body; i < vocab; ++i) {
    const float a = screen.value1(i);
    if (!std::isfinite(a)) return -2;
    floor = std::max(floor, a - screen.bound1(i, a));
  }
  if (bf16_logits) floor -= kBf16TieMargin * std::abs(floor) + std::numeric_limits<float>::min();
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_at = -1;
  auto consider = [&](int64_t i) {  // ascending i: the first of equal maxima stays
    ++*candidates;
    float exact = dot(h, weight + i * hidden, hidden);
    if (bf16_logits) exact = static_cast<float>(BFloat16(exact));  // NaN and infinities stay what they are
    if (!std::isfinite(exact)) return false;
    if (exact > best) best = exact, best_at = i;
    return true;
  };
  const Vec vfloor(floor);
  for (int64_t i = 0; i < body; i += kLanes) {
    const Vec a = screen.value(i);
    const Vec upper = a + screen.bound(i, a);
    const int below = (upper >= vfloor).zero_mask();  // bit l set: lane l cannot reach the maximum
    if (below == (1 << kLanes) - 1) continue;
    for (int64_t l = 0; l < kLanes; ++l)
      if (!(below >> l & 1) && !consider(i + l)) return -1;
  }
  for (int64_t i = body; i < vocab; ++i) {
    const float a = screen.value1(i);
    if (a + screen.bound1(i, a) >= floor && !consider(i)) return -1;
  }
  return best_at;
}

// |h|, or NaN / infinity where h holds one (which then reaches every logit: the row has no token).
float norm(const float* h, int64_t hidden) { return std::sqrt(dot(h, h, hidden)); }

// Screens each row of hidden [num_rows, dim] (row stride h_stride): tokens[b] as screened_row gives it with the
// screen make_screen(b, |h_b|) builds (-1 where h_b is not finite), candidates[b] (nullptr: not kept) its count;
// bf16_logits as for screened_greedy_int8_cpu (top of the file).
template <class MakeScreen, typename W>
void screen_rows(int64_t num_rows, const float* h, int64_t h_stride, int64_t dim, const W* weight, int64_t vocab,
                 const MakeScreen& make_screen, int64_t* tokens, int64_t* candidates, bool bf16_logits = false) {
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = h + b * h_stride;
      const float h_norm = norm(row, dim);
      int64_t count = 0;
      tokens[b] = std::isfinite(h_norm)
                      ? screened_row(make_screen(b, h_norm), row, weight, vocab, dim, &count, bf16_logits)
                      : -1;
      if (candidates != nullptr) candidates[b] = count;
    }
  });
}

// Screens the rows as screen_rows does, each row's screen masked by its allowed words where there are any.
template <class MakeScreen, typename W>
void screen_rows_masked(int64_t num_rows, const float* h, int64_t h_stride, int64_t dim, const W* weight,
                        int64_t vocab, const MakeScreen& make_screen, const int32_t* allowed, int64_t* tokens,
                        int64_t* candidates, bool bf16_logits) {
  if (allowed == nullptr) {
    screen_rows(num_rows, h, h_stride, dim, weight, vocab, make_screen, tokens, candidates, bf16_logits);
    return;
  }
  const int64_t words = (vocab + 31) / 32;
  auto make_masked = [&](int64_t b, float h_norm) {
    return MaskedScreen<decltype(make_screen(b, h_norm))>{make_screen(b, h_norm), allowed + b * words};
  };
  screen_rows(num_rows, h, h_stride, dim, weight, vocab, make_masked, tokens, candidates, bf16_logits);
}

void check_weight(const at::Tensor& weight, int64_t vocab, int64_t dim, bool bf16_too = false) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || (bf16_too && weight.scalar_type() == at::kBFloat16)),
              "weight: contiguous [V, H] float32", bf16_too ? " or bfloat16" : "");
  TORCH_CHECK(weight.size(0) == vocab && weight.size(1) == dim, "weight must be [", vocab, ", ", dim, "]");
}

}  // namespace

at::Tensor screened_greedy_cpu(const at::Tensor& approx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& row_norms, const std::optional<at::Tensor>& allowed) {
  check_rows(approx, "approx", at::kBFloat16);
  check_rows(hidden, "hidden");
  const int64_t num_rows = approx.size(0), vocab = approx.size(1), dim = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == num_rows, "hidden has ", hidden.size(0), " rows, approx ", num_rows);
  check_weight(weight, vocab, dim);
  TORCH_CHECK(row_norms.dim() == 1 && row_norms.scalar_type() == at::kFloat && row_norms.is_contiguous() &&
                  row_norms.size(0) == vocab,
              "row_norms: contiguous [", vocab, "] float32");
  auto out = at::empty({num_rows}, approx.options().dtype(at::kLong));
  const BFloat16* a = approx.data_ptr<at::BFloat16>();
  const float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* norms = row_norms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t a_stride = approx.stride(0);
  auto make_screen = [&](int64_t b, float h_norm) {
    return Bf16Screen{a + b * a_stride, norms, kProductBound * h_norm};
  };
  screen_rows_masked(num_rows, h, hidden.stride(0), dim, w, vocab, make_screen, allowed_words(allowed, num_rows, vocab),
                     tokens, nullptr, false);
  return out;
}

std::tuple<at::Tensor, at::Tensor> screened_greedy_int8_cpu(const at::Tensor& dots,
                                                             const std::optional<at::Tensor>& exact,
                                                             const at::Tensor& hidden, const at::Tensor& hidden_terms,
                                                             const at::Tensor& weight, const at::Tensor& weight_terms,
                                                             bool bf16_logits,
                                                             const std::optional<at::Tensor>& allowed) {
  check_rows(dots, "dots", at::kInt);
  check_rows(hidden, "hidden");
  const int64_t num_rows = dots.size(0), vocab = dots.size(1), dim = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == num_rows, "hidden has ", hidden.size(0), " rows, dots ", num_rows);
  if (exact.has_value()) {
    check_rows(*exact, "exact");
    TORCH_CHECK(exact->size(0) == num_rows && exact->size(1) == vocab, "exact must be [", num_rows, ", ", vocab, "]");
  }
  TORCH_CHECK(hidden_terms.dim() == 2 && hidden_terms.size(0) == num_rows && hidden_terms.size(1) == 3 &&
                  hidden_terms.scalar_type() == at::kFloat && hidden_terms.is_contiguous(),
              "hidden_terms: contiguous [", num_rows, ", 3] float32");
  check_weight(weight, vocab, dim, /*bf16_too=*/true);
  TORCH_CHECK(weight_terms.dim() == 2 && weight_terms.size(0) == 4 && weight_terms.size(1) == vocab &&
                  weight_terms.scalar_type() == at::kFloat && weight_terms.is_contiguous(),
              "weight_terms: contiguous [4, ", vocab, "] float32");
  auto out = at::empty({num_rows}, dots.options().dtype(at::kLong));
  auto counts = at::empty({num_rows}, dots.options().dtype(at::kLong));
  const int32_t* d = dots.data_ptr<int32_t>();
  const float* x = exact.has_value() ? exact->data_ptr<float>() : nullptr;
  const float* h = hidden.data_ptr<float>();
  const float* h_terms = hidden_terms.data_ptr<float>();
  const float* w_terms = weight_terms.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  int64_t* candidates = counts.data_ptr<int64_t>();
  const int64_t d_stride = dots.stride(0), x_stride = exact.has_value() ? exact->stride(0) : 0;
  auto make_screen = [&](int64_t b, float h_norm) {
    const float* terms = h_terms + 3 * b;  // s_h, |e_h|, |h_q|
    return Int8Screen{d + b * d_stride,
                      x == nullptr ? nullptr : x + b * x_stride,
                      w_terms,
                      w_terms + vocab,
                      w_terms + 2 * vocab,
                      w_terms + 3 * vocab,
                      terms[0],
                      kInt8Slack * terms[2],
                      kInt8Slack * terms[1],
                      2.f * static_cast<float>(dim) * kUlp * h_norm};
  };
  dispatch_float_bf16(weight.scalar_type(), "weight", [&](auto tag) {
    using W = decltype(tag);
    screen_rows_masked(num_rows, h, hidden.stride(0), dim, weight.data_ptr<W>(), vocab, make_screen,
                       allowed_words(allowed, num_rows, vocab), tokens, candidates, bf16_logits);
  });
  return std::make_tuple(out, counts);
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def(
      "screened_greedy_cpu(Tensor approx, Tensor hidden, Tensor weight, Tensor row_norms, Tensor? allowed=None) -> "
      "Tensor");
  m.def(
      "screened_greedy_int8_cpu(Tensor dots, Tensor? exact, Tensor hidden, Tensor hidden_terms, Tensor weight, "
      "Tensor weight_terms, bool bf16_logits=False, Tensor? allowed=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("screened_greedy_cpu", &screened_greedy_cpu);
  m.impl("screened_greedy_int8_cpu", &screened_greedy_int8_cpu);
}
