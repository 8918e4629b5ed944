// An fp32 linear (y = x @ W^T + b) for AVX2 and AVX-512 CPUs, on weights packed once into panels of 16 output
// columns.
//
// On AVX2 machines (no AVX-512) oneDNN's fp32 GEMM reaches about 65% of the cores' FMA peak at a decode step's
// shapes (21-64 rows, K = 512-1536); this one reaches 75-90% on one core (a W1 decode step's GEMMs: 15-19% less
// time on 2 cores; prefill's 2048 rows about even), the classic register-blocked way: a 6 x 16 tile of y in twelve
// ymm accumulators, each step of k one broadcast of x per row and two loads of the weight panel.
//
//   pack_linear_weight_cpu(weight [N, K] float32) -> [N / 16, K, 16]: panel p holds output columns 16p .. 16p + 15,
//       k-major, so the micro-kernel reads 64 contiguous bytes per k. N must be a multiple of 16.
//   packed_linear_cpu(x [M, K] float32 (rows contiguous), packed [N / 16, K, 16], bias [N]?) -> [M, N] float32
//       (x bfloat16: linear_bf16_cpu.cpp's bf16 panels instead, packed by pack_linear_weight_bf16_cpu)
//
// Each y[m, n] is one fp32 FMA chain over k = 0 .. K-1 in order (then + bias): the same sum F.linear computes, in
// another order than oneDNN's or MKL's, and the same on any thread count. Blocking: x is repacked per tile's block
// of rows as [k][rows] (one stream instead of six or twelve); the threads split the panels; per chunk of up to 192 rows and per panel,
// k runs in chunks of 256 so the panel's chunk (16 KB) stays in L1 while the rows' blocks (in L2) pass over it.
// Built for AVX-512 (the compiler's target has AVX-512F), the tile is 12 x 16 instead: twelve zmm accumulators, one
// load of the panel and twelve FMAs with a broadcast operand per step of k; the same FMA chain per output, so the
// same bits as the AVX2 tile. On an AMD Zen 4 (whose 512-bit FMAs run on 256-bit units) a W1 step's 32 body GEMMs
// take 5.4-5.9 ms against oneDNN's 7.8-8.4 at 21 rows, 14.8-15.5 against 17.0-17.3 at 64, but 3-6% longer at 2048.
// A thread's panels are one contiguous stream from memory: the first row block of each chunk, the one that brings
// it in, also prefetches the stream 512 k-rows (32 KB) ahead into L2, so the next chunks arrive while this one
// computes (at 21 rows a chunk serves only 4 blocks, and with the hardware prefetcher alone the FMAs waited on memory:
// a W1 step's GEMMs took 1.25x as long at 21 rows, 1.10x at 64, 1.03x at 2048, this code on an AMD Zen 4).

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LORAPLEX_LINEAR_AVX2 1
#define LORAPLEX_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORAPLEX_LINEAR_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per weight panel: two ymm, or one zmm
#ifdef LORAPLEX_LINEAR_AVX512
constexpr int kRows = 12;  // rows per register tile: 12 zmm accumulators + the panel's vector
#else
constexpr int kRows = 6;  // rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast
#endif
constexpr int64_t kChunkK = 256;
constexpr int64_t kChunkM = 192;  // rows per pass over the panels: x's chunk (192 x 256 fp32, 192 KB) stays in L2
constexpr int64_t kLeadK = 512;   // how far ahead (in k-rows of a panel, 64 bytes each) the first block prefetches

#ifdef LORAPLEX_LINEAR_AVX512

// c[0 .. R, 0 .. 16) (+)= a_block[k][R] . b_panel[k][16] over kc steps of k; `first`: start from zero, else from c;
// `bias` (or null) is added as the tile is stored; `lead`: also prefetch the panels' stream kLeadK k-rows ahead.
template <int R>
inline void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool first, const float* bias,
                 bool lead) {
  __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;  // named: arrays of __m512 spill to the stack
// OP(r, the row's accumulator) for each of the tile's twelve rows (rows >= R compile to nothing).
#define LORAPLEX_EACH_ROW(OP)                                                       \
  OP(0, c0) OP(1, c1) OP(2, c2) OP(3, c3) OP(4, c4) OP(5, c5) OP(6, c6) OP(7, c7) \
  OP(8, c8) OP(9, c9) OP(10, c10) OP(11, c11)
#define LORAPLEX_LOAD(r, x) \
  if constexpr (R > r) x = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
  LORAPLEX_EACH_ROW(LORAPLEX_LOAD)
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * kPanel), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLeadK) * kPanel), _MM_HINT_T1);
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel);
#define LORAPLEX_FMA(r, x) \
  if constexpr (R > r) x = _mm512_fmadd_ps(_mm512_set1_ps(a[k * R + r]), b0, x);
    LORAPLEX_EACH_ROW(LORAPLEX_FMA)
  }
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#define LORAPLEX_STORE(r, x) \
  if constexpr (R > r) _mm512_storeu_ps(c + r * ldc, bias ? _mm512_add_ps(x, bias0) : x);
  LORAPLEX_EACH_ROW(LORAPLEX_STORE)
#undef LORAPLEX_EACH_ROW
#undef LORAPLEX_LOAD
#undef LORAPLEX_FMA
#undef LORAPLEX_STORE
}

#elif defined(LORAPLEX_LINEAR_AVX2)

