// Paged prefill attention on CPU: each prefill sequence's new tokens attend causally to its whole context (a cached
// prefix included), read in place from the block pool through its block table. One task per (sequence, kv head):
// its K is widened once into a transposed fp32 tile and its V into a row-major one (both stay in cache), then its
// query rows go four at a time, so each K or V vector loaded serves four rows (the q heads sharing the kv head, and
// neighbouring positions). Parallel over the tasks on torch's own OpenMP team.
//
//   q            [T, Hq, D]  float32 or bfloat16, T >= the prefill tokens (rows 0 .. cu_seqlens_q[P]); any row /
//                head strides, unit stride inside a head; D = 1, 2, 4, 8 or 16 vectors (16, 32, 64 or 128 both on
//                AVX2 and AVX-512)
//   k/v_cache    [num_blocks, block_size, Hkv, D]  q's dtype, contiguous
//   block_tables [P, max_blocks] int32    cu_seqlens_q [P+1] int32    context_lens [P] int32 (>= each q_len)
//   returns      [cu_seqlens_q[P], Hq, D]: the new token i of sequence s (position context_len - q_len + i) attends
//                keys 0 .. its position: softmax(scale * q . K^T) V, computed in fp32

#include "paged_kv.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

using loraplex::load_f32;
using loraplex::softmax_numerators;
using loraplex::store_f32;
using loraplex::token_row;
using loraplex::Vec;
constexpr int64_t kRows = 4;               // query rows that share each K / V vector loaded
constexpr int64_t kKeys = 2 * Vec::size();  // keys scored together (two vectors per row)

struct Seq {
  const int32_t* table;
  int64_t first_row, q_len, context_len;
};

