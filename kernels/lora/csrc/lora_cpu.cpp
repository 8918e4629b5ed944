// Batched multi-LoRA shrink and expand on CPU: each token multiplies by its own adapter's row of the stacked weights,
// in one call per op (no gather into adapter order, no padding, no scatter back). The tokens are walked in adapter
// order (`order`, the LoraMeta's sorted_token_idx) and taken up to eight of one adapter at a time (a run, computed in
// register tiles of several tokens and columns, below), so each weight vector loaded serves several tokens: a decode
// batch's tokens of one adapter are scattered through the batch. Expand sums every rank's chunk in registers and writes
// each output chunk once (not once per rank). Parallel over the ordered tokens on torch's own OpenMP team. While a
// thread computes one run it prefetches the weights of its next run's adapter (at 16 adapters of one or two tokens
// each, a step's LoRA reads ~40 MB of weights, and each run's start waited on memory: lora_add over W1's 32 modules of
// 16 adapters takes 6-11% less time at 16-64 tokens, e.g. 1.78 ms instead of 1.90 at 21, on an AMD Zen 4). Runs of
// eight instead of four: W1's 32 modules at 64 tokens over 8 adapters (8 tokens each) 1.39-1.63 ms instead of 1.54-1.70
// (Zen 4, 2 threads). Shrink takes two or more weight rows per pass over the run's x (each x load feeds them all): on
// Zen 4, one W1 layer's four shrinks at 64 decode tokens over 8 adapters 0.058 ms instead of 0.101, at a 2048-token
// prefill step 1.29-1.42 instead of 2.48-2.53.
//
//   lora_add_cpu(y [T, H_out], x [T, H_in], lora_a, lora_bt, idx, order, row_ranks?, slice_bounds)
//       both below for each run of tokens, z kept in the thread's buffer (what a LoRA layer calls)
//   lora_shrink_cpu(out [T, S*R], x [T, H_in], lora_a [N, S*R, H_in], idx [T], order [L], row_ranks [N]?, R)
//       out[t] = lora_a[idx[t]] @ x[t]                       for t in order (other rows untouched)
//   lora_expand_cpu(y [T, H_out], z [T, S*R], lora_bt [N, R, H_out], idx [T], order [L], row_ranks [N]?,
//                   slice_bounds [S+1])
//       y[t, b_s:b_s+1] += z[t, s*R:(s+1)*R] @ lora_bt[idx[t], :, b_s:b_s+1]  for each slice s, t in order
//   float32 or bfloat16 (x, y, z and the weights all one dtype; computed in fp32, lora_add's z kept in fp32, y
//   rounded once); rows may be strided (unit stride inside a row); lora_a / lora_bt contiguous; idx, order int64;
//   order: distinct tokens with idx >= 0, grouped by idx (any order is correct; grouped is fast).
//   row_ranks (optional, int64): the rank r <= R of each row, whose A rows and B columns past r in each slice are
//   zero; shrink writes 0 there without reading A, expand reads only z's first r of each slice. Adapters of rank 8
//   under a max_lora_rank of 64 cost rank 8.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using loraplex::check_rows;
using loraplex::dispatch_float_bf16;
using loraplex::load_f32;
using loraplex::store_f32;
using loraplex::Vec;
constexpr int64_t kTokensPerTask = 4;
constexpr int kMaxRun = 8;  // tokens of one adapter that go together

// Checks idx [T] and order [L]; returns their data.
std::pair<const int64_t*, const int64_t*> check_index(const at::Tensor& idx, const at::Tensor& order,
                                                      int64_t num_tokens, int64_t num_rows) {
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.size(0) == num_tokens,
              "token_adapter_idx: [T] int64");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.is_contiguous() &&
                  order.size(0) <= num_tokens,
              "order: [L <= T] int64");
  const int64_t* rows = idx.data_ptr<int64_t>();
  const int64_t* tokens = order.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(rows[t] >= -1 && rows[t] < num_rows, "token_adapter_idx[", t, "] = ", rows[t],
                " is not a row (or -1)");
  for (int64_t p = 0; p < order.size(0); ++p)
    TORCH_CHECK(tokens[p] >= 0 && tokens[p] < num_tokens && rows[tokens[p]] >= 0, "order[", p, "] = ", tokens[p],
                " is not a token with an adapter");
  return {rows, tokens};
}

