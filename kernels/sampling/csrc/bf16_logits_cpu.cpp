// The screened greedy head's approximate logits at a decode step's few rows: approx = hidden . weight^T with bf16
// inputs and fp32 sums (avx512_bf16's dot product), stored in bf16, one pass over the head's rows.
//
// With a few hidden rows the head is a stream of its bf16 weight (32 MB for W1's 32000 x 512) and little arithmetic;
// oneDNN's prepacked bf16 GEMM took 1.7-2.4 ms for one row with the weight cold (~16 GB/s) on a 2-core AMD Zen 4
// that sums a cold 32 MB bf16 tensor in 0.9-1.3 ms. Here each thread takes a contiguous range of the vocabulary and
// reads it once, in order, row by row: each 32-element chunk of a row is multiplied into every hidden row (bf16, in
// L1) by one VDPBF16PS, two accumulators a hidden row (even and odd chunks); each sum is reduced and rounded to bf16.
// Walking four rows side by side instead (four streams 1 KB apart) took 1.4x as long cold, and the hardware
// prefetcher alone left the loads waiting once a row served four hidden rows or more: each chunk's step prefetches
// the chunk kLead elements (4 KB) ahead. Paired with oneDNN's calls on that Zen 4: 0.66-0.88 of its time at 1-3
// rows, 0.9-1.05 at 4-8, 1.2-1.3 at 16 (the arithmetic then counts, which oneDNN blocks better). A prefetch past the
// weight's end is harmless: prefetches do not fault. The screen's error bound (screened_greedy_cpu.cpp) holds for
// any order of the fp32 sum: the product of two bf16 values is exact in fp32.
//
//   bf16_logits_cpu(hidden [B, H] bfloat16, weight [V, H] bfloat16, both contiguous) -> [B, V] bfloat16
//   bf16_logits_available() -> bool: whether this build has it (the compiler's target has AVX512-BF16)

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LORAPLEX_BF16_LOGITS 1
#endif

namespace {

#ifdef LORAPLEX_BF16_LOGITS

constexpr int64_t kLanes = 32;       // bf16 elements a VDPBF16PS takes from each operand
constexpr int kBlockRows = 8;        // hidden rows a pass over a head row serves (two accumulators each)
constexpr int64_t kLead = 2048;      // bf16 elements a step prefetches ahead of its chunk (4 KB)
constexpr int64_t kGrainRows = 256;  // head rows a thread takes at least (256 KB of W1's head)

// bf16 elements [k, k + 32) of p, those at or past dim read as zero (Whole: dim is a multiple of 64, no mask).
template <bool Whole>
inline __m512bh load_chunk(const c10::BFloat16* p, int64_t k, int64_t dim) {
  if constexpr (Whole) return (__m512bh)_mm512_loadu_si512(p + k);
  const int64_t left = dim - k;
  const __mmask32 mask = left >= kLanes ? ~__mmask32(0) : left <= 0 ? __mmask32(0) : (__mmask32(1) << left) - 1;
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + k);
}

// out[b0 + i, v] for i < NB: head row v against hidden rows b0 .. b0 + NB, the row read in order; two accumulators
// a hidden row (even and odd chunks) halve the chain of dependent dot products.
template <int NB, bool Whole>
void head_row(const c10::BFloat16* h, int64_t b0, const c10::BFloat16* row, int64_t dim, int64_t v,
              c10::BFloat16* out, int64_t vocab) {
  __m512 even[NB], odd[NB];
  for (int i = 0; i < NB; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < dim; k += 2 * kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kLead + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + kLead + k + kLanes), _MM_HINT_T0);
    const __m512bh w0 = load_chunk<Whole>(row, k, dim), w1 = load_chunk<Whole>(row, k + kLanes, dim);
    for (int i = 0; i < NB; ++i) {
      const c10::BFloat16* hb = h + (b0 + i) * dim;
      even[i] = _mm512_dpbf16_ps(even[i], load_chunk<Whole>(hb, k, dim), w0);
      odd[i] = _mm512_dpbf16_ps(odd[i], load_chunk<Whole>(hb, k + kLanes, dim), w1);
    }
  }
  for (int i = 0; i < NB; ++i) {
    out[(b0 + i) * vocab + v] = c10::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])));
  }
}

template <bool Whole>
void head_rows(const c10::BFloat16* h, int64_t num_rows, const c10::BFloat16* w, int64_t dim, int64_t begin,
               int64_t end, c10::BFloat16* out, int64_t vocab) {
  for (int64_t v = begin; v < end; ++v) {
    const c10::BFloat16* row = w + v * dim;
    int64_t b = 0;
    for (; b + kBlockRows <= num_rows; b += kBlockRows) head_row<kBlockRows, Whole>(h, b, row, dim, v, out, vocab);
    loraplex::with_count<kBlockRows - 1>(num_rows - b, [&](auto rows) {  // the last block's rows, from L1
      head_row<rows(), Whole>(h, b, row, dim, v, out, vocab);
    });
  }
}

#endif

at::Tensor bf16_logits_cpu(const at::Tensor& hidden, const at::Tensor& weight) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 && hidden.is_contiguous(),
              "hidden: contiguous [B, H] bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == hidden.size(1),
              "weight: contiguous [V, ", hidden.size(1), "] bfloat16");
#ifdef LORAPLEX_BF16_LOGITS
  const int64_t num_rows = hidden.size(0), dim = hidden.size(1), vocab = weight.size(0);
  auto out = at::empty({num_rows, vocab}, hidden.options());  // [B, V]
  const auto* h = hidden.data_ptr<c10::BFloat16>();
  const auto* w = weight.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, vocab, kGrainRows,
                   [&](int64_t begin, int64_t end) {
    if (dim % (2 * kLanes) == 0) {
      head_rows<true>(h, num_rows, w, dim, begin, end, o, vocab);
    } else {
      head_rows<false>(h, num_rows, w, dim, begin, end, o, vocab);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_logits_cpu needs a build for a CPU with AVX512-BF16");
#endif
}

bool bf16_logits_available() {
#ifdef LORAPLEX_BF16_LOGITS
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("bf16_logits_cpu(Tensor hidden, Tensor weight) -> Tensor");
  m.def("bf16_logits_available() -> bool", []() { return bf16_logits_available(); });
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("bf16_logits_cpu", &bf16_logits_cpu); }
