// Batched multi-LoRA shrink and expand on CPU: each token multiplies by its own adapter's row of the stacked
// weights, in one call per op (no gather into adapter order, no padding, no scatter back). Parallel over tokens
// on torch's own OpenMP team; a rank-R LoRA is R dot products per token (shrink) and R scaled row additions per
// token (expand), so plain vector loops reach what the matmul libraries would on such thin shapes.
//
//   lora_shrink_cpu(out [T, S*R], x [T, H_in], lora_a [N, S*R, H_in], idx [T])
//       out[t] = lora_a[idx[t]] @ x[t]                       (rows with idx -1 untouched)
//   lora_expand_cpu(y [T, H_out], z [T, S*R], lora_bt [N, R, H_out], idx [T], slice_bounds [S+1])
//       y[t, b_s:b_s+1] += z[t, s*R:(s+1)*R] @ lora_bt[idx[t], :, b_s:b_s+1]  for each slice s
//   float32; rows may be strided (unit stride inside a row); lora_a / lora_bt contiguous; idx int64.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

namespace {

using loraplex::axpy;
using loraplex::dot;
constexpr int64_t kTokensPerTask = 4;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && (t.size(1) <= 1 || t.stride(1) == 1), name,
              ": [T, H] float32 with contiguous rows");
}

void check_index(const at::Tensor& idx, int64_t num_tokens, int64_t num_rows) {
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.size(0) == num_tokens,
              "token_adapter_idx: [T] int64");
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(p[t] >= -1 && p[t] < num_rows, "token_adapter_idx[", t, "] = ", p[t], " is not a row (or -1)");
}

}  // namespace

void lora_shrink_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& idx) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.scalar_type() == at::kFloat,
              "lora_a: contiguous [N, S*R, H_in] float32");
  const int64_t num_tokens = x.size(0), h_in = x.size(1), width = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == h_in && out.size(0) == num_tokens && out.size(1) == width, "shape mismatch");
  check_index(idx, num_tokens, lora_a.size(0));
  const float* x_ptr = x.data_ptr<float>();
  const float* a_ptr = lora_a.data_ptr<float>();
  const int64_t* rows = idx.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, num_tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (rows[t] < 0) continue;
      const float* a = a_ptr + rows[t] * width * h_in;
      const float* xt = x_ptr + t * x_stride;
      float* o = out_ptr + t * out_stride;
      for (int64_t c = 0; c < width; ++c) o[c] = dot(a + c * h_in, xt, h_in);
    }
  });
}

void lora_expand_cpu(at::Tensor y, const at::Tensor& z, const at::Tensor& lora_bt, const at::Tensor& idx,
                     at::IntArrayRef slice_bounds) {
  check_rows(y, "y");
  check_rows(z, "z");
  TORCH_CHECK(lora_bt.dim() == 3 && lora_bt.is_contiguous() && lora_bt.scalar_type() == at::kFloat,
              "lora_bt: contiguous [N, R, H_out] float32");
  const int64_t num_tokens = y.size(0), h_out = y.size(1), rank = lora_bt.size(1);
  const int64_t num_slices = static_cast<int64_t>(slice_bounds.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && slice_bounds[0] == 0 && slice_bounds[num_slices] == h_out, "slice bounds");
  TORCH_CHECK(lora_bt.size(2) == h_out && z.size(0) == num_tokens && z.size(1) == num_slices * rank,
              "shape mismatch");
  check_index(idx, num_tokens, lora_bt.size(0));
  const std::vector<int64_t> bounds(slice_bounds.begin(), slice_bounds.end());
  const float* z_ptr = z.data_ptr<float>();
  const float* b_ptr = lora_bt.data_ptr<float>();
  const int64_t* rows = idx.data_ptr<int64_t>();
  float* y_ptr = y.data_ptr<float>();
  const int64_t z_stride = z.stride(0), y_stride = y.stride(0);
  at::parallel_for(0, num_tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (rows[t] < 0) continue;
      const float* bt = b_ptr + rows[t] * rank * h_out;
      const float* zt = z_ptr + t * z_stride;
      float* yt = y_ptr + t * y_stride;
      for (int64_t s = 0; s < num_slices; ++s) {
        const int64_t lo = bounds[s], len = bounds[s + 1] - bounds[s];
        for (int64_t r = 0; r < rank; ++r) axpy(zt[s * rank + r], bt + r * h_out + lo, yt + lo, len);
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def("lora_shrink_cpu(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor token_adapter_idx) -> ()");
  m.def("lora_expand_cpu(Tensor(a!) y, Tensor z, Tensor lora_bt, Tensor token_adapter_idx, int[] slice_bounds) -> ()");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) {
  m.impl("lora_shrink_cpu", &lora_shrink_cpu);
  m.impl("lora_expand_cpu", &lora_expand_cpu);
}
