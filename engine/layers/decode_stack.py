"""DecodeStack: a Llama-family model's decoder layers for a decode-only step in one C++ call (kernels/decode_stack).

The layer-by-layer forward makes about fifteen op calls per layer per step from Python; on CPU each costs
microseconds of interpreter and dispatch time, on the step's critical path and with the GIL held (which a server's
event loop waits for): ~5 ms of a 30-layer model's 60 ms step. The C++ op calls the same kernels on the same tensors
in the same order, so its results are the layer-by-layer forward's, bit for bit.

It applies where every piece has its C++ kernel: CPU, float32 (or bfloat16 where the decode kernel takes it),
prepacked linears (PackedLinear), the cpu attention backend, the cpu LoRA kernels when the step has adapters, no q/k
norm.
The model asks `takes(meta)` each step: decode tokens only, one per sequence, every one stored. Prefill and mixed
steps keep the layer-by-layer path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.layers.lora_linear import LoRALinear
from engine.layers.packed_linear import PackedLinear
from engine.step_meta import StepMeta
from kernels.decode_stack import decode_layers_op
from kernels.lora import cpu_ops as lora_cpu_ops
from kernels.lora.cpu_ops import slice_bounds, transposed
from kernels.paged_attention import cpu_ops as attention_cpu_ops

logger = logging.getLogger(__name__)

MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the op's order of each layer's projections


class DecodeStack:
    def __init__(self, model: nn.Module, op: Any):
        """model: a LlamaForCausalLM whose layers `build` checked."""
        inner = model.model
        self.op = op
        layers = list(inner.layers)
        self.attention = model.attention_layers()
        self.rotary = inner.rotary
        self.final_norm = inner.norm.weight
        first = self.attention[0]
        self.num_heads, self.num_kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.scale
        self.eps = inner.norm.eps
        projections = [_projections(model, i) for i in range(len(layers))]
        base = [[p.base if isinstance(p, LoRALinear) else p for p in layer] for layer in projections]
        self.input_norms = [layer.input_layernorm.weight for layer in layers]
        self.post_norms = [layer.post_attention_layernorm.weight for layer in layers]
        self.qkv, self.o, self.gate_up, self.down = ([layer[m].packed_weight for layer in base] for m in range(4))
        self.qkv_bias = [layer[0].bias for layer in base]
        # 4 per layer, in MODULES' order: the LoRALinear, or None for a projection without adapters
        self.lora = [p if isinstance(p, LoRALinear) else None for layer in projections for p in layer]
        self.lora_a = [None if p is None else p.lora_a for p in self.lora]  # the stacks, fixed; rows change in place
        self.bounds = [slice_bounds(_output_slices(p)) for p in projections[0]]

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStack | None:
        """The model's stack where the C++ op takes it (why not, at debug level, where it does not)."""
        reason = _unsupported(model)
        op = decode_layers_op() if reason is None else None
        if reason is None and op is None:
            reason = "the C++ CPU kernels are not built"
        if reason is not None:
            logger.debug("decode steps run layer by layer: %s", reason)
            return None
        return cls(model, op)

    def takes(self, meta: StepMeta) -> bool:
        """Whether this step is one the op runs: decode tokens only, one per sequence, each stored."""
        attn = meta.attn
        if attn.num_prefill_tokens or meta.output_rows is not None or attn.store_token_idx is not None:
            return False
        return attn.num_decode_seqs == attn.slot_mapping.shape[0]  # no padding tokens

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """x: [T, H] the step's embeddings (overwritten: the residual stream) -> [T, H] final hidden states."""
        attn, lora = meta.attn, meta.lora
        if lora is None or not lora.has_lora:
            lora_a, lora_bt, idx, order, ranks = [], [], None, None, None
        else:
            lora_a = self.lora_a
            lora_bt = [None if p is None else transposed(p.lora_b) for p in self.lora]
            idx, order, ranks = lora.token_adapter_idx, lora.sorted_token_idx, lora.row_ranks
        return self.op(
            x,
            positions,
            self.rotary.table(positions.device),
            attn.store_slots,
            attn.decode_block_tables,
            attn.decode_context_lens,
            [a.k_cache for a in self.attention],
            [a.v_cache for a in self.attention],
            self.input_norms,
            self.qkv,
            self.qkv_bias,
            self.o,
            self.post_norms,
            self.gate_up,
            self.down,
            self.final_norm,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            lora_a,
            lora_bt,
            idx,
            order,
            ranks,
            *self.bounds,
        )


def _projections(model: nn.Module, layer_idx: int) -> list[nn.Module]:
    """The layer's LoRA-able projections, in MODULES' order."""
    owners = model.lora_owners(layer_idx)
    return [getattr(owners[name], name) for name in MODULES]


def _output_slices(projection: nn.Module) -> tuple[int, ...]:
    if isinstance(projection, LoRALinear):
        return projection.output_slices
    return (projection.out_features,)


def _unsupported(model: nn.Module) -> str | None:
    """Why the C++ op cannot run this model's decode steps, or None."""
    arch = model.arch
    dtype = model.model.embed_tokens.weight.dtype
    if model.model.embed_tokens.weight.device.type != "cpu":
        return "not on the CPU"
    if arch.qk_norm:
        return "q/k norm"
    if not attention_cpu_ops.kernel_takes(dtype, arch.head_dim, arch.num_heads // arch.num_kv_heads):
        return f"no C++ decode attention for {dtype} with head_dim {arch.head_dim}"
    for layer_idx, layer in enumerate(model.model.layers):
        if layer.self_attn.attn.ops is not attention_cpu_ops:
            return "attention is not on the cpu backend"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.weight.dtype != dtype for norm in norms):
            return "norm weights of another dtype"
        if any(norm.eps != model.model.norm.eps for norm in norms):  # the op takes one eps for every norm
            return "norms with different eps"
        for name, projection in zip(MODULES, _projections(model, layer_idx)):
            if isinstance(projection, LoRALinear):
                if projection.ops is not lora_cpu_ops:
                    return "LoRA is not on the cpu backend"
                projection = projection.base
            if not isinstance(projection, PackedLinear):
                return "linear weights are not prepacked (PackedLinear)"
            if name != "qkv_proj" and projection.bias is not None:
                return f"{name} has a bias"
    if model.model.norm.weight.dtype != dtype:
        return "final norm weight of another dtype"
    return None
