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
// another order than oneDNN's or MKL's, and the same on any thread count, in any tile and in a batch of any size.
// Blocking: the threads split the panels (in pairs with AVX-512); per chunk of rows (kChunkM) and per panel, k runs
// in chunks of 256 so the panels' chunk (16 KB each) stays in L1 while the rows (in L2) pass over it. The tiles read x
// where it lies with AVX-512, one stream per row (until 2026-12-01 x was first repacked per tile as [k][rows], one
// stream; that copy cost 3-18% of a 2048-row GEMM on a Xeon, the most where N is small). With AVX2 x is repacked:
// read in place, W1's 32 body GEMMs on an AMD Zen 3 (family 25 model 1, 2 threads, weights cold; 2026-12-06) took
// 1.17-1.29x oneDNN's time at 256-2048 rows and 0.8-1.1x at 21-64, against 1.04-1.10x and 0.69-0.88x repacked.
// Built for AVX-512 (the compiler's target has AVX-512F), the tile is 14 rows x 2 panels: 28 zmm accumulators, two
// loads of the panels and 28 FMAs on 14 broadcasts per step of k (fewer loads per FMA than one panel's 12 x 16
// tile of before, which left a second FMA port idle). The same FMA chain per output, so the same bits as the AVX2
// tile. W1's 32 body GEMMs on a Xeon with AMX (family 6 model 167, 2 threads, weights cold; 2026-12-01): 6.45 ms
// against oneDNN's 9.26 at 21 rows, 13.7 against 16.0 at 64, 46.7 against 44.2 at 256, 1.11x oneDNN's time at 2048
// (the 12 x 16 tile with x repacked: 6.97, 16.0, 53.6, 1.38x). On an AMD Zen 4 (whose 512-bit FMAs run on 256-bit
// units) the 12 x 16 tile took a W1 step's 32 body GEMMs in 5.4-5.9 ms against oneDNN's 7.8-8.4
// at 21 rows, 14.8-15.5 against 17.0-17.3 at 64, 3-6% longer at 2048; the 14 x 32 tile was not measured there.
// A thread's panels are one contiguous stream from memory: the first row tile of each chunk, the one that brings
// it in, also prefetches the stream 512 k-rows (32 KB) ahead into L2, so the next chunks arrive while this one
// computes (at 21 rows a chunk serves only 2 tiles, 4 on AVX2, and with the hardware prefetcher alone the FMAs
// waited on memory: a W1 step's GEMMs took 1.25x as long at 21 rows, 1.10x at 64, 1.03x at 2048, this code on an AMD
// Zen 4, with the 12 x 16 tile).

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
constexpr int kRows = 14;       // rows per register tile: 14 x 2 zmm accumulators + 2 weight vectors + 1 broadcast
constexpr int kTilePanels = 2;  // panels per register tile
constexpr int64_t kChunkM = 8 * kRows;  // rows per pass over the panels: their x (112 x K fp32) stays in L2
#else
constexpr int kRows = 6;        // rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast
constexpr int kTilePanels = 1;
constexpr int64_t kChunkM = 16 * kRows;  // rows per pass over the panels: their x (96 x K fp32) stays in L2
#endif
constexpr int64_t kChunkK = 256;
constexpr int64_t kLeadK = 512;   // how far ahead (in k-rows of a panel, 64 bytes each) the first tile prefetches

#ifdef LORAPLEX_LINEAR_AVX512

