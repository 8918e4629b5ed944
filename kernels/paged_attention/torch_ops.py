"""Paged attention in torch: the reference for the Triton kernels and the fast path on CPU.

Per layer only gathers and two scaled_dot_product_attention calls (prefill padded to [P, Hq, max_q, D],
decode as [D, Hkv, G, D] with the G query heads of a kv head as rows); every index comes from the meta.
Whole blocks are gathered and the unused slots masked, and a masked NaN still poisons the softmax: cache
slots never written must hold finite values (allocate caches with torch.zeros, not torch.empty).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .meta import PagedAttentionMeta


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (same for v) for every t with slot_mapping[t] >= 0.
    k, v: [T, Hkv, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D]"""
    if meta.store_token_idx is not None:
        k, v = k.index_select(0, meta.store_token_idx), v.index_select(0, meta.store_token_idx)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.store_slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.store_slots, v)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """out[t] = softmax(scale * q[t] @ K_s.T) @ V_s over the keys of t's seq s up to t's position (causal),
    read from the cache through s's block table; kv head of q head h is h // (Hq // Hkv); pad tokens get 0.
    q: [T, Hq, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D] · returns [T, Hq, D]"""
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"the cache has blocks of {k_cache.shape[1]}, the meta of {meta.block_size}")
    num_prefill, num_decode = meta.num_prefill_tokens, meta.num_decode_seqs
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
    if num_prefill:
        out[:num_prefill] = prefill_attention(q, k_cache, v_cache, meta, scale)
    if num_decode:
        decode = slice(num_prefill, num_prefill + num_decode)
        out[decode] = decode_attention(q[decode], k_cache, v_cache, meta, scale)
    out[num_prefill + num_decode :] = 0
    return out


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """Attention of the prefill tokens q[:num_prefill_tokens]; returns [num_prefill_tokens, Hq, D]."""
    num_seqs, max_q = meta.num_prefill_seqs, meta.max_prefill_q_len
    num_heads, head_dim = q.shape[1:]
    padded_q = q.index_select(0, meta.prefill_q_gather).view(num_seqs, max_q, num_heads, head_dim)
    k = _gather_kv(k_cache, meta.prefill_kv_blocks, num_seqs)  # [P, Hkv, L, D]
    v = _gather_kv(v_cache, meta.prefill_kv_blocks, num_seqs)
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),  # [P, Hq, max_q, D]
        k,
        v,
        attn_mask=meta.prefill_mask,
        is_causal=meta.prefill_mask is None,
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )  # [P, Hq, max_q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out.index_select(0, meta.prefill_q_unpad)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """Attention of one new token per decode seq; q: [D, Hq, D] · returns [D, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    k = _gather_kv(k_cache, meta.decode_kv_blocks, num_seqs)  # [D, Hkv, L, D]
    v = _gather_kv(v_cache, meta.decode_kv_blocks, num_seqs)
    num_kv_heads = k.shape[1]
    grouped_q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [D, Hkv, G, D]
    out = F.scaled_dot_product_attention(grouped_q, k, v, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _gather_kv(cache: Tensor, blocks: Tensor, num_seqs: int) -> Tensor:
    """Whole blocks of each seq, as a strided [S, Hkv, nb * block_size, D] view of one [S * nb, ...] copy."""
    num_kv_heads, head_dim = cache.shape[2:]
    gathered = cache.index_select(0, blocks)  # [S * nb, block_size, Hkv, D]
    return gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
