// A Llama-family model's decoder layers for one decode step, as one op: the kernels engine/models/llama.py calls
// layer by layer (the fused norms, the prepacked linears, the batched LoRA adds, rotary, the K/V store and the
// paged decode attention), on the same tensors in the same order, called from here instead of from Python. A layer
// makes about fifteen op calls per step; from Python each costs microseconds of interpreter and dispatch time on
// the step's critical path, with the GIL held, which the server's event loop waits for. Here the whole stack runs
// without either. Outputs are bit-identical to the layer-by-layer path.
//
//   decode_layers_cpu(x [T, H], positions [T] int64, cos_sin [P, D] float32, slots [T] int64,
//                     block_tables [T, M] int32, context_lens [T] int32,
//                     k_caches[L], v_caches[L]        ([num_blocks, block_size, Hkv, D] each),
//                     input_norms[L], qkv[L], qkv_bias[L]?, o[L], post_norms[L], gate_up[L], down[L], final_norm,
//                     num_heads, num_kv_heads, eps, scale,
//                     lora_a[4L]?, lora_bt[4L]?       (qkv, o, gate_up, down of each layer; empty lists: no LoRA),
//                     token_adapter_idx?, sorted_token_idx?, row_ranks?,
//                     qkv_bounds, o_bounds, gate_up_bounds, down_bounds)
//       -> [T, H]: the final norm of the last layer's output plus its residual. Each token's K/V is stored at its
//          slot; x (the embeddings) is used as the residual stream and overwritten.
//   One token per sequence (T sequences), every token stored (slots >= 0); the linears' weights are prepacked by
//   mkldnn::_reorder_linear_weight or loraplex::pack_linear_weight_cpu; q and k share the qkv row and rotate together (no q/k norm).

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string_view>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   std::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>);

// x @ W^T (+ bias) through the weight as PackedLinear packed it: PackedLinear.forward's call (oneDNN's opaque
// layout, or linear/csrc's panels on AVX2 CPUs).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  if (!packed.is_mkldnn()) return packed_linear_cpu(x, packed, bias);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<LinearPointwise>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

// The step's batched LoRA: which token uses which adapter row, and each module's stacked weights (or none).
struct Lora {
  const c10::List<std::optional<at::Tensor>>& a;
  const c10::List<std::optional<at::Tensor>>& bt;
  const std::optional<at::Tensor>& idx;
  const std::optional<at::Tensor>& order;
  const std::optional<at::Tensor>& row_ranks;

  // y += the LoRA delta of x through module `m` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`, if it has one.
  void add(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t m, at::IntArrayRef bounds) const {
    if (a.empty()) return;
    const std::optional<at::Tensor> a_w = a.get(4 * layer + m), bt_w = bt.get(4 * layer + m);
    if (!a_w.has_value()) return;
    lora_add_cpu(y, x, *a_w, *bt_w, *idx, *order, row_ranks, bounds);
  }
};

// cache.flat[slots[t]] = qkv[t, offset : offset + width] for every token (rows of Hkv * D elements).
void store_rows(const at::Tensor& qkv, int64_t offset, int64_t width, at::Tensor& cache, const int64_t* slots) {
  const int64_t bytes = width * qkv.element_size(), row_stride = qkv.stride(0) * qkv.element_size();
  const char* src = static_cast<const char*>(qkv.data_ptr()) + offset * qkv.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < qkv.size(0); ++t) std::memcpy(dst + slots[t] * bytes, src + t * row_stride, bytes);
}

}  // namespace

