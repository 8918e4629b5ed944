// Paged decode attention on CPU: one new token per sequence attends to its whole context, read in place from the
// block pool through its block table (no gathered copy of K/V), a block (all kv heads) at a time. Parallel over
// sequences on torch's own OpenMP team; the q heads sharing a kv head (GQA) read each K/V row once.
//
//   q            [S, Hq, D]  float32 or bfloat16 (bf16: head_dim a multiple of the vector width), any row/head
//                strides, unit stride inside a head
//   k/v_cache    [num_blocks, block_size, Hkv, D]  q's dtype, contiguous; bf16 is widened to fp32 as it is read,
//                and everything is computed in fp32
//   block_tables [S, max_blocks] int32    context_lens [S] int32 (>= 1)
//   returns      [S, Hq, D]: softmax(scale * q . K^T) V over keys 0 .. context_len - 1

#include "paged_kv.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using loraplex::load_f32;
using loraplex::softmax_numerators;
using loraplex::token_row;
using loraplex::store_f32;
using loraplex::Vec;

// Asks for a row of the next block while the same row of this one is used: the blocks lie anywhere in the pool,
// so the hardware prefetcher, which follows strides, loses the thread at each block's end. Spread over the block's
// rows, the requests stay a steady stream (a whole block asked for at once queued behind itself).
template <int64_t kDim, typename T>
inline void prefetch_row(const T* row) {
  for (int64_t i = 0; i < kDim; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(row + i, 0, 1);
}

// Block b of a sequence in the pool: its rows, the next block's (nullptr after the last), its first token, and
// how many of its tokens are in the context.
// Row t of kv head h in a block, widened into `row`, while the same row of the next block (if any) is asked for.
template <int64_t kChunks, typename T>
inline void load_row(const T* block, const T* next, int64_t t, int64_t token_stride, int64_t h, Vec (&row)[kChunks]) {
  constexpr int64_t kDim = kChunks * Vec::size();
  const int64_t offset = t * token_stride + h * kDim;
  if (next) prefetch_row<kDim>(next + offset);
  for (int64_t c = 0; c < kChunks; ++c) row[c] = load_f32(block + offset + c * Vec::size());
}

template <typename T>
struct BlockRows {
  const T* rows;
  const T* next;
  int64_t first, count;
};

template <typename T>
inline BlockRows<T> block_rows(const T* base, const int32_t* table, int64_t b, int64_t block_size,
                               int64_t block_stride, int64_t context_len) {
  const int64_t first = b * block_size;
  const T* next = first + block_size < context_len ? base + table[b + 1] * block_stride : nullptr;
  return {base + table[b] * block_stride, next, first, std::min(block_size, context_len - first)};
}

// One sequence, every kv head: its q heads against its keys, K/V read in place through its block table one block
// at a time (each block's tokens of all kv heads lie together in the pool, so a block is read whole, once, while
// the next is prefetched), each K/V row once for all the q heads sharing it (GQA).
// kChunks = head_dim / Vec::size(), kGroup = q heads per kv head.
//   scores: [num_kv_heads, kGroup, context_len]    acc: [num_kv_heads * kGroup, head_dim]
template <typename T, int64_t kChunks, int64_t kGroup>
void attend_seq(const T* q_seq, int64_t q_head_stride, int64_t num_kv_heads, const T* k_ptr, const T* v_ptr,
                const int32_t* table, int64_t block_size, int64_t block_stride, int64_t token_stride,
                int64_t context_len, float scale, float* scores, float* acc, T* out_seq) {
  constexpr int64_t kDim = kChunks * Vec::size();
  const int64_t num_blocks = (context_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {  // scores[h, g, t] = scale * q_hg . k_th
    const auto [block, next, first, n] = block_rows(k_ptr, table, b, block_size, block_stride, context_len);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      Vec q[kGroup][kChunks];
      for (int64_t g = 0; g < kGroup; ++g)
        for (int64_t c = 0; c < kChunks; ++c)
          q[g][c] = load_f32(q_seq + (h * kGroup + g) * q_head_stride + c * Vec::size());
      float* head_scores = scores + h * kGroup * context_len + first;
      for (int64_t t = 0; t < n; ++t) {
        Vec krow[kChunks];
        load_row(block, next, t, token_stride, h, krow);
        for (int64_t g = 0; g < kGroup; ++g) {
          Vec dot = q[g][0] * krow[0];
          for (int64_t c = 1; c < kChunks; ++c) dot = at::vec::fmadd(q[g][c], krow[c], dot);
          head_scores[g * context_len + t] = scale * dot.reduce_add();
        }
      }
    }
  }
  const int64_t rows = num_kv_heads * kGroup;
  std::vector<float> inv(rows);
  for (int64_t r = 0; r < rows; ++r) inv[r] = 1.f / softmax_numerators(scores + r * context_len, context_len);
  std::fill(acc, acc + rows * kDim, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {  // acc_hg += p[h, g, t] v_th
    const auto [block, next, first, n] = block_rows(v_ptr, table, b, block_size, block_stride, context_len);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      Vec out[kGroup][kChunks];
      for (int64_t g = 0; g < kGroup; ++g)
        for (int64_t c = 0; c < kChunks; ++c) out[g][c] = Vec::loadu(acc + (h * kGroup + g) * kDim + c * Vec::size());
      const float* head_scores = scores + h * kGroup * context_len + first;
      for (int64_t t = 0; t < n; ++t) {
        Vec vrow[kChunks];
        load_row(block, next, t, token_stride, h, vrow);
        for (int64_t g = 0; g < kGroup; ++g) {
          const Vec p(head_scores[g * context_len + t]);
          for (int64_t c = 0; c < kChunks; ++c) out[g][c] = at::vec::fmadd(p, vrow[c], out[g][c]);
        }
      }
      for (int64_t g = 0; g < kGroup; ++g)
        for (int64_t c = 0; c < kChunks; ++c) out[g][c].store(acc + (h * kGroup + g) * kDim + c * Vec::size());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Vec inv_r(inv[r]);
    const float* a = acc + r * kDim;
    T* o = out_seq + r * kDim;
    for (int64_t c = 0; c < kChunks; ++c) store_f32(o + c * Vec::size(), Vec::loadu(a + c * Vec::size()) * inv_r);
  }
}

// Any head_dim and GQA ratio (the templated path covers head_dim = 1..16 vectors and ratios 1..8): plain loops.
void attend_any(const float* q_rows, int64_t q_head_stride, int64_t group, int64_t head_dim, const float* k_base,
                const float* v_base, const int32_t* table, int64_t block_size, int64_t block_stride,
                int64_t token_stride, int64_t context_len, float scale, float* scores, float* out_rows) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q_rows + g * q_head_stride;
    float* row = scores + g * context_len;
    for (int64_t t = 0; t < context_len; ++t) {
      const float* k = token_row(k_base, table, t, block_size, block_stride, token_stride);
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
      row[t] = scale * dot;
    }
    const float inv = 1.f / softmax_numerators(row, context_len);
    float* o = out_rows + g * head_dim;
    std::fill(o, o + head_dim, 0.f);
    for (int64_t t = 0; t < context_len; ++t) {
      const float* v = token_row(v_base, table, t, block_size, block_stride, token_stride);
      for (int64_t d = 0; d < head_dim; ++d) o[d] += row[t] * v[d];
    }
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
  }
}

}  // namespace

