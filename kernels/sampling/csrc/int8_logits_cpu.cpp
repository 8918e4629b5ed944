// The int8 screened head's inputs at a decode step's few rows, in one call: each hidden row quantized (one scale a
// row, on the head's quantized channels) and its int8 dot products with every head row, one pass over the head.
//
// At one to three rows the int8 head is a stream of its weight (16 MB for W1's 32000 x 512, half the bf16 copy's
// bytes) with little arithmetic, and the quantization of a few hidden rows is a dozen small torch ops run cold
// between steps. Here the rows are quantized first (as engine/layers/greedy_head.py's _quantize_rows does: scale =
// max |x| / 127, q = round-half-even(x / scale) in [-127, 127]) and turned unsigned (q + 128, as VPDPBUSD wants one
// operand), then each thread reads its range of head rows once, in order: each 64-byte chunk of a row goes into every
// hidden row by one VPDPBUSD, and into the row's sum by one more (against ones), so that
// q_h . q_v = (q_h + 128) . q_v - 128 sum(q_v), exact in int32 (|terms| <= 255 * 127 * H < 2^31 for H < 66,000).
// A software prefetch runs 4 KB ahead, as in bf16_logits_cpu.cpp. Without VNNI (AVX2 CPUs: AMD Zen 3 and older,
// Intel before Ice Lake and Cascade Lake) the rows stay signed, widened to int16 once, and each 16-byte chunk of a head
// row is widened to int16 and multiplied into them by VPMADDWD (pairs of products of at most 127 * 127: exact in
// int32): more instructions a byte, still a stream of the int8 head at a few rows. The screen's bound
// (screened_greedy_cpu.cpp) takes the quantization's error norms from the rows themselves (|e_h|, computed here in
// double from the same q and scale).
//
//   int8_logits_cpu(hidden [B, H] float32 contiguous, channels [Hq] int64 or None (the quantized channels; None: all
//                   H), weight [V, Hq] int8 contiguous)
//       -> (dots [B, V] int32: q_h . q_v, hidden_terms [B, 3] float32: s_h, |e_h|, |h| on the quantized channels)
//   int8_logits_available() -> bool: whether this build has it (the compiler's target has AVX512-VNNI or AVX2)

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LORAPLEX_INT8_LOGITS 1
#define LORAPLEX_INT8_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define LORAPLEX_INT8_LOGITS 1
#endif