// Each row's rank, checked against R (nullptr: every row uses all R).
const int64_t* check_ranks(const std::optional<at::Tensor>& row_ranks, int64_t num_rows, int64_t rank) {
  if (!row_ranks.has_value()) return nullptr;
  const at::Tensor& ranks = *row_ranks;
  TORCH_CHECK(ranks.dim() == 1 && ranks.scalar_type() == at::kLong && ranks.is_contiguous() &&
                  ranks.size(0) >= num_rows && ranks.device().is_cpu(),
              "row_ranks: [N] int64 on the CPU");
  const int64_t* p = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] <= rank, "row_ranks[", i, "] = ", p[i], " is not a rank in 0..", rank);
  return p;
}

// How many of the ordered tokens from p on (at most kMaxRun, before end) share the adapter row of order[p].
inline int run_length(const int64_t* rows, const int64_t* order, int64_t p, int64_t end) {
  int n = 1;
  while (n < kMaxRun && p + n < end && rows[order[p + n]] == rows[order[p]]) ++n;
  return n;
}

// ptrs[k] = base + tokens[k] * stride for the n tokens of a run: their rows of x, y or z.
template <typename P>
inline void token_rows(P* base, int64_t stride, const int64_t* tokens, int n, P** ptrs) {
  for (int k = 0; k < n; ++k) ptrs[k] = base + tokens[k] * stride;
}

// f(p, n, row, next) for each run of n <= kMaxRun ordered tokens from order[p] on that share adapter row `row`, the
// ordered tokens split among torch's OpenMP team; `next`: the row of the thread's next run of another adapter (-1
// when none is left).
template <typename F>
void for_each_run(const int64_t* rows, const int64_t* order, int64_t num_ordered, F&& f) {
  at::parallel_for(0, num_ordered, kTokensPerTask, [&](int64_t begin, int64_t end) {
    int64_t adapter_end = begin, next = -1;  // where the tokens of the adapter in hand end, and the row after them
    for (int64_t p = begin; p < end;) {
      if (p == adapter_end) {  // a new adapter: one scan to its end (runs never cross one)
        while (adapter_end < end && rows[order[adapter_end]] == rows[order[p]]) ++adapter_end;
        next = adapter_end < end ? rows[order[adapter_end]] : -1;
      }
      const int n = run_length(rows, order, p, end);
      f(p, n, rows[order[p]], next);
      p += n;
    }
  });
}

// Where the weights of row `next` start (next >= 0), for a prefetch; null when there is none.
template <typename T>
inline const T* next_weights(const T* base, int64_t next, int64_t row_size) {
  return next >= 0 ? base + next * row_size : nullptr;
}

// f(n, row, ins, outs, next) for each run of `for_each_run`: ins[k] and outs[k] point at the row of `in` and of
// `out` of the run's token k.
template <typename In, typename Out, typename F>
void for_each_run_rows(const int64_t* rows, const int64_t* order, int64_t num_ordered, In* in, int64_t in_stride,
                       Out* out, int64_t out_stride, F&& f) {
  for_each_run(rows, order, num_ordered, [&](int64_t p, int n, int64_t row, int64_t next) {
    In* ins[kMaxRun];
    Out* outs[kMaxRun];
    token_rows(in, in_stride, order + p, n, ins);
    token_rows(out, out_stride, order + p, n, outs);
    f(n, row, ins, outs, next);
  });
}

