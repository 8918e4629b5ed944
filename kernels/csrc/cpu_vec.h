// What the C++ CPU kernels share: ATen's vector type at this machine's width, and the check of a [T, H] tensor
// of rows.
#pragma once

// ATen's vector types use AVX2 / AVX-512 only when told; -march=native says what this machine has.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace loraplex {

using Vec = at::vec::Vectorized<float>;

// t: [T, H] float32, each row contiguous (rows may be strided).
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && (t.size(1) <= 1 || t.stride(1) == 1), name,
              ": [T, H] float32 with contiguous rows");
}

}  // namespace loraplex