namespace {

template <typename T>
void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* tables,
                const int32_t* lens, int64_t max_blocks, float scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t chunks = head_dim % Vec::size() == 0 ? head_dim / Vec::size() : 0;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(num_heads * head_dim);  // [Hkv, group, context_len], [Hq, D]
    for (int64_t s = begin; s < end; ++s) {
      const int64_t context_len = lens[s];
      scores.resize(num_heads * context_len);
      const T* q_seq = q_ptr + s * q_seq_stride;
      const int32_t* table = tables + s * max_blocks;
      T* out_seq = out_ptr + s * num_heads * head_dim;
      bool done = true;
#define LORAPLEX_ATTEND(kc, kg)                                                                                   \
  if (chunks == kc && group == kg)                                                                                \
    attend_seq<T, kc, kg>(q_seq, q_head_stride, num_kv_heads, k_ptr, v_ptr, table, block_size, block_stride,      \
                          token_stride, context_len, scale, scores.data(), acc.data(), out_seq);                  \
  else
      LORAPLEX_ATTEND(1, 1) LORAPLEX_ATTEND(1, 2) LORAPLEX_ATTEND(1, 3) LORAPLEX_ATTEND(1, 4)
      LORAPLEX_ATTEND(1, 5) LORAPLEX_ATTEND(1, 6) LORAPLEX_ATTEND(1, 7) LORAPLEX_ATTEND(1, 8)
      LORAPLEX_ATTEND(2, 1) LORAPLEX_ATTEND(2, 2) LORAPLEX_ATTEND(2, 3) LORAPLEX_ATTEND(2, 4)
      LORAPLEX_ATTEND(2, 5) LORAPLEX_ATTEND(2, 6) LORAPLEX_ATTEND(2, 7) LORAPLEX_ATTEND(2, 8)
      LORAPLEX_ATTEND(4, 1) LORAPLEX_ATTEND(4, 2) LORAPLEX_ATTEND(4, 3) LORAPLEX_ATTEND(4, 4)
      LORAPLEX_ATTEND(4, 5) LORAPLEX_ATTEND(4, 6) LORAPLEX_ATTEND(4, 7) LORAPLEX_ATTEND(4, 8)
      LORAPLEX_ATTEND(8, 1) LORAPLEX_ATTEND(8, 2) LORAPLEX_ATTEND(8, 3) LORAPLEX_ATTEND(8, 4)
      LORAPLEX_ATTEND(8, 5) LORAPLEX_ATTEND(8, 6) LORAPLEX_ATTEND(8, 7) LORAPLEX_ATTEND(8, 8)
      LORAPLEX_ATTEND(16, 1) LORAPLEX_ATTEND(16, 2) LORAPLEX_ATTEND(16, 3) LORAPLEX_ATTEND(16, 4)
      LORAPLEX_ATTEND(16, 5) LORAPLEX_ATTEND(16, 6) LORAPLEX_ATTEND(16, 7) LORAPLEX_ATTEND(16, 8)
      done = false;
#undef LORAPLEX_ATTEND
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t h = 0; !done && h < num_kv_heads; ++h)
          attend_any(q_seq + h * group * q_head_stride, q_head_stride, group, head_dim, k_ptr + h * head_dim,
                     v_ptr + h * head_dim, table, block_size, block_stride, token_stride, context_len, scale,
                     scores.data(), out_seq + h * group * head_dim);
      } else {
        TORCH_CHECK(done, "bfloat16 decode attention needs head_dim a multiple of ", Vec::size(),
                    " and at most 8 q heads per kv head");
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  loraplex::check_q_and_caches(q, "S", k_cache, v_cache, block_tables, {&context_lens});
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs, "one table per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "context_lens[", s, "] out of range");
    loraplex::check_table(tables, s, max_blocks, lens[s], block_size, num_blocks);
  }
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  const float fscale = static_cast<float>(scale);
  loraplex::dispatch_float_bf16(q.scalar_type(), "q", [&](auto tag) {
    decode_all<decltype(tag)>(q, k_cache, v_cache, tables, lens, max_blocks, fscale, out);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