// c[0 .. R, 0 .. 16) (+)= a_block[k][R] . b_panel[k][16] over kc steps of k; `first`: start from zero, else from c;
// `bias` (or null) is added as the tile is stored; `lead`: also prefetch the panels' stream kLeadK k-rows ahead.
template <int R>
inline void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool first, const float* bias,
                 bool lead) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;  // named: arrays of __m256 spill to the stack
// OP(r, the row's two accumulators) for each of the tile's six rows (rows >= R compile to nothing).
#define LORAPLEX_EACH_ROW(OP) \
  OP(0, c00, c01) OP(1, c10, c11) OP(2, c20, c21) OP(3, c30, c31) OP(4, c40, c41) OP(5, c50, c51)
#define LORAPLEX_LOAD(r, x0, x1)                                        \
  if constexpr (R > r) {                                                \
    x0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);     \
    x1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8); \
  }
  LORAPLEX_EACH_ROW(LORAPLEX_LOAD)
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * kPanel), _MM_HINT_T0);
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLeadK) * kPanel), _MM_HINT_T1);
    const __m256 b0 = _mm256_load_ps(b + k * kPanel), b1 = _mm256_load_ps(b + k * kPanel + 8);
    __m256 a_k;
#define LORAPLEX_FMA(r, x0, x1)                      \
  if constexpr (R > r) {                             \
    a_k = _mm256_broadcast_ss(a + k * R + r);        \
    x0 = _mm256_fmadd_ps(a_k, b0, x0);               \
    x1 = _mm256_fmadd_ps(a_k, b1, x1);               \
  }
    LORAPLEX_EACH_ROW(LORAPLEX_FMA)
  }
  const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define LORAPLEX_STORE(r, x0, x1)                                                    \
  if constexpr (R > r) {                                                             \
    _mm256_storeu_ps(c + r * ldc, bias ? _mm256_add_ps(x0, bias0) : x0);             \
    _mm256_storeu_ps(c + r * ldc + 8, bias ? _mm256_add_ps(x1, bias1) : x1);         \
  }
  LORAPLEX_EACH_ROW(LORAPLEX_STORE)
#undef LORAPLEX_EACH_ROW
#undef LORAPLEX_LOAD
#undef LORAPLEX_FMA
#undef LORAPLEX_STORE
}

#endif

#ifdef LORAPLEX_LINEAR_AVX2

// One panel's 16 columns of rows [0, m) over k in [k0, k0 + kc): x_packed holds the rows' blocks ([K][kRows] each,
// the last [K][m % kRows]), the panel is at k0. The first block leads the prefetch.
void panel_rows(const float* x_packed, int64_t K, int64_t k0, int64_t kc, const float* panel, float* c, int64_t ldc,
                int64_t m, bool first, const float* bias) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows)
    tile<kRows>(x_packed + r * K + k0 * kRows, panel, kc, c + r * ldc, ldc, first, bias, r == 0);
  const int64_t tail = m - r;
  const float* a = x_packed + r * K + k0 * tail;
  float* c_tail = c + r * ldc;
  loraplex::with_count<kRows - 1>(tail, [&](auto rows) {
    tile<rows()>(a, panel, kc, c_tail, ldc, first, bias, r == 0);
  });
}

#endif  // LORAPLEX_LINEAR_AVX2

}  // namespace

bool packed_linear_available() {
#ifdef LORAPLEX_LINEAR_AVX2
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: [N, K] float32");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0 && k >= 1, "weight: N (", n, ") must be a multiple of ", kPanel, " and K >= 1");
  return weight.reshape({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();  // [N / 16, K, 16]
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16) return packed_linear_bf16_cpu(x, packed, bias);  // linear_bf16_cpu.cpp
  TORCH_CHECK(packed_linear_available(), "packed_linear_cpu: this build has no AVX2 / FMA kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && (x.size(1) <= 1 || x.stride(1) == 1),
              "x: [M, K] float32 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(1) == x.size(1),
              "packed: contiguous [N / 16, K, 16] float32 with x's K (", x.size(1), ")");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * kPanel;
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous()),
              "bias: contiguous [", N, "] float32");
  at::Tensor y = at::empty({M, N}, x.options());  // [M, N]
  if (M == 0) return y;
#ifdef LORAPLEX_LINEAR_AVX2
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  at::Tensor x_packed = at::empty({M * K}, x.options());  // the blocks of kRows rows, each [K][rows]
  float* ap = x_packed.data_ptr<float>();
  const int64_t blocks = (M + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t m0 = block * kRows, rows = std::min<int64_t>(kRows, M - m0);
      float* dst = ap + m0 * K;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = a[(m0 + r) * lda + k];
    }
  });
  const float* w = packed.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t m = std::min(kChunkM, M - m0);
      for (int64_t p = begin; p < end; ++p)
        for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
          const int64_t kc = std::min(kChunkK, K - k0);
          const bool last = k0 + kc == K;
          panel_rows(ap + m0 * K, K, k0, kc, w + p * K * kPanel + k0 * kPanel, c + m0 * N + p * kPanel, N, m,
                     k0 == 0, last && b ? b + p * kPanel : nullptr);
        }
    }
  });
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("pack_linear_weight_cpu(Tensor weight) -> Tensor");
  m.def("packed_linear_cpu(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("packed_linear_available() -> bool", []() { return packed_linear_available(); });
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("pack_linear_weight_cpu", &pack_linear_weight_cpu);
  m.impl("packed_linear_cpu", &packed_linear_cpu);
}