// One (sequence, kv head): kt [D, keys] (zero past the context), v [context_len, D], both fp32.
template <typename T, int64_t kChunks>
void attend_head(const T* q_ptr, int64_t q_row_stride, int64_t q_head_stride, int64_t group, int64_t kv_head,
                 const T* k_base, const T* v_base, const Seq& seq, int64_t block_size, int64_t block_stride,
                 int64_t token_stride, float scale, std::vector<float>& kt, std::vector<float>& v,
                 std::vector<float>& scores, T* out_ptr, int64_t out_row_stride) {
  constexpr int64_t kDim = kChunks * Vec::size();
  const int64_t ctx = seq.context_len, keys = (ctx + kKeys - 1) / kKeys * kKeys;
  kt.assign(kDim * keys, 0.f);
  v.resize(ctx * kDim);
  for (int64_t t = 0; t < ctx; ++t) {
    const int64_t offset = kv_head * kDim;
    const T* k_row = token_row(k_base, seq.table, t, block_size, block_stride, token_stride) + offset;
    const T* v_row = token_row(v_base, seq.table, t, block_size, block_stride, token_stride) + offset;
    for (int64_t d = 0; d < kDim; ++d) kt[d * keys + t] = static_cast<float>(k_row[d]);
    for (int64_t c = 0; c < kChunks; ++c) load_f32(v_row + c * Vec::size()).store(v.data() + t * kDim + c * Vec::size());
  }
  scores.resize(kRows * keys);
  const int64_t num_rows = seq.q_len * group;  // row r: position r / group, q head kv_head * group + r % group
  const int64_t first_key_limit = ctx - seq.q_len + 1;  // keys the first new token sees
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRows) {
    const int64_t rows = std::min(kRows, num_rows - r0);
    float q[kRows][kDim];
    int64_t limit[kRows];
    const T* q_rows[kRows];
    for (int64_t r = 0; r < kRows; ++r) {  // rows past the end repeat the last one: their results are dropped
      const int64_t row = r0 + std::min(r, rows - 1), i = row / group;
      q_rows[r] = q_ptr + (seq.first_row + i) * q_row_stride + (kv_head * group + row % group) * q_head_stride;
      for (int64_t d = 0; d < kDim; ++d) q[r][d] = static_cast<float>(q_rows[r][d]) * scale;
      limit[r] = first_key_limit + i;
    }
    const int64_t max_limit = *std::max_element(limit, limit + kRows);
    for (int64_t j = 0; j < max_limit; j += kKeys) {  // scores[r, j..] = q_r . K[j..]^T
      Vec acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
      for (int64_t d = 0; d < kDim; ++d) {
        const Vec k0 = Vec::loadu(kt.data() + d * keys + j), k1 = Vec::loadu(kt.data() + d * keys + j + Vec::size());
        for (int64_t r = 0; r < kRows; ++r) {
          const Vec qd(q[r][d]);
          acc[r][0] = at::vec::fmadd(qd, k0, acc[r][0]);
          acc[r][1] = at::vec::fmadd(qd, k1, acc[r][1]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        acc[r][0].store(scores.data() + r * keys + j);
        acc[r][1].store(scores.data() + r * keys + j + Vec::size());
      }
    }
    float inv[kRows];
    for (int64_t r = 0; r < kRows; ++r) {  // probabilities up to each row's limit, 0 after it up to the tile's
      float* row = scores.data() + r * keys;
      inv[r] = 1.f / softmax_numerators(row, limit[r]);
      std::fill(row + limit[r], row + max_limit, 0.f);
    }
    Vec out[kRows][kChunks];
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kChunks; ++c) out[r][c] = Vec(0.f);
    for (int64_t j = 0; j < max_limit; ++j) {  // out_r += p[r, j] V[j]
      Vec vrow[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) vrow[c] = Vec::loadu(v.data() + j * kDim + c * Vec::size());
      for (int64_t r = 0; r < kRows; ++r) {
        const Vec p(scores[r * keys + j]);
        for (int64_t c = 0; c < kChunks; ++c) out[r][c] = at::vec::fmadd(p, vrow[c], out[r][c]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = r0 + r;
      T* o = out_ptr + (seq.first_row + row / group) * out_row_stride + (kv_head * group + row % group) * kDim;
      for (int64_t c = 0; c < kChunks; ++c) store_f32(o + c * Vec::size(), out[r][c] * Vec(inv[r]));
    }
  }
}

template <typename T, int64_t kChunks>
void prefill_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Seq>& seqs,
                 float scale, at::Tensor& out) {
  const int64_t num_heads = q.size(1), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t head_dim = q.size(2), group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t num_tasks = static_cast<int64_t>(seqs.size()) * num_kv_heads;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, v, scores;
    for (int64_t task = begin; task < end; ++task)
      attend_head<T, kChunks>(q_ptr, q.stride(0), q.stride(1), group, task % num_kv_heads, k_ptr, v_ptr,
                              seqs[task / num_kv_heads], block_size, block_stride, token_stride, scale, kt, v, scores,
                              out_ptr, num_heads * head_dim);
  });
}

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale) {
  loraplex::check_q_and_caches(q, "T", k_cache, v_cache, block_tables, {&cu_seqlens_q, &context_lens});
  const auto dtype = q.scalar_type();
  const int64_t num_seqs = context_lens.size(0), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t chunks = head_dim % Vec::size() == 0 ? head_dim / Vec::size() : 0;
  TORCH_CHECK(chunks == 1 || chunks == 2 || chunks == 4 || chunks == 8 || chunks == 16, "head_dim ", head_dim,
              " is not 1, 2, 4, 8 or 16 vectors of ", Vec::size());
  TORCH_CHECK(block_tables.size(0) == num_seqs && cu_seqlens_q.size(0) == num_seqs + 1, "one table per sequence");
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] <= q.size(0), "cu_seqlens_q: from 0 to at most T");
  std::vector<Seq> seqs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s];
    TORCH_CHECK(q_len >= 1 && q_len <= ctx && ctx <= max_blocks * block_size, "sequence ", s, ": q_len ", q_len,
                ", context_len ", ctx, " out of range");
    loraplex::check_table(tables, s, max_blocks, ctx, block_size, num_blocks);
    seqs.push_back({tables + s * max_blocks, cu[s], q_len, ctx});
  }
  auto out = at::empty({cu[num_seqs], q.size(1), head_dim}, q.options());
  const float fscale = static_cast<float>(scale);
  loraplex::dispatch_float_bf16(dtype, "q", [&](auto tag) {
    using T = decltype(tag);
    switch (chunks) {
      case 1: prefill_all<T, 1>(q, k_cache, v_cache, seqs, fscale, out); break;
      case 2: prefill_all<T, 2>(q, k_cache, v_cache, seqs, fscale, out); break;
      case 4: prefill_all<T, 4>(q, k_cache, v_cache, seqs, fscale, out); break;
      case 8: prefill_all<T, 8>(q, k_cache, v_cache, seqs, fscale, out); break;
      default: prefill_all<T, 16>(q, k_cache, v_cache, seqs, fscale, out);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
