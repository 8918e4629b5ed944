// A decoder layer's small ops fused for CPU, each one pass over its rows in place of torch's chain of elementwise
// kernels (and their temporaries). Parallel over tokens on torch's own OpenMP team; float32 or bfloat16 (computed in
// fp32, rounded to bf16 where torch's bf16 reference rounds: after the residual add, the normalized row before its
// weight, silu(gate) before the product); rows may be strided (unit stride inside a row).
//
//   add_rms_norm_cpu(x [T, H], residual [T, H], weight [H], eps)
//       residual += x;  x = residual * rsqrt(mean(residual^2) + eps) * weight          (both in place)
//   rms_norm_cpu(out [T, H], x [T, H], weight [H], eps)
//       out = x * rsqrt(mean(x^2) + eps) * weight
//   silu_and_mul_cpu(out [T, I], x [T, 2I])
//       out = silu(x[:, :I]) * x[:, I:]
//   rotary_neox_cpu(x [T, >= heads * D], positions [T] int64, cos_sin [P, D] float32, heads)
//       each of the first `heads` heads of row t rotated in place, rotate-half layout, by position positions[t]:
//       x1, x2 = the head's halves; x1 <- x1 cos - x2 sin; x2 <- x2 cos + x1 sin  (cos_sin[p] = cos | sin halves)

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

namespace {

using loraplex::check_rows;
using loraplex::dispatch_float_bf16;
using loraplex::load_f32;
using loraplex::round_as;
using loraplex::store_f32;
using loraplex::Vec;
constexpr int64_t kRowsPerTask = 8;

void check_weight(const at::Tensor& weight, int64_t hidden, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                  weight.scalar_type() == dtype,
              "weight: contiguous [H] of x's dtype");
}

// out[i] = round(x[i] * rsqrt(mean(x^2) + eps)) * w[i]; out may be x.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = load_f32(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = acc.reduce_add();
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec inv_v(inv);
  for (i = 0; i + Vec::size() <= n; i += Vec::size())
    store_f32(out + i, round_as<T>(load_f32(x + i) * inv_v) * load_f32(w + i));
  for (; i < n; ++i)
    out[i] = static_cast<T>(round_as<T>(static_cast<float>(x[i]) * inv) * static_cast<float>(w[i]));
}

}  // namespace

void add_rms_norm_cpu(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  check_rows(x, "x", dtype);
  check_rows(residual, "residual", dtype);
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(residual.size(0) == num_tokens && residual.size(1) == hidden, "x and residual differ in shape");
  check_weight(weight, hidden, dtype);
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    T* x_ptr = x.data_ptr<T>();
    T* r_ptr = residual.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
    at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        T* xt = x_ptr + t * x_stride;
        T* rt = r_ptr + t * r_stride;
        int64_t i = 0;
        for (; i + Vec::size() <= hidden; i += Vec::size()) store_f32(rt + i, load_f32(rt + i) + load_f32(xt + i));
        for (; i < hidden; ++i) rt[i] = static_cast<T>(static_cast<float>(rt[i]) + static_cast<float>(xt[i]));
        rms_norm_row(rt, w, xt, hidden, static_cast<float>(eps));
      }
    });
  });
}

void rms_norm_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  check_rows(out, "out", dtype);
  check_rows(x, "x", dtype);
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(out.size(0) == num_tokens && out.size(1) == hidden, "out and x differ in shape");
  check_weight(weight, hidden, dtype);
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* x_ptr = x.data_ptr<T>();
    T* o_ptr = out.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
    at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rms_norm_row(x_ptr + t * x_stride, w, o_ptr + t * o_stride, hidden, static_cast<float>(eps));
    });
  });
}

void silu_and_mul_cpu(at::Tensor out, const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  check_rows(out, "out", dtype);
  check_rows(x, "x", dtype);
  const int64_t num_tokens = x.size(0), inter = out.size(1);
  TORCH_CHECK(out.size(0) == num_tokens && x.size(1) == 2 * inter, "x must be [T, 2I] for out [T, I]");
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* x_ptr = x.data_ptr<T>();
    T* o_ptr = out.data_ptr<T>();
    const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
    at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      const Vec one(1.f);
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = x_ptr + t * x_stride;
        const T* up = gate + inter;
        T* o = o_ptr + t * o_stride;
        int64_t i = 0;
        for (; i + Vec::size() <= inter; i += Vec::size()) {
          const Vec g = load_f32(gate + i);
          store_f32(o + i, round_as<T>(g / (one + g.neg().exp_u20())) * load_f32(up + i));
        }
        for (; i < inter; ++i) {
          const float g = static_cast<float>(gate[i]);
          o[i] = static_cast<T>(round_as<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
        }
      }
    });
  });
}

void rotary_neox_cpu(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads) {
  const auto dtype = x.scalar_type();
  check_rows(x, "x", dtype);
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.scalar_type() == at::kFloat,
              "cos_sin: contiguous [P, D] float32");
  const int64_t num_tokens = x.size(0), head_dim = cos_sin.size(1), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && heads >= 0 && heads * head_dim <= x.size(1), "x has fewer than heads * D columns");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == num_tokens,
              "positions: [T] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_sin.size(0);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "positions[", t, "] = ", pos[t], " is past the table");
  const float* table = cos_sin.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  dispatch_float_bf16(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    T* x_ptr = x.data_ptr<T>();
    at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pos[t] * head_dim;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = x_ptr + t * x_stride + h * head_dim;
          T* x2 = x1 + half;
          int64_t i = 0;
          for (; i + Vec::size() <= half; i += Vec::size()) {
            const Vec a = load_f32(x1 + i), b = load_f32(x2 + i);
            const Vec c = Vec::loadu(cos + i), s = Vec::loadu(sin + i);
            store_f32(x1 + i, at::vec::fmsub(a, c, b * s));
            store_f32(x2 + i, at::vec::fmadd(b, c, a * s));
          }
          for (; i < half; ++i) {
            const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
            x1[i] = static_cast<T>(a * cos[i] - b * sin[i]);
            x2[i] = static_cast<T>(b * cos[i] + a * sin[i]);
          }
        }
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("add_rms_norm_cpu(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm_cpu(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul_cpu(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_neox_cpu(Tensor(a!) x, Tensor positions, Tensor cos_sin, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("add_rms_norm_cpu", &add_rms_norm_cpu);
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("silu_and_mul_cpu", &silu_and_mul_cpu);
  m.impl("rotary_neox_cpu", &rotary_neox_cpu);
}
