// The C++ CPU ops one kernel may call from another (each defined, checked and registered in its own file): the
// decode stack strings a decoder layer's kernels together without going back through Python between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

void add_rms_norm_cpu(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rms_norm_cpu(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void silu_and_mul_cpu(at::Tensor out, const at::Tensor& x);
void rotary_neox_cpu(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t heads);
void lora_add_cpu(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                  const at::Tensor& idx, const at::Tensor& order, const std::optional<at::Tensor>& row_ranks,
                  at::IntArrayRef slice_bounds);
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor packed_linear_bf16_cpu(const at::Tensor& x, const at::Tensor& packed,
                                  const std::optional<at::Tensor>& bias);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
