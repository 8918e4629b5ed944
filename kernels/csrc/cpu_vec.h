// What the C++ CPU kernels share: ATen's vector type at this machine's width, a dot product and y += a * x.
#pragma once

// ATen's vector types use AVX2 / AVX-512 only when told; -march=native says what this machine has.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace loraplex {

using Vec = at::vec::Vectorized<float>;

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float sum = acc.reduce_add();
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  const Vec a(alpha);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(a, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace loraplex
