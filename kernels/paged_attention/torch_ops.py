"""Paged attention in torch: the reference for the Triton kernels and the fast path on CPU.

Per layer only gathers and scaled_dot_product_attention: prefill as one [P, Hq, q_len, D] batch when every
prefill has the same length and no cached prefix, else one exact-length call per prefill sequence; decode as
[G, Hq, 1, D] batches of similar-length seqs against the shared kv heads (GQA). Every index comes from the meta.
Whole blocks are gathered and the unused slots masked, and a masked NaN still poisons the softmax: cache
slots never written must hold finite values (allocate caches with torch.zeros, not torch.empty).
"""

from collections.abc import Callable

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


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: PagedAttentionMeta,
    scale: float,
    decode: Callable[[Tensor, Tensor, Tensor, PagedAttentionMeta, float], Tensor] | None = None,
    prefill: Callable[[Tensor, Tensor, Tensor, PagedAttentionMeta, float], Tensor] | None = None,
) -> Tensor:
    """out[t] = softmax(scale * q[t] @ K_s.T) @ V_s over the keys of t's seq s up to t's position (causal),
    read from the cache through s's block table; kv head of q head h is h // (Hq // Hkv); pad tokens get 0.
    q: [T, Hq, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D] · returns [T, Hq, D]
    decode, prefill: the decode and prefill tokens' attention, with decode_attention's and prefill_attention's
    signatures (default: those; the cpu backend gives its C++ kernels)."""
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"the cache has blocks of {k_cache.shape[1]}, the meta of {meta.block_size}")
    decode, prefill = decode or decode_attention, prefill or prefill_attention
    num_prefill, num_decode = meta.num_prefill_tokens, meta.num_decode_seqs
    if num_prefill == 0 and num_decode == q.shape[0]:  # a decode step: no copy into a batch-wide output
        return decode(q, k_cache, v_cache, meta, scale)
    if num_decode == 0 and num_prefill == q.shape[0]:  # prompts only
        return prefill(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
    if num_prefill:
        out[:num_prefill] = prefill(q, k_cache, v_cache, meta, scale)
    if num_decode:
        rows = slice(num_prefill, num_prefill + num_decode)
        out[rows] = decode(q[rows], k_cache, v_cache, meta, scale)
    out[num_prefill + num_decode :] = 0
    return out


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """Attention of the prefill tokens q[:num_prefill_tokens]; returns [num_prefill_tokens, Hq, D]."""
    if meta.prefill_seqs is not None:
        return _prefill_per_seq(q, k_cache, v_cache, meta, scale)
    num_seqs, max_q = meta.num_prefill_seqs, meta.max_prefill_q_len  # equal lengths, nothing cached
    num_heads, head_dim = q.shape[1:]
    padded_q = q[: meta.num_prefill_tokens].reshape(num_seqs, max_q, num_heads, head_dim)
    k = _gather_kv(k_cache, meta.prefill_kv_blocks, num_seqs)  # [P, Hkv, L, D]
    v = _gather_kv(v_cache, meta.prefill_kv_blocks, num_seqs)
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),  # [P, Hq, max_q, D]
        k,
        v,
        is_causal=True,  # keys past each seq's end are only seen by no query
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )  # [P, Hq, max_q, D]
    return out.transpose(1, 2).reshape(meta.num_prefill_tokens, num_heads, head_dim)


def _prefill_per_seq(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """One exact-length attention per prefill seq: no padding, and the causal kernel skips masked tiles.
    A loop over sequences (not tokens or blocks): padding mixed lengths to one batch costs far more."""
    num_heads, head_dim = q.shape[1:]
    out = torch.empty(meta.num_prefill_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for seq in meta.prefill_seqs:
        rows = slice(seq.token_start, seq.token_start + seq.q_len)
        k = _gather_kv(k_cache, seq.kv_blocks, 1)[:, :, : seq.context_len]  # [1, Hkv, ctx, D]
        v = _gather_kv(v_cache, seq.kv_blocks, 1)[:, :, : seq.context_len]
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
            k,
            v,
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=scale,
            enable_gqa=num_heads != k.shape[1],
        )[0].transpose(0, 1)
    return out


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """Attention of one new token per decode seq; q: [D, Hq, D] · returns [D, Hq, D]. Seqs of similar
    length go together, so padding to a group's longest context wastes little and copies stay small."""
    num_heads, head_dim = q.shape[1:]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in meta.decode_groups:
        num_seqs = group.rows.shape[0]
        k = _gather_kv(k_cache, group.kv_blocks, num_seqs)  # [G, Hkv, L, D]
        v = _gather_kv(v_cache, group.kv_blocks, num_seqs)
        group_out = F.scaled_dot_product_attention(
            q.index_select(0, group.rows).unsqueeze(2),  # [G, Hq, 1, D]
            k,
            v,
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=num_heads != k.shape[1],
        )  # [G, Hq, 1, D]
        out.index_copy_(0, group.rows, group_out.view(num_seqs, num_heads, head_dim))
    return out


def _gather_kv(cache: Tensor, blocks: Tensor, num_seqs: int) -> Tensor:
    """Whole blocks of each seq, as a strided [S, Hkv, nb * block_size, D] view of one [S * nb, ...] copy."""
    num_kv_heads, head_dim = cache.shape[2:]
    gathered = cache.index_select(0, blocks)  # [S * nb, block_size, Hkv, D]
    return gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