namespace {

#ifdef LORAPLEX_INT8_LOGITS

#ifdef LORAPLEX_INT8_VNNI
constexpr int64_t kLanes = 64;  // int8 elements a VPDPBUSD takes from each operand
using HiddenValue = uint8_t;    // q + 128: VPDPBUSD's unsigned operand
constexpr int kOffset = 128;
#else
constexpr int64_t kLanes = 16;  // int8 elements a chunk widens to int16 for VPMADDWD (AVX2, no VNNI)
using HiddenValue = int16_t;    // q itself, widened once
constexpr int kOffset = 0;
#endif
constexpr int kBlockRows = 8;        // hidden rows a pass over a head row serves
constexpr int64_t kLead = 4096;      // int8 elements a step prefetches ahead of its chunk (4 KB)
constexpr int64_t kGrainRows = 512;  // head rows a thread takes at least (256 KB of W1's head)
constexpr float kInt8Max = 127.f;

// One hidden row quantized: writes q + kOffset to out (dim values, then zeros to padded), returns (scale, |e|, |x|).
std::tuple<float, float, float> quantize_row(const float* x, const int64_t* channels, int64_t dim, HiddenValue* hq,
                                             int64_t padded) {
  float amax = 0.f;
  for (int64_t k = 0; k < dim; ++k) amax = std::max(amax, std::fabs(x[channels ? channels[k] : k]));
  const float scale = std::max(amax, std::numeric_limits<float>::min()) / kInt8Max;
  double error = 0.0, norm = 0.0;
  for (int64_t k = 0; k < dim; ++k) {
    const float value = x[channels ? channels[k] : k];
    const float q = std::min(kInt8Max, std::max(-kInt8Max, std::nearbyint(value / scale)));
    const double e = static_cast<double>(value) - static_cast<double>(q) * scale;
    error += e * e;
    norm += static_cast<double>(value) * value;
    hq[k] = static_cast<HiddenValue>(static_cast<int>(q) + kOffset);
  }
  std::fill(hq + dim, hq + padded, HiddenValue(0));  // a padded lane adds 0 * 0
  return {scale, static_cast<float>(std::sqrt(error)), static_cast<float>(std::sqrt(norm))};
}

#ifdef LORAPLEX_INT8_VNNI

template <bool Whole>
inline __m512i load_chunk(const int8_t* p, int64_t k, int64_t dim) {
  if constexpr (Whole) return _mm512_loadu_si512(p + k);
  const int64_t left = dim - k;
  const __mmask64 mask = left >= kLanes ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
  return _mm512_maskz_loadu_epi8(mask, p + k);
}

// out[b0 + i, v] for i < NB: head row v against hidden rows b0 .. b0 + NB (unsigned, padded to `padded`), read once.
template <int NB, bool Whole>
void head_row(const HiddenValue* h, int64_t padded, int64_t b0, const int8_t* row, int64_t dim, int64_t v,
              int32_t* out, int64_t vocab) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[NB], sum = _mm512_setzero_si512();
  for (int i = 0; i < NB; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < dim; k += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kLead + k), _MM_HINT_T0);
    const __m512i w = load_chunk<Whole>(row, k, dim);
    sum = _mm512_dpbusd_epi32(sum, ones, w);
    for (int i = 0; i < NB; ++i) {
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512(h + (b0 + i) * padded + k), w);
    }
  }
  const int32_t offset = 128 * _mm512_reduce_add_epi32(sum);
  for (int i = 0; i < NB; ++i) out[(b0 + i) * vocab + v] = _mm512_reduce_add_epi32(acc[i]) - offset;
}

#else

// 16 int8 values of p from k widened to int16, those at or past dim read as zero (Whole: dim is a multiple of 16).
template <bool Whole>
inline __m256i load_chunk(const int8_t* p, int64_t k, int64_t dim) {
  if constexpr (!Whole) {
    if (k >= dim) return _mm256_setzero_si256();
    if (dim - k < kLanes) {
      alignas(16) int8_t tail[kLanes] = {};
      std::copy(p + k, p + dim, tail);
      return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
    }
  }
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k)));
}

inline int32_t reduce_add(__m256i x) {
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, _MM_SHUFFLE(2, 3, 0, 1))));
}

// The same without VNNI: each 16-element chunk of the head row widened to int16 once, VPMADDWD into every hidden row
// (pairs of products of at most 127 * 127 each: exact in int32), two accumulators a hidden row.
template <int NB, bool Whole>
void head_row(const HiddenValue* h, int64_t padded, int64_t b0, const int8_t* row, int64_t dim, int64_t v,
              int32_t* out, int64_t vocab) {
  __m256i even[NB], odd[NB];
  for (int i = 0; i < NB; ++i) even[i] = odd[i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < dim; k += 2 * kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kLead + k), _MM_HINT_T0);
    const __m256i w0 = load_chunk<Whole>(row, k, dim), w1 = load_chunk<Whole>(row, k + kLanes, dim);
    for (int i = 0; i < NB; ++i) {
      const HiddenValue* hb = h + (b0 + i) * padded + k;  // padded to 2 * kLanes: the odd chunk is there
      even[i] = _mm256_add_epi32(even[i], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)hb), w0));
      odd[i] = _mm256_add_epi32(odd[i], _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(hb + kLanes)), w1));
    }
  }
  for (int i = 0; i < NB; ++i) out[(b0 + i) * vocab + v] = reduce_add(_mm256_add_epi32(even[i], odd[i]));
}

