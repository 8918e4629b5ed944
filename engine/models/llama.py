"""The Llama family's forward pass (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm).

Packed projections: `qkv_proj` = [q; k; v] rows and `gate_up_proj` = [gate; up] rows, as the loader fills
them from the checkpoint's separate tensors (see `packed_modules`). Signatures stay
`forward(input_ids, positions, meta)`: attention reads the step's `meta.attn`, and the LoRA-able projections
(`lora_targets`) take `meta.lora` through `apply_linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import PagedAttention
from engine.layers.lora_linear import apply_linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rope, RotaryEmbedding, apply_rotary, rotate_heads
from engine.models.arch import ModelArch
from engine.step_meta import OutputRows, StepMeta
from kernels.fused import fused_ops
from kernels.lora import LoraMeta

# checkpoint name -> (our packed module, which slice)
packed_modules = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# our LoRA-able module -> the checkpoint / PEFT modules it packs, in slice order
lora_targets = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, attention_backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.output_slices = (self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.output_slices), bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, attention_backend)

    def forward(self, x: torch.Tensor, rope: Rope, meta: StepMeta, last: OutputRows | None = None):
        """x: [T, H] -> [T, H]; with `last` (the model's last layer) K/V for all T rows, the rest for its B rows."""
        num_tokens = x.shape[0]
        qkv = apply_linear(self.qkv_proj, x, meta.lora)  # [T, q_size + 2 kv_size]
        q, k, v = qkv.split(self.output_slices, dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, Hq, D]
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        else:  # q and k side by side in qkv: their heads rotate together, as one [T, Hq + Hkv, D]
            qk = rotate_heads(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, meta.attn, last)  # [T, Hq, D], or [B, Hq, D] for the output rows
        lora = meta.lora if last is None else last.lora
        return apply_linear(self.o_proj, out.reshape(out.shape[0], self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraMeta | None) -> torch.Tensor:
        gate_up = apply_linear(self.gate_up_proj, x, lora)  # [T, 2I]
        native = fused_ops(gate_up) if gate_up.stride(-1) == 1 else None
        if native is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return apply_linear(self.down_proj, F.silu(gate) * up, lora)
        hidden = torch.empty(gate_up.shape[0], self.intermediate_size, dtype=gate_up.dtype)  # [T, I]
        native.silu_and_mul_cpu(hidden, gate_up)
        return apply_linear(self.down_proj, hidden, lora)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, attention_backend: str):
        super().__init__()
        self.self_attn = Attention(arch, attention_backend)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, residual, rope, meta, last: OutputRows | None = None):
        """[T, H] in; [T, H] out, or [B, H] for `last`'s rows (see StepMeta.output_rows)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, meta, last)
        if last is not None:
            residual = residual[last.rows]  # [B, H]
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x, meta.lora if last is None else last.lora), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, attention_backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, attention_backend) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.decode_stack = None  # the runner's DecodeStack where it applies: decode steps' layers in one C++ call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta):
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.decode_stack is not None and self.decode_stack.takes(meta):
            return self.decode_stack(x, positions, meta)
        rope = self.rotary(positions)  # once per step, shared by every layer
        residual = None
        *layers, last_layer = self.layers
        for layer in layers:
            x, residual = layer(x, residual, rope, meta)
        x, residual = last_layer(x, residual, rope, meta, meta.output_rows)
        x, _ = self.norm.add_and_norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, attention_backend: str = "torch"):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, attention_backend)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H], or [B, H] for meta.output_rows' rows."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (only the rows that sample) -> logits [B, V] in fp32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def lora_owners(self, layer_idx: int) -> dict[str, nn.Module]:
        """For each LoRA-able module name, the module that holds it as an attribute."""
        layer = self.model.layers[layer_idx]
        return {
            "qkv_proj": layer.self_attn,
            "o_proj": layer.self_attn,
            "gate_up_proj": layer.mlp,
            "down_proj": layer.mlp,
        }
