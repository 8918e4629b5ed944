// What the CPU attention kernels share: the checks of q, the caches and the block tables, a token's row of K or V
// through a block table, and the softmax numerators of a row of scores.
#pragma once

#include "cpu_vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>

namespace loraplex {

// Softmax numerators of row[0 .. n) in place (exp(x - max)); returns their sum.
inline float softmax_numerators(float* row, int64_t n) {
  Vec top_v(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) top_v = at::vec::maximum(top_v, Vec::loadu(row + i));
  float top = top_v.reduce_max();
  for (; i < n; ++i) top = std::max(top, row[i]);
  const Vec top_b(top);
  Vec sum_v(0.f);
  for (i = 0; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(row + i) - top_b).exp_u20();
    e.store(row + i);
    sum_v = sum_v + e;
  }
  float sum = sum_v.reduce_add();
  for (; i < n; ++i) sum += (row[i] = std::exp(row[i] - top));
  return sum;
}

// Token t's row (one kv head) of a sequence's K or V, through its block table.
template <typename T>
inline const T* token_row(const T* base, const int32_t* table, int64_t t, int64_t block_size, int64_t block_stride,
                          int64_t token_stride) {
  return base + table[t / block_size] * block_stride + (t % block_size) * token_stride;
}

// q [T, Hq, D] float32 or bfloat16 (unit stride inside a head); k/v caches [num_blocks, block_size, Hkv, D],
// contiguous, of q's dtype, Hq a multiple of Hkv; block_tables [S, max_blocks] and the other int32 tensors given
// contiguous. `q_rows`: what q's rows are, for the messages.
inline void check_q_and_caches(const at::Tensor& q, const char* q_rows, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               std::initializer_list<const at::Tensor*> int32s) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kFloat || dtype == at::kBFloat16) && q.stride(2) == 1, "q: [", q_rows,
              ", Hq, D] float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "caches: contiguous [num_blocks, block_size, Hkv, D] of q's dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head_dim / kv heads mismatch");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: contiguous [S, max_blocks] int32");
  for (const at::Tensor* t : int32s)
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kInt && t->is_contiguous(), "lengths: contiguous int32");
}

// Sequence s's first blocks, enough for context_len keys, are blocks of the pool (context_len already checked to fit
// its table).
inline void check_table(const int32_t* tables, int64_t s, int64_t max_blocks, int64_t context_len, int64_t block_size,
                        int64_t num_blocks) {
  for (int64_t b = 0; b < (context_len + block_size - 1) / block_size; ++b) {
    const int32_t block = tables[s * max_blocks + b];
    TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block, " out of range");
  }
}

}  // namespace loraplex