// out_k[c + j] = a[c + j] . x_k for j < C columns and the N tokens k sharing the weights a [width,
// h_in]: C columns share each load of x. `next` (or null): the next run's a, prefetched alongside.
template <int N, int C, typename T, typename Z>
inline void shrink_columns(const T* a, const T* const* x, Z* const* out, int64_t c, int64_t h_in, const T* next) {
  Vec acc[C * N];  // column j's sum for token k at j * N + k
  LORAPLEX_UNROLL
  for (int j = 0; j < C; ++j)
    LORAPLEX_UNROLL
    for (int k = 0; k < N; ++k) acc[j * N + k] = Vec(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= h_in; i += Vec::size()) {
    Vec va[C];
    LORAPLEX_UNROLL
    for (int j = 0; j < C; ++j) {
      if (next) __builtin_prefetch(next + (c + j) * h_in + i, 0, 2);
      va[j] = load_f32(a + (c + j) * h_in + i);
    }
    LORAPLEX_UNROLL
    for (int k = 0; k < N; ++k) {
      const Vec vx = load_f32(x[k] + i);
      LORAPLEX_UNROLL
      for (int j = 0; j < C; ++j) acc[j * N + k] = at::vec::fmadd(va[j], vx, acc[j * N + k]);
    }
  }
  LORAPLEX_UNROLL
  for (int j = 0; j < C; ++j) {
    const T* ac = a + (c + j) * h_in;
    LORAPLEX_UNROLL
    for (int k = 0; k < N; ++k) {
      float sum = acc[j * N + k].reduce_add();
      for (int64_t t = i; t < h_in; ++t) sum += static_cast<float>(ac[t]) * static_cast<float>(x[k][t]);
      out[k][c + j] = static_cast<Z>(sum);
    }
  }
}

// A tile: NT tokens of one adapter and the columns (shrink) or vectors (expand) of output each of them takes at once.
// With AVX2 their accumulators fill 12 of the 16 vector registers, so that enough independent FMAs are in flight to
// hide the FMA's latency (a run of one token took two columns at a time before: two chains of FMAs), and each vector of
// weights loaded serves NT tokens: on a 2-core AMD Zen 3, W1's 32 LoRA adds (8 adapters, weights cold; `loraplex bench
// cpu-lora`) took 5.5 ms at 256 tokens against 6.6-6.7, 38-39 at 2048 against 47-48 (the shrinks 16-17 against 27),
// within 5% at 1-64 tokens, the same bits. A run of more than kTileTokens tokens takes several tiles. With AVX-512 the
// tiles stay what they were (all of a run's tokens, shrink's columns in pairs, expand's vectors one at a time), the
// shape measured on the Zen 4 and the Xeons. Wider ones, 16 or 24 accumulators whatever the run's length (shrink 2-3
// columns and expand 1-3 vectors at eight tokens, up to 8 of each at one or two), were no faster on a Xeon with AMX
// (family 6 model 167, 2026-12-02, `bench cpu-lora` at 1-2048 tokens: within its noise, or slower), nor was
// prefetching the next column block's A or the expand's B rows 8-16 vectors ahead within a run.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileTokens = kMaxRun;
template <int NT>
constexpr int shrink_width() {
  return 2;
}
template <int NT>
constexpr int expand_width() {
  return 1;
}
#else
constexpr int kTileTokens = 4;
constexpr int kTileAccumulators = 12;
constexpr int kTileWidth = 8;  // columns or vectors a tile takes at most: one rank-8 slice's columns
template <int NT>
constexpr int shrink_width() {
  return std::min(kTileWidth, kTileAccumulators / NT);
}
template <int NT>
constexpr int expand_width() {
  return shrink_width<NT>();
}
#endif

// out_k[c] = a[c] . x_k for the NT tokens k sharing the weights a [width, h_in], shrink_width<NT>() columns at a time
// (each slice's last block narrower) within the `used` columns of each slice of R; the columns past `used` are zero
// rows of a: 0 without reading them. Each column's sum runs in the same order whatever the tile.
template <int NT, typename T, typename Z>
void shrink_tile_rows(const T* a, const T* const* x, Z* const* out, int64_t width, int64_t h_in, int64_t rank,
                      int64_t used, const T* next) {
  constexpr int C = shrink_width<NT>();
  for (int64_t s = 0; s < width; s += rank) {
    int64_t c = s;
    for (; c + C <= s + used; c += C) shrink_columns<NT, C>(a, x, out, c, h_in, next);
    loraplex::with_count<C - 1>(s + used - c,
                                [&](auto rest) { shrink_columns<NT, rest()>(a, x, out, c, h_in, next); });
    for (c = s + used; c < s + rank; ++c)
      for (int k = 0; k < NT; ++k) out[k][c] = Z(0.f);
  }
}

