"""Paged attention in Triton: reshape_and_cache, a paged prefill kernel and a paged decode kernel.

Same signatures and semantics as torch_ops. Both attention kernels walk a seq's keys in tiles of BLOCK_N
positions, look each position's block up in the block table, and keep an online softmax in fp32.
Decode splits long contexts (flash-decoding, vLLM's paged_attention_v2): when a program per (seq, kv head) would
leave the GPU's multiprocessors idle, each program takes one partition of the keys and writes its partial softmax
state (max, sum, unnormalized output), and a second kernel merges the partitions of each (seq, q head).
Every kernel launches through FastLaunch (kernels/triton_launch.py). Imported only when the "triton" backend is
chosen.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_launch import FastLaunch, multiprocessors
from .meta import PagedAttentionMeta

PREFILL_BLOCK_M = 64  # query rows per prefill program
KEY_TILE = 64  # keys per online-softmax step (or one whole block, if larger)
MIN_DOT = 16  # tl.dot needs every dimension >= 16
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}  # the decode kernels' launch options (Triton's defaults)
PROGRAMS_PER_SM = 4  # split decode keys until about this many programs per multiprocessor are in flight
MIN_PARTITION = 512  # keys per split-decode part, at least (H100, 64 seqs of 512 keys: 2 parts of 256 moved 1.32
# TB/s, no split 2.19)
MAX_PARTS = 64  # partitions per seq, at most (the merge holds them all in registers)
# Keys per split-decode partition: None chooses from the batch and the device (above), 0 never splits, and a
# positive number forces that many keys per part (tests, `loraplex bench gpu --sweep`).
DECODE_PARTITION: int | None = None


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (same for v) for every t with slot_mapping[t] >= 0.
    k, v: [T, Hkv, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D]"""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, head_dim, meta.block_size)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need a contiguous last dim"
    if num_tokens == 0:
        return
    _store_kv(
        (num_tokens,),
        k, v, k_cache, v_cache, meta.slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, triton.next_power_of_2(num_kv_heads), head_dim,
    )  # fmt: skip


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMeta, scale: float) -> Tensor:
    """out[t] = softmax(scale * q[t] @ K_s.T) @ V_s over the keys of t's seq s up to t's position (causal),
    read from the cache through s's block table; kv head of q head h is h // (Hq // Hkv); pad tokens get 0.
    q: [T, Hq, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D] · returns [T, Hq, D]"""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check_cache(k_cache, v_cache, head_dim, meta.block_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    assert q.stride(-1) == 1, "q needs a contiguous last dim"
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    num_prefill, num_decode = meta.num_prefill_tokens, meta.num_decode_seqs
    out[num_prefill + num_decode :] = 0
    block_n = max(KEY_TILE, meta.block_size)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    strides = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    )  # fmt: skip
    if num_prefill:
        tables = meta.prefill_block_tables
        grid = (meta.num_prefill_seqs, triton.cdiv(meta.max_prefill_q_len, PREFILL_BLOCK_M), num_heads)
        _prefill(
            grid,
            out, q, k_cache, v_cache, tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale,
            *strides, tables.stride(0),
            group, head_dim, meta.block_size, block_n, precision, PREFILL_BLOCK_M,
        )  # fmt: skip
    if num_decode:
        tables = meta.decode_block_tables
        heads_pad = max(MIN_DOT, triton.next_power_of_2(group))
        partition = decode_partition(num_decode * num_kv_heads, meta.max_decode_context_len, block_n, q.device)
        if partition is None:
            _decode(
                (num_decode, num_kv_heads),
                out, q, k_cache, v_cache, tables, meta.decode_context_lens, scale, num_prefill,
                *strides, tables.stride(0),
                group, head_dim, meta.block_size, block_n, precision, heads_pad,
            )  # fmt: skip
        else:
            num_parts = triton.cdiv(meta.max_decode_context_len, partition)
            part_acc = torch.empty(num_decode, num_parts, num_heads, head_dim, dtype=torch.float32, device=q.device)
            part_max = torch.empty(num_decode, num_parts, num_heads, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)  # [D, num_parts, Hq]
            _decode_split(
                (num_decode, num_kv_heads, num_parts),
                part_acc, part_max, part_sum, q, k_cache, v_cache, tables, meta.decode_context_lens, scale,
                num_prefill, partition, q.stride(0), q.stride(1), *strides[4:], tables.stride(0),
                group, head_dim, meta.block_size, block_n, precision, heads_pad,
            )  # fmt: skip
            _decode_merge(
                (num_decode, num_heads),
                out, part_acc, part_max, part_sum, num_prefill, num_parts, out.stride(0), out.stride(1),
                head_dim, triton.next_power_of_2(num_parts),
            )  # fmt: skip
    return out


def decode_partition(programs: int, max_context_len: int, block_n: int, device: torch.device) -> int | None:
    """Keys per split-decode program (a multiple of block_n), or None when one program per (seq, kv head) already
    fills the device (or the contexts are too short to split)."""
    if DECODE_PARTITION is not None:
        return max(block_n, triton.cdiv(DECODE_PARTITION, block_n) * block_n) if DECODE_PARTITION else None
    if device.type != "cuda":
        return None
    wanted_parts = triton.cdiv(PROGRAMS_PER_SM * multiprocessors(device), programs)
    # a power of two: at most the wanted parts, so no second wave of programs (16 seqs of 4096 keys on an H100:
    # 4 parts of 1024 moved 2.44 TB/s, 5 of 832 2.15)
    partition = triton.next_power_of_2(triton.cdiv(max_context_len, min(wanted_parts, MAX_PARTS)))
    partition = max(MIN_PARTITION, block_n, partition)
    return partition if partition < max_context_len else None