at::Tensor decode_layers_cpu(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                             at::TensorList k_caches, at::TensorList v_caches, at::TensorList input_norms,
                             at::TensorList qkv, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                             at::TensorList o, at::TensorList post_norms, at::TensorList gate_up,
                             at::TensorList down, const at::Tensor& final_norm, int64_t num_heads,
                             int64_t num_kv_heads, double eps, double scale,
                             const c10::List<std::optional<at::Tensor>>& lora_a,
                             const c10::List<std::optional<at::Tensor>>& lora_bt,
                             const std::optional<at::Tensor>& token_adapter_idx,
                             const std::optional<at::Tensor>& sorted_token_idx,
                             const std::optional<at::Tensor>& row_ranks, at::IntArrayRef qkv_bounds,
                             at::IntArrayRef o_bounds, at::IntArrayRef gate_up_bounds, at::IntArrayRef down_bounds) {
  const int64_t num_layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(num_layers >= 1 && k_caches.size() == qkv.size() && v_caches.size() == qkv.size() &&
                  input_norms.size() == qkv.size() && qkv_bias.size() == qkv.size() && o.size() == qkv.size() &&
                  post_norms.size() == qkv.size() && gate_up.size() == qkv.size() && down.size() == qkv.size(),
              "one of each weight and cache per layer");
  TORCH_CHECK(lora_a.size() == lora_bt.size() && (lora_a.empty() || lora_a.size() == 4 * qkv.size()),
              "lora_a / lora_bt: four per layer (qkv, o, gate_up, down), or none");
  TORCH_CHECK(lora_a.empty() || (token_adapter_idx.has_value() && sorted_token_idx.has_value()),
              "LoRA weights without the step's token_adapter_idx / sorted_token_idx");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [T, H]");
  const int64_t num_tokens = x.size(0);
  const at::Tensor& cache0 = k_caches[0];
  TORCH_CHECK(cache0.dim() == 4 && cache0.size(2) == num_kv_heads, "caches: [num_blocks, block_size, Hkv, D]");
  const int64_t head_dim = cache0.size(3), capacity = cache0.size(0) * cache0.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == num_tokens,
              "slots: [T] int64");
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < capacity, "slots[", t, "] = ", slot_ptr[t], " is not in the cache");
  for (int64_t l = 0; l < num_layers; ++l)
    TORCH_CHECK(k_caches[l].sizes() == cache0.sizes() && v_caches[l].sizes() == cache0.sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == x.scalar_type() && v_caches[l].scalar_type() == x.scalar_type(),
                "layer ", l, "'s caches: contiguous, shaped as layer 0's, of x's dtype");
  const Lora lora{lora_a, lora_bt, token_adapter_idx, sorted_token_idx, row_ranks};

  at::Tensor residual = x;  // [T, H]
  at::Tensor h = at::empty_like(x);  // [T, H]
  rms_norm_cpu(h, x, input_norms[0], eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    if (l > 0) add_rms_norm_cpu(h, residual, input_norms[l], eps);
    at::Tensor qkv_out = packed_linear(h, qkv[l], qkv_bias.get(l));  // [T, q_size + 2 kv_size]
    TORCH_CHECK(qkv_out.size(1) == q_size + 2 * kv_size, "layer ", l, "'s qkv width is not (Hq + 2 Hkv) * D");
    lora.add(qkv_out, h, l, 0, qkv_bounds);
    rotary_neox_cpu(qkv_out, positions, cos_sin, num_heads + num_kv_heads);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    store_rows(qkv_out, q_size, kv_size, k_cache, slot_ptr);
    store_rows(qkv_out, q_size + kv_size, kv_size, v_cache, slot_ptr);
    const at::Tensor q = qkv_out.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});  // [T, Hq, D]
    const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
                                .view({num_tokens, q_size});  // [T, Hq * D]
    at::Tensor o_out = packed_linear(attn, o[l], std::nullopt);  // [T, H]
    lora.add(o_out, attn, l, 1, o_bounds);
    add_rms_norm_cpu(o_out, residual, post_norms[l], eps);
    at::Tensor gate_up_out = packed_linear(o_out, gate_up[l], std::nullopt);  // [T, 2I]
    lora.add(gate_up_out, o_out, l, 2, gate_up_bounds);
    at::Tensor act = at::empty({num_tokens, gate_up_out.size(1) / 2}, x.options());  // [T, I]
    silu_and_mul_cpu(act, gate_up_out);
    h = packed_linear(act, down[l], std::nullopt);  // [T, H]
    lora.add(h, act, l, 3, down_bounds);
  }
  add_rms_norm_cpu(h, residual, final_norm, eps);
  return h;
}

TORCH_LIBRARY_FRAGMENT(loraplex, m) {
  m.def(
      "decode_layers_cpu(Tensor(a!) x, Tensor positions, Tensor cos_sin, Tensor slots, Tensor block_tables, "
      "Tensor context_lens, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] input_norms, Tensor[] qkv, "
      "Tensor?[] qkv_bias, Tensor[] o, Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor final_norm, "
      "int num_heads, int num_kv_heads, float eps, float scale, Tensor?[] lora_a, Tensor?[] lora_bt, "
      "Tensor? token_adapter_idx, Tensor? sorted_token_idx, Tensor? row_ranks, int[] qkv_bounds, int[] o_bounds, "
      "int[] gate_up_bounds, int[] down_bounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex, CPU, m) { m.impl("decode_layers_cpu", &decode_layers_cpu); }

// oneDNN's prepacked weights are oneDNN tensors: their dispatch key picks this op's kernel.
TORCH_LIBRARY_IMPL(loraplex, MkldnnCPU, m) { m.impl("decode_layers_cpu", &decode_layers_cpu); }
