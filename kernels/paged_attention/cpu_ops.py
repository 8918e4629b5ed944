"""Paged attention for CPU: the torch path, with decode attention in C++ reading K/V in place (kernels/cpu_native.py).

Decode is where a gather costs most: each step copies every running sequence's whole context out of the pool
and reads it again, three passes over memory for one. The C++ kernel reads each K/V row once, in place. Prefill
and the K/V stores are the torch path's (large matmuls there; the copy is a small share).
"""

from functools import partial

import torch
from torch import Tensor

from .. import cpu_native
from . import torch_ops
from .meta import PagedAttentionMeta

store_kv = torch_ops.store_kv


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """As torch_ops.attention, decode tokens through the C++ kernel (on CPU, where it builds: float32, and
    bfloat16 with head_dim a multiple of 16 up to 128 and at most 8 q heads per kv head, computed in fp32).
    q: [T, Hq, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D] · returns [T, Hq, D]"""
    native = cpu_native.load()
    if native is None or q.device.type != "cpu" or not _kernel_takes(q, k_cache):
        return torch_ops.attention(q, k_cache, v_cache, meta, scale)
    return torch_ops.attention(q, k_cache, v_cache, meta, scale, decode=partial(_decode, native))


def _kernel_takes(q: Tensor, k_cache: Tensor) -> bool:
    if q.dtype == torch.float32:
        return True
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    return q.dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 128 and group <= 8


def _decode(native, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """One new token per decode seq, K/V read in place; q: [D, Hq, Dh] · returns [D, Hq, Dh]."""
    return native.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