// y_k[j : j + U vectors] += sum_r z_k[r] * bt[r, j : j + U vectors] for the NT tokens k sharing bt [rank, h_out]:
// each z_k[r] is broadcast once for U vectors, each vector of bt loaded once for NT tokens. `next` (or null): the
// next run's bt, prefetched alongside.
template <int NT, int U, typename T, typename Z>
inline void expand_tile(const T* bt, int64_t h_out, int64_t rank, const Z* const* z, T* const* y, int64_t j,
                        const T* next) {
  Vec acc[NT * U];  // token k's vector u at k * U + u
  LORAPLEX_UNROLL
  for (int k = 0; k < NT; ++k)
    LORAPLEX_UNROLL
    for (int u = 0; u < U; ++u) acc[k * U + u] = load_f32(y[k] + j + u * Vec::size());
  for (int64_t r = 0; r < rank; ++r) {
    Vec vb[U];
    LORAPLEX_UNROLL
    for (int u = 0; u < U; ++u) {
      if (next) __builtin_prefetch(next + r * h_out + j + u * Vec::size(), 0, 2);
      vb[u] = load_f32(bt + r * h_out + j + u * Vec::size());
    }
    LORAPLEX_UNROLL
    for (int k = 0; k < NT; ++k) {
      const Vec vz(static_cast<float>(z[k][r]));
      LORAPLEX_UNROLL
      for (int u = 0; u < U; ++u) acc[k * U + u] = at::vec::fmadd(vz, vb[u], acc[k * U + u]);
    }
  }
  LORAPLEX_UNROLL
  for (int k = 0; k < NT; ++k)
    LORAPLEX_UNROLL
    for (int u = 0; u < U; ++u) store_f32(y[k] + j + u * Vec::size(), acc[k * U + u]);
}

// y_k[lo:lo+len] += sum_r z_k[r] * bt[r, lo:lo+len] for the NT tokens k sharing bt [rank, h_out]: tiles of
// expand_width<NT>() vectors, then of one, then the last elements one by one. Each chunk of y_k is read and written
// once, and each element's sum runs in the same order whatever the tile. `next` (or null): the next run's bt,
// prefetched alongside.
template <int NT, typename T, typename Z>
void expand_tile_rows(const T* bt, int64_t h_out, int64_t rank, const Z* const* z, T* const* y, int64_t lo,
                      int64_t len, const T* next) {
  constexpr int U = expand_width<NT>();
  const int64_t end = lo + len;
  int64_t j = lo;
  for (; j + U * Vec::size() <= end; j += U * Vec::size()) expand_tile<NT, U>(bt, h_out, rank, z, y, j, next);
  for (; j + Vec::size() <= end; j += Vec::size()) expand_tile<NT, 1>(bt, h_out, rank, z, y, j, next);
  for (; j < end; ++j)
    for (int k = 0; k < NT; ++k) {
      float sum = static_cast<float>(y[k][j]);
      for (int64_t r = 0; r < rank; ++r) sum += static_cast<float>(z[k][r]) * static_cast<float>(bt[r * h_out + j]);
      y[k][j] = static_cast<T>(sum);
    }
}

// f(first, count, prefetch) for the n tokens of a run in tiles of at most kTileTokens: tokens first .. first +
// count, count a template argument; prefetch: whether the tile is the run's first (the one that prefetches).
template <typename F>
inline void for_each_tile(int n, F&& f) {
  for (int first = 0; first < n; first += kTileTokens)
    loraplex::with_count<kTileTokens>(std::min(n - first, kTileTokens),
                                      [&](auto count) { f(first, count, first == 0); });
}

// shrink_tile_rows over the run's n tokens, a tile at a time.
template <typename T, typename Z>
void shrink_tokens(int n, const T* a, const T* const* x, Z* const* out, int64_t width, int64_t h_in, int64_t rank,
                   int64_t used, const T* next) {
  for_each_tile(n, [&](int first, auto count, bool prefetch) {
    shrink_tile_rows<count()>(a, x + first, out + first, width, h_in, rank, used, prefetch ? next : nullptr);
  });
}

