// What the C++ CPU kernels share: ATen's vector type at this machine's width, loads and stores that widen
// bfloat16 to float32 and narrow it back (every kernel computes in fp32), the float32 / bfloat16 dispatch, and the
// check of a [T, H] tensor of rows.
#pragma once

// ATen's vector types use AVX2 / AVX-512 only when told; -march=native says what this machine has.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

// Before a loop over a register tile's rows or vectors (a template count): unrolled whole, so that the tile's Vec
// accumulators, in a flat array, live in registers. In a 2-d array GCC kept parts of an 8 x 3 tile of zmm on the
// stack (a load and a store around the FMA) even unrolled, and more of it without the unroll.
#define LORAPLEX_UNROLL _Pragma("GCC unroll 32")

namespace loraplex {

using Vec = at::vec::Vectorized<float>;
using BFloat16 = c10::BFloat16;

// Vec::size() elements from p as fp32 (bf16 widened).
template <typename T>
inline Vec load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// v narrowed to bf16 bits, rounded to nearest even as torch's casts round (NaN stays NaN). With avx512_bf16 one
// instruction, which also flushes fp32 subnormals (below 1.2e-38) to zero, where torch would keep a bf16 subnormal.
inline void store_bf16(BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
#else
  for (int64_t i = 0; i < Vec::size(); ++i) p[i] = static_cast<BFloat16>(v[i]);
#endif
}

// v stored to p[0 .. Vec::size()) as T.
template <typename T>
inline void store_f32(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    store_bf16(p, v);
  }
}

// v rounded to the nearest bf16 (even on ties, NaN kept), still in fp32 lanes.
inline Vec round_bf16(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const __m256i narrow = (__m256i)_mm512_cvtneps_pbh(__m512(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16));
#else
  BFloat16 narrow[Vec::size()];
  store_bf16(narrow, v);
  return load_f32(narrow);
#endif
}

// v as T would hold it, back in fp32: a bf16 intermediate of torch's reference, rounded where torch rounds it.
template <typename T>
inline Vec round_as(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return round_bf16(v);
  }
}

template <typename T>
inline float round_as(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// f(float{}) or f(BFloat16{}) by dtype: a kernel's one body for both element types.
template <typename F>
inline void dispatch_float_bf16(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, name, ": float32 or bfloat16");
    f(BFloat16{});
  }
}

// f(std::integral_constant<int, n>{}) for a count n in First .. Max known only at run time (a tile's last rows, a
// run of tokens), so that the code for n rows is a template: its accumulators named, its loops unrolled. Nothing for
// an n outside First .. Max. The counts are tried from First up: a decode step's one row is the first.
template <int Max, int First = 1, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (First <= Max) {
    if (n == First) {
      f(std::integral_constant<int, First>{});
      return;
    }
    with_count<Max, First + 1>(n, f);
  }
}

// t: [T, H] float32 or bfloat16 (`dtype`), each row contiguous (rows may be strided).
inline void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == dtype && (t.size(1) <= 1 || t.stride(1) == 1), name, ": [T, H] ",
              dtype, " with contiguous rows");
}

}  // namespace loraplex
