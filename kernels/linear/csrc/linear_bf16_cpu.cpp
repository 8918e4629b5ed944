// A bf16 linear (y = x @ W^T + b, sums in fp32, y rounded to bf16 once) for CPUs with AVX512-BF16, on weights packed
// once into panels of 16 output columns, k in pairs: the layout VDPBF16PS reads.
//
// On an AMD Zen 4 (avx512_bf16, no AMX) oneDNN's bf16 GEMM streams a decode step's weights at 12-15 GB/s at 1-8 rows
// (W1's 32 body GEMMs, 47 MB of bf16, cold: 3.1-3.8 ms) where the machine reads 35-45 GB/s, and reaches 333 GFLOP/s
// at 64 rows against 400-430 at 2048. This is the fp32 panel kernel's shape (linear_cpu.cpp) in bf16: a 12 x 16 tile
// of y in twelve zmm accumulators; each step of k takes a pair: one load of the panel's 16 columns x 2 k (64 bytes),
// and per row one broadcast of the row's pair (32 bits) into a VDPBF16PS. Against oneDNN on that Zen 4, W1's 32
// GEMMs cold: 0.57-0.66 of its time at 1-8 rows (2.05-2.18 ms), 0.77-0.80 at 16-32, 0.91 at 64, 1.04-1.10 at
// 256-2048 (without the k chunks below, a down projection's K = 1408 took 1.05x at 64 rows and 1.22x at 256).
//
//   pack_linear_weight_bf16_cpu(weight [N, K] bfloat16) -> [N / 16, ceil(K / 2), 16, 2]: panel p holds output
//       columns 16p .. 16p + 15, each k-pair's 16 columns x 2 values together (an odd K padded with a zero k).
//   packed_linear_bf16_cpu(x [M, K] bfloat16 (rows contiguous), packed, bias [N] bfloat16?) -> [M, N] bfloat16
//
// Each y[m, n] is one fp32 chain of VDPBF16PS over the k-pairs in order (+ bias, then rounded to nearest even): the
// same on any thread count and row count, in another order than oneDNN's (so a bf16 output may differ by one unit in
// the last place). Blocking: x is repacked per block of 12 rows as [K / 2][rows] pairs (one stream); the threads split
// the panels, each thread's panels one contiguous stream from memory; per chunk of up to 192 rows and per panel, k
// runs in chunks of 256 pairs (16 KB of the panel, kept in L1 while the rows' blocks pass over it; the sums between
// chunks wait in an fp32 buffer [M, N], exactly), and the first row block of each chunk prefetches the stream kLead
// pairs (32 KB) ahead.

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LORAPLEX_LINEAR_BF16 1
#endif

namespace {

constexpr int64_t kPanel = 16;    // output columns per weight panel: one zmm of fp32 sums
constexpr int64_t kChunkM = 192;  // rows per pass over the panels
constexpr int64_t kChunkK = 256;  // k-pairs of a panel per pass over the rows: 16 KB of it, kept in L1
#ifdef LORAPLEX_LINEAR_BF16
constexpr int kRows = 12;         // rows per register tile: 12 zmm accumulators
constexpr int64_t kLead = 512;    // how far ahead (in k-pairs of a panel, 64 bytes each) the first block prefetches

// s[r] = (part_in ? part_in[r] : 0) + a_block[kp][R] . b_panel[kp][16][2] over kc pairs, for the tile's rows r < R
// (a: the block's pairs from this chunk's first, b: the panel at it); then part_out[r] = s[r] (more chunks follow)
// or y[r] = bf16(s[r] (+ bias)) (the last chunk). Partial rows are ldp floats apart. `lead`: also prefetch the panels'
// stream kLead pairs ahead.
template <int R>
inline void tile(const uint32_t* a, const c10::BFloat16* b, int64_t kc, const float* part_in, float* part_out,
                 int64_t ldp, c10::BFloat16* y, int64_t ldy, const float* bias, bool lead) {
  __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;  // named: arrays of __m512 spill to the stack
#define LORAPLEX_EACH_ROW(OP)                                                       \
  OP(0, c0) OP(1, c1) OP(2, c2) OP(3, c3) OP(4, c4) OP(5, c5) OP(6, c6) OP(7, c7) \
  OP(8, c8) OP(9, c9) OP(10, c10) OP(11, c11)
#define LORAPLEX_LOAD(r, x) \
  if constexpr (R > r) x = part_in ? _mm512_loadu_ps(part_in + r * ldp) : _mm512_setzero_ps();
  LORAPLEX_EACH_ROW(LORAPLEX_LOAD)
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * 2 * kPanel), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLead) * 2 * kPanel), _MM_HINT_T1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k * 2 * kPanel);
#define LORAPLEX_DOT(r, x) \
  if constexpr (R > r) x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_set1_epi32(static_cast<int>(a[k * R + r])), b0);
    LORAPLEX_EACH_ROW(LORAPLEX_DOT)
  }
  if (part_out) {
#define LORAPLEX_PART(r, x) \
  if constexpr (R > r) _mm512_storeu_ps(part_out + r * ldp, x);
    LORAPLEX_EACH_ROW(LORAPLEX_PART)
    return;
  }
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#define LORAPLEX_STORE(r, x)                                                        \
  if constexpr (R > r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), \
                                           (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(x, bias0) : x));
  LORAPLEX_EACH_ROW(LORAPLEX_STORE)
#undef LORAPLEX_EACH_ROW
#undef LORAPLEX_LOAD
#undef LORAPLEX_PART
#undef LORAPLEX_DOT
#undef LORAPLEX_STORE
}

