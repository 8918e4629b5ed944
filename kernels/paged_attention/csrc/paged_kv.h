// What the CPU attention kernels share: a token's row of K or V through a block table, and the softmax numerators
// of a row of scores.
#pragma once

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

}  // namespace loraplex
