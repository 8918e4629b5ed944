// What the C++ CPU kernels share: ATen's vector type at this machine's width.
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

}  // namespace loraplex