def _check_cache(k_cache: Tensor, v_cache: Tensor, head_dim: int, block_size: int) -> None:
    if k_cache.shape[1] != block_size:
        raise ValueError(f"the cache has blocks of {k_cache.shape[1]}, the meta of {block_size}")
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton paged attention needs head_dim a power of two >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton paged attention needs block_size a power of two, got {block_size}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    if slot >= 0:
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [KV_HEADS_PAD, HEAD_DIM]
        cache_offs = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, key_start, context_len, q_pos,
    kv_head, scale, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [key_start, key_start + BLOCK_N); q_pos: [M] query positions."""
    key_pos = key_start + tl.arange(0, BLOCK_N)
    key_valid = key_pos < context_len
    blocks = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    offs = blocks[:, None] * stride_cb + (key_pos % BLOCK_SIZE)[:, None] * stride_cs
    offs += kv_head * stride_ch + tl.arange(0, HEAD_DIM)[None, :]  # [BLOCK_N, HEAD_DIM]
    k = tl.load(k_cache_ptr + offs, mask=key_valid[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, BLOCK_N]
    visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    v = tl.load(v_cache_ptr + offs, mask=key_valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Program (seq, row tile, q head): rows [tile * BLOCK_M, +BLOCK_M) of seq's new tokens, causal."""
    seq, tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        tokens = (q_start + rows).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM)
        q_offs = tokens[:, None] * stride_qt + head * stride_qh + dims[None, :]  # [BLOCK_M, HEAD_DIM]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)
        q_pos = context_len - q_len + rows  # [BLOCK_M]
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        key_end = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
        for key_start in range(0, key_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, key_start,
                context_len, q_pos, head // GROUP, scale, stride_cb, stride_cs, stride_ch,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
            )  # fmt: skip
        out = acc / l_i[:, None]
        out_offs = tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _decode_keys(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, scale, token_offset, seq, kv_head, context_len, key_begin,
    key_end, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    """The GROUP q heads of (seq, kv head), as rows of one tile, over keys [key_begin, key_end) of the seq's
    context_len: (acc, m_i, l_i) of the online softmax (acc unnormalized), with the tile's heads and valid rows."""
    token = (token_offset + seq).to(tl.int64)
    group_rows = tl.arange(0, HEADS_PAD)
    heads = kv_head * GROUP + group_rows
    row_valid = group_rows < GROUP
    q_offs = token * stride_qt + heads[:, None] * stride_qh + tl.arange(0, HEAD_DIM)[None, :]  # [HEADS_PAD, HEAD_DIM]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)
    q_pos = tl.full([HEADS_PAD], 0, dtype=tl.int32) + context_len - 1
    acc = tl.zeros([HEADS_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
    for key_start in range(key_begin, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, key_start,
            context_len, q_pos, kv_head, scale, stride_cb, stride_cs, stride_ch,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i, heads, row_valid


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale, token_offset,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv head): the GROUP q heads of that kv head, as rows of one tile, attend all keys."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    acc, _, l_i, heads, row_valid = _decode_keys(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, scale, token_offset, seq, kv_head, context_len, 0,
        context_len, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, HEADS_PAD,
    )  # fmt: skip
    out = acc / l_i[:, None]
    token = (token_offset + seq).to(tl.int64)
    out_offs = token * stride_ot + heads[:, None] * stride_oh + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _decode_split_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    context_lens_ptr, scale, token_offset, partition,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv head, part): the GROUP q heads attend keys [part * partition, +partition) of the seq;
    writes their running max, sum of exp and unnormalized output (a part past the context: max -inf, sum 0)."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    acc, m_i, l_i, heads, row_valid = _decode_keys(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, scale, token_offset, seq, kv_head, context_len,
        part * partition, tl.minimum(context_len, (part + 1) * partition),
        stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, HEADS_PAD,
    )  # fmt: skip
    # partials are laid out [seq, part, q head, (dim)], contiguous
    row = (seq.to(tl.int64) * tl.num_programs(2) + part) * (tl.num_programs(1) * GROUP) + heads  # [HEADS_PAD]
    tl.store(part_max_ptr + row, m_i, mask=row_valid)
    tl.store(part_sum_ptr + row, l_i, mask=row_valid)
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token_offset, num_parts, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PARTS_PAD: tl.constexpr,
):  # fmt: skip
    """Program (seq, q head): out = sum_p exp(m_p - m) acc_p / sum_p exp(m_p - m) l_p, m = max_p m_p."""
    seq, head = tl.program_id(0), tl.program_id(1)
    num_heads = tl.num_programs(1)
    parts = tl.arange(0, PARTS_PAD)
    part_valid = parts < num_parts
    rows = (seq.to(tl.int64) * num_parts + parts) * num_heads + head  # [PARTS_PAD]
    m_p = tl.load(part_max_ptr + rows, mask=part_valid, other=float("-inf"))
    l_p = tl.load(part_sum_ptr + rows, mask=part_valid, other=0.0)
    m = tl.max(m_p, axis=0)  # every seq has >= 1 key, so part 0 is finite
    weight = tl.where(part_valid & (l_p > 0), tl.exp(m_p - m), 0.0)  # [PARTS_PAD]
    dims = tl.arange(0, HEAD_DIM)
    acc_p = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=part_valid[:, None], other=0.0)
    out = tl.sum(acc_p * weight[:, None], axis=0) / tl.sum(l_p * weight, axis=0)  # [HEAD_DIM]
    token = (token_offset + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


_store_kv = FastLaunch(_store_kv_kernel)
_prefill = FastLaunch(_prefill_kernel)
_decode = FastLaunch(_decode_kernel, **DECODE_LAUNCH)
_decode_split = FastLaunch(_decode_split_kernel, **DECODE_LAUNCH)
_decode_merge = FastLaunch(_decode_merge_kernel)
