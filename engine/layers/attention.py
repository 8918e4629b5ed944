"""Attention over the paged KV cache: stores this step's K/V in the layer's blocks, then attends (every token, or
the output rows only in the model's last layer)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.step_meta import OutputRows
from kernels.paged_attention import PagedAttentionMeta, get_paged_attention


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch"):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = get_paged_attention(backend)
        # [num_blocks, block_size, num_kv_heads, head_dim] each; views into the runner's pool
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMeta, only: OutputRows | None = None):
        """q: [T, Hq, D], k / v: [T, Hkv, D] -> [T, Hq, D]; with `only`, every token's K/V is stored but only its B
        rows attend (as decode queries over their whole context): -> [B, Hq, D]."""
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta)
        if only is not None:
            return self.ops.attention(q[only.rows], self.k_cache, self.v_cache, only.attn, self.scale)
        return self.ops.attention(q, self.k_cache, self.v_cache, meta, self.scale)