// expand_tile_rows over every slice and the run's n tokens, a tile at a time: z[k] is token k's whole z row [S*R],
// bounds the slices' [S+1] column bounds.
template <typename T, typename Z>
void expand_tokens(int n, const T* bt, int64_t h_out, int64_t rank, int64_t used, const Z* const* z, T* const* y,
                   const std::vector<int64_t>& bounds, const T* next) {
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    const Z* zs[kMaxRun];
    for (int k = 0; k < n; ++k) zs[k] = z[k] + s * rank;
    const int64_t lo = bounds[s], len = bounds[s + 1] - bounds[s];
    for_each_tile(n, [&](int first, auto count, bool prefetch) {
      expand_tile_rows<count()>(bt, h_out, used, zs + first, y + first, lo, len, prefetch ? next : nullptr);
    });
  }
}

void check_stack(const at::Tensor& w, const char* what, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == dtype, what, " of x's dtype");
}

// The slices' column bounds [S+1] over h_out columns.
std::vector<int64_t> check_bounds(at::IntArrayRef slice_bounds, int64_t h_out) {
  const int64_t num_slices = static_cast<int64_t>(slice_bounds.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && slice_bounds[0] == 0 && slice_bounds[num_slices] == h_out, "slice bounds");
  return {slice_bounds.begin(), slice_bounds.end()};
}

}  // namespace

void lora_shrink_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& idx,
                     const at::Tensor& order, const std::optional<at::Tensor>& row_ranks, int64_t rank) {
  const auto dtype = x.scalar_type();
  check_rows(out, "out", dtype);
  check_rows(x, "x", dtype);
  check_stack(lora_a, "lora_a: contiguous [N, S*R, H_in]", dtype);
  const int64_t num_tokens = x.size(0), h_in = x.size(1), width = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == h_in && out.size(0) == num_tokens && out.size(1) == width, "shape mismatch");
  const auto [rows, tokens] = check_index(idx, order, num_tokens, lora_a.size(0));
  if (rank <= 0) rank = width;  // one slice of unknown R: every column is used
  TORCH_CHECK(width % rank == 0, "lora_a's ", width, " rows are not slices of rank ", rank);
  const int64_t* ranks = check_ranks(row_ranks, lora_a.size(0), rank);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* x_ptr = x.data_ptr<T>();
    const T* a_ptr = lora_a.data_ptr<T>();
    T* out_ptr = out.data_ptr<T>();
    for_each_run_rows(rows, tokens, order.size(0), x_ptr, x_stride, out_ptr, out_stride,
                      [&](int n, int64_t row, const T* const* xs, T* const* outs, int64_t next) {
                        const int64_t used = ranks ? ranks[row] : rank;
                        shrink_tokens(n, a_ptr + row * width * h_in, xs, outs, width, h_in, rank, used,
                                      next_weights(a_ptr, next, width * h_in));
                      });
  });
}

void lora_expand_cpu(at::Tensor y, const at::Tensor& z, const at::Tensor& lora_bt, const at::Tensor& idx,
                     const at::Tensor& order, const std::optional<at::Tensor>& row_ranks,
                     at::IntArrayRef slice_bounds) {
  const auto dtype = y.scalar_type();
  check_rows(y, "y", dtype);
  check_rows(z, "z", dtype);
  check_stack(lora_bt, "lora_bt: contiguous [N, R, H_out]", dtype);
  const int64_t num_tokens = y.size(0), h_out = y.size(1), rank = lora_bt.size(1);
  const std::vector<int64_t> bounds = check_bounds(slice_bounds, h_out);
  TORCH_CHECK(lora_bt.size(2) == h_out && z.size(0) == num_tokens &&
                  z.size(1) == static_cast<int64_t>(bounds.size() - 1) * rank,
              "shape mismatch");
  const auto [rows, tokens] = check_index(idx, order, num_tokens, lora_bt.size(0));
  const int64_t* ranks = check_ranks(row_ranks, lora_bt.size(0), rank);
  const int64_t z_stride = z.stride(0), y_stride = y.stride(0);
  dispatch_float_bf16(dtype, "y", [&](auto tag) {
    using T = decltype(tag);
    const T* z_ptr = z.data_ptr<T>();
    const T* b_ptr = lora_bt.data_ptr<T>();
    T* y_ptr = y.data_ptr<T>();
    for_each_run_rows(rows, tokens, order.size(0), z_ptr, z_stride, y_ptr, y_stride,
                      [&](int n, int64_t row, const T* const* zs, T* const* ys, int64_t next) {
                        const int64_t used = ranks ? ranks[row] : rank;
                        expand_tokens(n, b_ptr + row * rank * h_out, h_out, rank, used, zs, ys, bounds,
                                      next_weights(b_ptr, next, rank * h_out));
                      });
  });
}

