"""Paged attention for CPU: the torch path, with decode and prefill attention in C++ reading K/V in place
(kernels/cpu_native.py).

Decode is where a gather costs most: each step copies every running sequence's whole context out of the pool
and reads it again, three passes over memory for one. The C++ kernel reads each K/V row once, in place. Prefill
takes each sequence's K/V once per kv head into fp32 tiles that stay in cache, and scores four query rows per K/V
vector loaded, where torch's attention of 128-token prompts ran at a quarter of the machine's speed. The K/V
stores are the torch path's.
"""

from functools import partial

import torch
from torch import Tensor

from .. import cpu_native
from . import torch_ops
from .meta import PagedAttentionMeta

store_kv = torch_ops.store_kv
PREFILL_HEAD_DIMS = (16, 32, 64, 128)  # the C++ prefill's (1 to 16 vectors on AVX2 and AVX-512 alike)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """As torch_ops.attention, decode and prefill tokens through the C++ kernels (on CPU, where they build: float32,
    and bfloat16 with head_dim a multiple of 16 up to 128 and at most 8 q heads per kv head, computed in fp32;
    prefill for head_dim 16, 32, 64 or 128). q: [T, Hq, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D] ·
    returns [T, Hq, D]"""
    native, group = cpu_native.load(), q.shape[1] // k_cache.shape[2]
    if native is None or q.device.type != "cpu" or not kernel_takes(q.dtype, q.shape[2], group):
        return torch_ops.attention(q, k_cache, v_cache, meta, scale)
    prefill = partial(_prefill, native) if q.shape[2] in PREFILL_HEAD_DIMS else None
    return torch_ops.attention(q, k_cache, v_cache, meta, scale, decode=partial(_decode, native), prefill=prefill)


def kernel_takes(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the C++ decode kernel takes q of `dtype`, heads of head_dim, `group` q heads per kv head."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 128 and group <= 8


def _prefill(native, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """Causal attention of every prefill seq's new tokens over its context, K/V read in place; q: [T, Hq, Dh] (its
    first num_prefill_tokens rows) · returns [num_prefill_tokens, Hq, Dh]."""
    return native.paged_prefill_attention(
        q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale
    )


def _decode(native, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """One new token per decode seq, K/V read in place; q: [D, Hq, Dh] · returns [D, Hq, Dh]."""
    return native.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
