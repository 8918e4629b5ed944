// A decoder layer's small ops fused for CPU, each one pass over its rows in place of torch's chain of elementwise
// kernels (and their temporaries). Parallel over tokens on torch's own OpenMP team; float32; rows may be strided
// (unit stride inside a row).
//
//   add_rms_norm_cpu(x [T, H], residual [T, H], weight [H], eps)
//       residual += x;  x = residual * rsqrt(mean(residual^2) + eps) * weight          (both in place)
//   rms_norm_cpu(out [T, H], x [T, H], weight [H], eps)
//       out = x * rsqrt(mean(x^2) + eps) * weight
//   silu_and_mul_cpu(out [T, I], x [T, 2I])
//       out = silu(x[:, :I]) * x[:, I:]
//   rotary_neox_cpu(x [T, >= heads * D], positions [T] int64, cos_sin [P, D], heads)
//       each of the first `heads` heads of row t rotated in place, rotate-half layout, by position positions[t]:
//       x1, x2 = the head's halves; x1 <- x1 cos - x2 sin; x2 <- x2 cos + x1 sin  (cos_sin[p] = cos | sin halves)

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

namespace {

using loraplex::check_rows;
using loraplex::Vec;
constexpr int64_t kRowsPerTask = 8;

void check_weight(const at::Tensor& weight, int64_t hidden) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight: contiguous [H] float32");
}

// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i]; out may be x.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = acc.reduce_add();
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec inv_v(inv);
  for (i = 0; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(x + i) * inv_v * Vec::loadu(w + i)).store(out + i);
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

void add_rms_norm_cpu(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(residual.size(0) == num_tokens && residual.size(1) == hidden, "x and residual differ in shape");
  check_weight(weight, hidden);
  float* x_ptr = x.data_ptr<float>();
  float* r_ptr = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xt = x_ptr + t * x_stride;
      float* rt = r_ptr + t * r_stride;
      int64_t i = 0;
      for (; i + Vec::size() <= hidden; i += Vec::size()) (Vec::loadu(rt + i) + Vec::loadu(xt + i)).store(rt + i);
      for (; i < hidden; ++i) rt[i] += xt[i];
      rms_norm_row(rt, w, xt, hidden, static_cast<float>(eps));
    }
  });
}

void rms_norm_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(out.size(0) == num_tokens && out.size(1) == hidden, "out and x differ in shape");
  check_weight(weight, hidden);
  const float* x_ptr = x.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row(x_ptr + t * x_stride, w, o_ptr + t * o_stride, hidden, static_cast<float>(eps));
  });
}

void silu_and_mul_cpu(at::Tensor out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t num_tokens = x.size(0), inter = out.size(1);
  TORCH_CHECK(out.size(0) == num_tokens && x.size(1) == 2 * inter, "x must be [T, 2I] for out [T, I]");
  const float* x_ptr = x.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = x_ptr + t * x_stride;
      const float* up = gate + inter;
      float* o = o_ptr + t * o_stride;
      int64_t i = 0;
      for (; i + Vec::size() <= inter; i += Vec::size()) {
        const Vec g = Vec::loadu(gate + i);
        (g / (one + g.neg().exp_u20()) * Vec::loadu(up + i)).store(o + i);
      }
      for (; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

void rotary_neox_cpu(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads) {
  check_rows(x, "x");
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
  float* x_ptr = x.data_ptr<float>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * head_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = x_ptr + t * x_stride + h * head_dim;
        float* x2 = x1 + half;
        int64_t i = 0;
        for (; i + Vec::size() <= half; i += Vec::size()) {
          const Vec a = Vec::loadu(x1 + i), b = Vec::loadu(x2 + i);
          const Vec c = Vec::loadu(cos + i), s = Vec::loadu(sin + i);
          at::vec::fmsub(a, c, b * s).store(x1 + i);
          at::vec::fmadd(b, c, a * s).store(x2 + i);
        }
        for (; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * cos[i] - b * sin[i];
          x2[i] = b * cos[i] + a * sin[i];
        }
      }
    }
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