// c[0 .. R, 0 .. 16 P) (+)= a[r * lda + k] . panels[k][16 P] over kc steps of k, for P = 1 or 2 adjacent panels (the
// second panel_stride floats after the first); `first`: start from zero, else from c; `bias` (or null) is added as
// the tile is stored; the chunk's first row tile (`tile_index` 0) also prefetches the panels' stream kLeadK k-rows
// ahead, which from step `lead_wrap` on is past the panels' end: each panel's stream goes on in the next pair, P
// panels on, so the lead skips the other panel of this pair (until 2026-12-02 it fetched that panel again, and never
// the next pair's second: a W1 step's GEMMs, K = 512, took 3-7% longer at 1-8 rows on a Xeon with AMX).
template <int R, int P>
inline void tile(const float* a, int64_t lda, const float* b, int64_t panel_stride, int64_t kc, float* c, int64_t ldc,
                 bool first, const float* bias, int64_t tile_index, int64_t lead_wrap) {
  static_assert(P == 1 || P == 2, "a tile spans one or two panels");
  const bool lead = tile_index == 0;
  // named: arrays of __m512 spill to the stack; c_r: row r's first panel, d_r its second
  __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13;
  __m512 d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13;
// OP(r, the row's two accumulators) for each of the tile's fourteen rows (rows >= R compile to nothing).
#define LORAPLEX_EACH_ROW(OP)                                                                                  \
  OP(0, c0, d0) OP(1, c1, d1) OP(2, c2, d2) OP(3, c3, d3) OP(4, c4, d4) OP(5, c5, d5) OP(6, c6, d6) OP(7, c7, d7) \
  OP(8, c8, d8) OP(9, c9, d9) OP(10, c10, d10) OP(11, c11, d11) OP(12, c12, d12) OP(13, c13, d13)
#define LORAPLEX_LOAD(r, x, y)                                                             \
  if constexpr (R > r) {                                                                   \
    x = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);                        \
    if constexpr (P == 2) y = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + kPanel); \
  }
  LORAPLEX_EACH_ROW(LORAPLEX_LOAD)
  const float* b1 = b + panel_stride;
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * kPanel), _MM_HINT_T0);
    if constexpr (P == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + 8) * kPanel), _MM_HINT_T0);
    if (lead) {
      const int64_t skip = P == 2 && k >= lead_wrap ? panel_stride : 0;
      _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLeadK) * kPanel + skip), _MM_HINT_T1);
      if constexpr (P == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + kLeadK) * kPanel + skip), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(b + k * kPanel);
    __m512 w1;
    if constexpr (P == 2) w1 = _mm512_loadu_ps(b1 + k * kPanel);
#define LORAPLEX_FMA(r, x, y)                                 \
  if constexpr (R > r) {                                      \
    const __m512 a_rk = _mm512_set1_ps(a[r * lda + k]);       \
    x = _mm512_fmadd_ps(a_rk, w0, x);                         \
    if constexpr (P == 2) y = _mm512_fmadd_ps(a_rk, w1, y);   \
  }
    LORAPLEX_EACH_ROW(LORAPLEX_FMA)
  }
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias && P == 2 ? _mm512_loadu_ps(bias + kPanel) : _mm512_setzero_ps();
#define LORAPLEX_STORE(r, x, y)                                                                         \
  if constexpr (R > r) {                                                                                \
    _mm512_storeu_ps(c + r * ldc, bias ? _mm512_add_ps(x, bias0) : x);                                  \
    if constexpr (P == 2) _mm512_storeu_ps(c + r * ldc + kPanel, bias ? _mm512_add_ps(y, bias1) : y);   \
  }
  LORAPLEX_EACH_ROW(LORAPLEX_STORE)
#undef LORAPLEX_EACH_ROW
#undef LORAPLEX_LOAD
#undef LORAPLEX_FMA
#undef LORAPLEX_STORE
}

#elif defined(LORAPLEX_LINEAR_AVX2)

// c[0 .. R, 0 .. 16) (+)= a[k * R + r] . b_panel[k][16] over kc steps of k (a: the tile's rows of x repacked
// k-major, [kc][R], one stream); `first`: start from zero, else from c; `bias` (or null) is added as the tile is
// stored. The chunk's `lead_every` row tiles share the prefetch of the
// panel's stream kLeadK k-rows ahead (one panel at a time: the stream runs on into the next panel as it lies): this
// one, the chunk's `tile_index`-th, prefetches the k-rows k with k % lead_every == tile_index, so that the stream is
// asked for at an even pace while all of them pass over the chunk. Until 2026-12-02 the first tile prefetched all
// of them: on an AMD Zen 2 (family 23 model 49), W1's 32 body GEMMs (weights cold, 2 threads) then took 8-10% longer
// at 8-32 rows (21 rows: 8.7-9.3 ms against 7.9-8.4), the same at 1-4 and 64.
template <int R>
inline void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool first, const float* bias,
                 int64_t tile_index, int64_t lead_every) {
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
  int64_t until_lead = tile_index;  // steps of k until this tile's next lead prefetch
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * kPanel), _MM_HINT_T0);
    if (lead_every == 1) {  // the chunk's one tile: every k-row (no countdown in the loop of a decode step's row)
      _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLeadK) * kPanel), _MM_HINT_T1);
    } else if (until_lead-- == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(b + (k + kLeadK) * kPanel), _MM_HINT_T1);
      until_lead = lead_every - 1;
    }
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