// Both ops in one pass over each run of tokens: its z [n, S*R] stays in a small fp32 buffer of the thread's, so a
// LoRA layer makes one call and allocates no intermediate tensor.
void lora_add_cpu(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                  const at::Tensor& idx, const at::Tensor& order, const std::optional<at::Tensor>& row_ranks,
                  at::IntArrayRef slice_bounds) {
  const auto dtype = x.scalar_type();
  check_rows(y, "y", dtype);
  check_rows(x, "x", dtype);
  check_stack(lora_a, "lora_a: contiguous [N, S*R, H_in]", dtype);
  check_stack(lora_bt, "lora_bt: contiguous [N, R, H_out]", dtype);
  const int64_t num_tokens = x.size(0), h_in = x.size(1), h_out = y.size(1), rank = lora_bt.size(1);
  const std::vector<int64_t> bounds = check_bounds(slice_bounds, h_out);
  const int64_t width = static_cast<int64_t>(bounds.size() - 1) * rank;
  TORCH_CHECK(y.size(0) == num_tokens && lora_a.size(0) == lora_bt.size(0) && lora_a.size(1) == width &&
                  lora_a.size(2) == h_in && lora_bt.size(2) == h_out,
              "shape mismatch: y [T, H_out], x [T, H_in], lora_a [N, S*R, H_in], lora_bt [N, R, H_out]");
  const auto [rows, tokens] = check_index(idx, order, num_tokens, lora_a.size(0));
  const int64_t* ranks = check_ranks(row_ranks, lora_a.size(0), rank);
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* x_ptr = x.data_ptr<T>();
    const T* a_ptr = lora_a.data_ptr<T>();
    const T* b_ptr = lora_bt.data_ptr<T>();
    T* y_ptr = y.data_ptr<T>();
    for_each_run_rows(rows, tokens, order.size(0), x_ptr, x_stride, y_ptr, y_stride,
                      [&](int n, int64_t row, const T* const* xs, T* const* ys, int64_t next) {
                        thread_local std::vector<float> z;  // [n, S*R] of the run in hand, the thread's own
                        z.resize(kMaxRun * width);
                        const int64_t used = ranks ? ranks[row] : rank;
                        float* zs[kMaxRun];
                        for (int k = 0; k < n; ++k) zs[k] = z.data() + k * width;
                        shrink_tokens(n, a_ptr + row * width * h_in, xs, zs, width, h_in, rank, used,
                                      next_weights(a_ptr, next, width * h_in));
                        expand_tokens(n, b_ptr + row * rank * h_out, h_out, rank, used, zs, ys, bounds,
                                      next_weights(b_ptr, next, rank * h_out));
                      });
  });
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def(
      "lora_shrink_cpu(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor token_adapter_idx, Tensor order, "
      "Tensor? row_ranks, int rank) -> ()");
  m.def(
      "lora_expand_cpu(Tensor(a!) y, Tensor z, Tensor lora_bt, Tensor token_adapter_idx, Tensor order, "
      "Tensor? row_ranks, int[] slice_bounds) -> ()");
  m.def(
      "lora_add_cpu(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_bt, Tensor token_adapter_idx, Tensor order, "
      "Tensor? row_ranks, int[] slice_bounds) -> ()");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("lora_shrink_cpu", &lora_shrink_cpu);
  m.impl("lora_expand_cpu", &lora_expand_cpu);
  m.impl("lora_add_cpu", &lora_add_cpu);
}