#endif

template <bool Whole>
void head_rows(const HiddenValue* h, int64_t padded, int64_t num_rows, const int8_t* w, int64_t dim, int64_t begin,
               int64_t end, int32_t* out, int64_t vocab) {
  for (int64_t v = begin; v < end; ++v) {
    const int8_t* row = w + v * dim;
    int64_t b = 0;
    for (; b + kBlockRows <= num_rows; b += kBlockRows) head_row<kBlockRows, Whole>(h, padded, b, row, dim, v, out, vocab);
    loraplex::with_count<kBlockRows - 1>(num_rows - b, [&](auto rows) {  // the last block's rows, from L1
      head_row<rows(), Whole>(h, padded, b, row, dim, v, out, vocab);
    });
  }
}

#endif

std::tuple<at::Tensor, at::Tensor> int8_logits_cpu(const at::Tensor& hidden, const std::optional<at::Tensor>& channels,
                                                   const at::Tensor& weight) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "hidden: contiguous [B, H] float32");
  const int64_t dim = channels ? channels->numel() : hidden.size(1);
  if (channels) {
    TORCH_CHECK(channels->dim() == 1 && channels->scalar_type() == at::kLong && channels->is_contiguous(),
                "channels: contiguous [Hq] int64");
  }
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) == dim,
              "weight: contiguous [V, ", dim, "] int8");
#ifdef LORAPLEX_INT8_LOGITS
  const int64_t num_rows = hidden.size(0), width = hidden.size(1), vocab = weight.size(0);
  const int64_t step = kOffset ? kLanes : 2 * kLanes;  // the AVX2 loop takes two chunks a step
  const int64_t padded = (dim + step - 1) / step * step;
  const int64_t* ch = channels ? channels->data_ptr<int64_t>() : nullptr;
  if (ch) {
    for (int64_t k = 0; k < dim; ++k) TORCH_CHECK(ch[k] >= 0 && ch[k] < width, "channels: out of [0, ", width, ")");
  }
  // [B, Hq padded]: q + 128 as uint8 (VNNI), or q as int16 (AVX2)
  auto rows = at::empty({num_rows, padded * int64_t(sizeof(HiddenValue))}, hidden.options().dtype(at::kByte));
  auto terms = at::empty({num_rows, 3}, hidden.options());  // [B, 3]
  auto* hq = reinterpret_cast<HiddenValue*>(rows.data_ptr<uint8_t>());
  auto* t = terms.data_ptr<float>();
  const auto* x = hidden.data_ptr<float>();
  for (int64_t b = 0; b < num_rows; ++b) {
    const auto [scale, error, norm] = quantize_row(x + b * width, ch, dim, hq + b * padded, padded);
    t[3 * b] = scale, t[3 * b + 1] = error, t[3 * b + 2] = norm;
  }
  auto dots = at::empty({num_rows, vocab}, hidden.options().dtype(at::kInt));  // [B, V]
  const auto* w = weight.data_ptr<int8_t>();
  auto* o = dots.data_ptr<int32_t>();
  at::parallel_for(0, vocab, kGrainRows, [&](int64_t begin, int64_t end) {
    if (dim % step == 0) {
      head_rows<true>(hq, padded, num_rows, w, dim, begin, end, o, vocab);
    } else {
      head_rows<false>(hq, padded, num_rows, w, dim, begin, end, o, vocab);
    }
  });
  return {dots, terms};
#else
  TORCH_CHECK(false, "int8_logits_cpu needs a build for a CPU with AVX512-VNNI or AVX2");
#endif
}

bool int8_logits_available() {
#ifdef LORAPLEX_INT8_LOGITS
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("int8_logits_cpu(Tensor hidden, Tensor? channels, Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_logits_available() -> bool", []() { return int8_logits_available(); });
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("int8_logits_cpu", &int8_logits_cpu); }