#ifdef LORAPLEX_LINEAR_AVX512

// P adjacent panels' 16 P columns of rows [0, m) over k in [k0, k0 + kc) of K: row r of x at x + r * lda, the first
// panel at k0 (the next one panel_stride floats on). The first row tile leads the prefetch.
template <int P>
void panel_rows(const float* x, int64_t lda, int64_t k0, int64_t kc, int64_t K, const float* panel,
                int64_t panel_stride, float* c, int64_t ldc, int64_t m, bool first, const float* bias) {
  const int64_t lead_wrap = K - k0 - kLeadK;  // the tiles' step of k from which the lead is past the panels' end
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows)
    tile<kRows, P>(x + r * lda + k0, lda, panel, panel_stride, kc, c + r * ldc, ldc, first, bias, r / kRows,
                   lead_wrap);
  const float* a = x + r * lda + k0;
  float* c_tail = c + r * ldc;
  loraplex::with_count<kRows - 1>(m - r, [&](auto rows) {
    tile<rows(), P>(a, lda, panel, panel_stride, kc, c_tail, ldc, first, bias, r / kRows, lead_wrap);
  });
}

#else

// One panel's 16 columns of rows [0, m) over k in [k0, k0 + kc) of K: x_packed holds the rows' blocks ([K][kRows]
// each, the last [K][m % kRows]), the panel is at k0. The row tiles share the lead prefetch.
void panel_rows(const float* x_packed, int64_t k0, int64_t kc, int64_t K, const float* panel, float* c, int64_t ldc,
                int64_t m, bool first, const float* bias) {
  const int64_t lead_every = (m + kRows - 1) / kRows;
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows)
    tile<kRows>(x_packed + r * K + k0 * kRows, panel, kc, c + r * ldc, ldc, first, bias, r / kRows, lead_every);
  const int64_t tail = m - r;
  const float* a = x_packed + r * K + k0 * tail;
  float* c_tail = c + r * ldc;
  loraplex::with_count<kRows - 1>(tail, [&](auto rows) {
    tile<rows()>(a, panel, kc, c_tail, ldc, first, bias, r / kRows, lead_every);
  });
}

#endif

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
#ifndef LORAPLEX_LINEAR_AVX512
  at::Tensor x_packed = at::empty({M * K}, x.options());  // the blocks of kRows rows, each [K][rows]
  float* ap = x_packed.data_ptr<float>();
  at::parallel_for(0, (M + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t m0 = block * kRows, rows = std::min<int64_t>(kRows, M - m0);
      float* dst = ap + m0 * K;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = a[(m0 + r) * lda + k];
    }
  });
#endif
  const float* w = packed.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  const int64_t panel_stride = K * kPanel, groups = (panels + kTilePanels - 1) / kTilePanels;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t m = std::min(kChunkM, M - m0);
      for (int64_t group = begin; group < end; ++group) {
        const int64_t p = group * kTilePanels;
        const bool whole = p + kTilePanels <= panels;  // else the one panel left of an odd count
        for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
          const int64_t kc = std::min(kChunkK, K - k0);
          const bool last = k0 + kc == K;
          const float* panel = w + p * panel_stride + k0 * kPanel;
          float* c_block = c + m0 * N + p * kPanel;
          const float* bias_block = last && b ? b + p * kPanel : nullptr;
#ifdef LORAPLEX_LINEAR_AVX512
          if (whole)
            panel_rows<kTilePanels>(a + m0 * lda, lda, k0, kc, K, panel, panel_stride, c_block, N, m, k0 == 0,
                                    bias_block);
          else
            panel_rows<1>(a + m0 * lda, lda, k0, kc, K, panel, panel_stride, c_block, N, m, k0 == 0, bias_block);
#else
          (void)whole;  // one panel a tile
          panel_rows(ap + m0 * K, k0, kc, K, panel, c_block, N, m, k0 == 0, bias_block);
#endif
        }
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