// One panel's 16 columns of rows [0, m) over the pairs [k0, k0 + kc): x_packed holds the rows' blocks ([K / 2][kRows]
// pairs each, the last [K / 2][m % kRows]), the panel is at k0; part: the rows' partial sums (ldp floats apart), read
// unless k0 is 0 and written unless the chunk is the last (then y is). The first block leads the prefetch.
void panel_rows(const uint32_t* x_packed, int64_t kp2, int64_t k0, int64_t kc, const c10::BFloat16* panel,
                float* part, int64_t ldp, c10::BFloat16* y, int64_t ldy, int64_t m, const float* bias) {
  const bool first = k0 == 0, last = k0 + kc == kp2;
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows)
    tile<kRows>(x_packed + r * kp2 + k0 * kRows, panel, kc, first ? nullptr : part + r * ldp,
                last ? nullptr : part + r * ldp, ldp, y + r * ldy, ldy, bias, r == 0);
  const int64_t tail = m - r;
  const uint32_t* a = x_packed + r * kp2 + k0 * tail;
  const float* in = first ? nullptr : part + r * ldp;
  float* out = last ? nullptr : part + r * ldp;
  c10::BFloat16* y_tail = y + r * ldy;
  loraplex::with_count<kRows - 1>(tail, [&](auto rows) {
    tile<rows()>(a, panel, kc, in, out, ldp, y_tail, ldy, bias, r == 0);
  });
}

#endif  // LORAPLEX_LINEAR_BF16

}  // namespace

bool packed_linear_bf16_available() {
#ifdef LORAPLEX_LINEAR_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_bf16_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1), kp2 = (k + 1) / 2;
  TORCH_CHECK(n % kPanel == 0 && k >= 1, "weight: N (", n, ") must be a multiple of ", kPanel, " and K >= 1");
  at::Tensor padded = weight;
  if (k % 2) {  // an odd K: a zero k at the end, which x's repack pads with a zero too
    padded = at::zeros({n, 2 * kp2}, weight.options());
    padded.narrow(1, 0, k).copy_(weight);
  }
  // [N, K] -> [N / 16, 16, K / 2, 2] -> [N / 16, K / 2, 16, 2]
  return padded.reshape({n / kPanel, kPanel, kp2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor packed_linear_bf16_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed_linear_bf16_available(), "packed_linear_bf16_cpu: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && (x.size(1) <= 1 || x.stride(1) == 1),
              "x: [M, K] bfloat16 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), kp2 = (K + 1) / 2;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == kp2 && packed.size(2) == kPanel && packed.size(3) == 2,
              "packed: contiguous [N / 16, ceil(K / 2), 16, 2] bfloat16 with x's K (", K, ")");
  const int64_t panels = packed.size(0), N = panels * kPanel;
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N &&
                                    bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()),
              "bias: contiguous [", N, "] bfloat16");
  at::Tensor y = at::empty({M, N}, x.options());  // [M, N]
  if (M == 0) return y;
#ifdef LORAPLEX_LINEAR_BF16
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t ldx = x.stride(0);
  at::Tensor x_packed = at::empty({M * kp2}, x.options().dtype(at::kInt));  // the blocks of kRows rows' pairs
  auto* ap = reinterpret_cast<uint32_t*>(x_packed.data_ptr<int32_t>());
  const int64_t blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t m0 = block * kRows, rows = std::min<int64_t>(kRows, M - m0);
      uint32_t* dst = ap + m0 * kp2;  // [kp2][rows]
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = xs + (m0 + r) * ldx;
        for (int64_t p = 0; p < K / 2; ++p) {
          uint32_t pair;
          std::memcpy(&pair, row + 2 * p, sizeof(pair));
          dst[p * rows + r] = pair;
        }
        if (K % 2) dst[(kp2 - 1) * rows + r] = row[K - 1];  // the pad k is zero
      }
    }
  });
  at::Tensor bias_f32;  // the bias in fp32, added to the sums before they are rounded
  const float* bf = nullptr;
  if (bias.has_value()) {
    bias_f32 = bias->to(at::kFloat);
    bf = bias_f32.data_ptr<float>();
  }
  at::Tensor partial;  // [M, N] fp32: the sums between k chunks, where K has more than one
  float* part = nullptr;
  if (kp2 > kChunkK) {
    partial = at::empty({M, N}, x.options().dtype(at::kFloat));
    part = partial.data_ptr<float>();
  }
  const c10::BFloat16* w = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t m = std::min(kChunkM, M - m0);
      for (int64_t p = begin; p < end; ++p)
        for (int64_t k0 = 0; k0 < kp2; k0 += kChunkK)
          panel_rows(ap + m0 * kp2, kp2, k0, std::min(kChunkK, kp2 - k0), w + (p * kp2 + k0) * 2 * kPanel,
                     part ? part + m0 * N + p * kPanel : nullptr, N, out + m0 * N + p * kPanel, N, m,
                     bf ? bf + p * kPanel : nullptr);
    }
  });
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("pack_linear_weight_bf16_cpu(Tensor weight) -> Tensor");
  m.def("packed_linear_bf16_cpu(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("packed_linear_bf16_available() -> bool", []() { return packed_linear_bf16_available(); });
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("pack_linear_weight_bf16_cpu", &pack_linear_weight_bf16_cpu);
  m.impl("packed_linear_bf16_cpu", &packed_linear_bf16_cpu);
}
