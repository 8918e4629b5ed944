"""Paged attention: torch ops vs a naive per-seq fp32 reference; Triton ops (interpreted on CPU) vs torch."""

import os
import subprocess
import sys
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from kernels.paged_attention import PagedAttentionMeta, get_paged_attention, paged_attention
from kernels.paged_attention import meta as meta_module

torch_ops = get_paged_attention("torch")

# (cached tokens, new tokens) per prefill seq; context length per decode seq.
SCENARIOS = {
    "mixed": ([(0, 7), (5, 12), (16, 3)], [1, 9, 33, 17]),
    "prefill_only": ([(0, 20), (3, 1), (9, 6)], []),
    "decode_only": ([], [5, 1, 40]),
    "causal_prefill": ([(0, 5), (0, 19)], [4, 16]),
    "uniform_prefill": ([(0, 12), (0, 12), (0, 12)], [4, 16]),
    "long": ([(0, 130), (100, 70)], [300, 77]),
}
GQA = [(4, 4), (4, 2), (8, 2), (9, 3)]  # (Hq, Hkv): ratios 1, 2, 4, 3 (SmolLM2's 9 / 3)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"  # the Triton tests run compiled on a GPU where there is one


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]: cached prefixes written, the rest random
    v_cache: torch.Tensor
    expected_k_cache: torch.Tensor  # what store_kv must leave
    expected_v_cache: torch.Tensor
    expected: torch.Tensor  # [T, Hq, D] naive attention, zeros for pad tokens
    meta: PagedAttentionMeta
    scale: float


def naive_attention(q, k, v, scale):
    """q: [n, Hq, D] are the last n positions of k, v: [ctx, Hkv, D]; causal, fp32."""
    n, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, n, ctx]
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]  # [n, ctx]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def random_block_tables(context_lens, block_size, spare, generator=None):
    """Shuffled distinct block ids, with `spare` unused blocks past each seq's end; and the pool size."""
    blocks_per_seq = [-(-ctx // block_size) + spare for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    ends = torch.tensor(blocks_per_seq).cumsum(0).tolist()
    return [perm[end - nb : end] for nb, end in zip(blocks_per_seq, ends, strict=True)], num_blocks


def slots_of(table, positions, block_size):
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def make_batch(
    scenario, num_heads, num_kv_heads, block_size, head_dim=32, num_pad=0, dtype=torch.float32, device="cpu"
) -> Batch:
    """Random seqs on random non-contiguous blocks; the step's tokens are prefill chunks, decodes, pads.
    A prefill chunk after a cached prefix has its first new token already cached, with slot -1.
    Drawn on the CPU (the same numbers for every device), then moved to `device`."""
    gen = torch.Generator().manual_seed(0)
    prefills, decodes = SCENARIOS[scenario]
    seqs = [*prefills, *((ctx - 1, 1) for ctx in decodes)]  # (cached, new)
    tables, num_blocks = random_block_tables([c + n for c, n in seqs], block_size, spare=1, generator=gen)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_shape = (num_kv_heads, head_dim)
    caches = [randn(num_blocks, block_size, *kv_shape) for _ in range(2)]  # k_cache, v_cache
    expected_caches = [c.clone() for c in caches]
    q_rows, k_rows, v_rows, slots, outs = [], [], [], [], []
    for s, ((cached, new), table) in enumerate(zip(seqs, tables, strict=True)):
        kv_seq = [randn(cached + new, *kv_shape) for _ in range(2)]  # this seq's k, v
        seq_slots = torch.tensor(slots_of(table, range(cached + new), block_size))
        pre_cached = cached + (1 if s < len(prefills) and cached and new > 1 else 0)
        for cache, expected_cache, x in zip(caches, expected_caches, kv_seq, strict=True):
            expected_cache.view(-1, *kv_shape)[seq_slots] = x
            cache.view(-1, *kv_shape)[seq_slots[:pre_cached]] = x[:pre_cached]
        slots += [-1] * (pre_cached - cached) + seq_slots[pre_cached:].tolist()
        q_rows.append(randn(new, num_heads, head_dim))
        k_rows.append(kv_seq[0][cached:])
        v_rows.append(kv_seq[1][cached:])
        outs.append(naive_attention(q_rows[-1], *kv_seq, head_dim**-0.5))
    q_rows.append(randn(num_pad, num_heads, head_dim))
    k_rows.append(randn(num_pad, *kv_shape))
    v_rows.append(randn(num_pad, *kv_shape))
    outs.append(torch.zeros(num_pad, num_heads, head_dim))
    meta = PagedAttentionMeta.build(
        torch.tensor(slots + [-1] * num_pad),
        block_size,
        prefill_q_lens=[n for _, n in prefills],
        prefill_context_lens=[c + n for c, n in prefills],
        prefill_block_tables=tables[: len(prefills)],
        decode_context_lens=decodes,
        decode_block_tables=tables[len(prefills) :],
        device=device,
    )
    q, k, v, expected = (torch.cat(rows).to(device) for rows in (q_rows, k_rows, v_rows, outs))
    caches, expected_caches = [c.to(device) for c in caches], [c.to(device) for c in expected_caches]
    return Batch(q, k, v, *caches, *expected_caches, expected, meta, head_dim**-0.5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_ops_match_naive_reference(scenario, num_heads, num_kv_heads, block_size):
    b = make_batch(scenario, num_heads, num_kv_heads, block_size, num_pad=2)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(b.k_cache, b.expected_k_cache, rtol=0, atol=0)
    torch.testing.assert_close(b.v_cache, b.expected_v_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scenario", ["mixed", "decode_only", "long"])
def test_decode_split_into_length_groups_matches_naive_reference(scenario, monkeypatch):
    monkeypatch.setattr(meta_module, "DECODE_GROUP_KEYS", 48)  # force several groups of sorted lengths
    b = make_batch(scenario, 8, 2, 4)
    groups = b.meta.decode_groups
    assert len(groups) > 1 and sorted(torch.cat([g.rows for g in groups]).tolist()) == list(
        range(b.meta.num_decode_seqs)
    )
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
@pytest.mark.parametrize("scenario", ["mixed", "causal_prefill"])
def test_non_contiguous_qkv_and_every_slot_stored(backend, scenario):
    """q, k, v as the model makes them: views into one fused qkv projection."""
    b = make_batch(scenario, 8, 2, 16, device=TRITON_DEVICE if backend == "triton" else "cpu")
    assert (b.meta.store_token_idx is None) == (scenario == "causal_prefill")
    qkv = torch.cat([b.q.flatten(1), b.k.flatten(1), b.v.flatten(1)], dim=1)  # [T, (Hq + 2 Hkv) * D]
    q, k, v = qkv.split([b.q[0].numel(), b.k[0].numel(), b.v[0].numel()], dim=1)
    q, k, v = q.view(b.q.shape), k.view(b.k.shape), v.view(b.v.shape)
    out = paged_attention(q, k, v, b.k_cache, b.v_cache, b.meta, b.scale, backend=backend)
    torch.testing.assert_close(b.k_cache, b.expected_k_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


def test_meta_for_empty_parts():
    meta = make_batch("decode_only", 4, 2, 4).meta
    assert meta.num_prefill_seqs == 0 and meta.num_prefill_tokens == 0
    assert meta.prefill_cu_seqlens_q.tolist() == [0] and meta.prefill_block_tables.shape[0] == 0
    meta = make_batch("prefill_only", 4, 2, 4).meta
    assert meta.num_decode_seqs == 0 and meta.decode_block_tables.shape[0] == 0
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 20, 21, 27]
    assert meta.prefill_cu_seqlens_q.dtype == meta.prefill_context_lens.dtype == torch.int32
    assert meta.max_prefill_q_len == 20 and meta.max_prefill_context_len == 20
    assert not meta._prefill_seqs_made  # the torch path's per-seq prefills: made when first read, then kept
    assert meta.prefill_seqs is not None and [s.mask is None for s in meta.prefill_seqs] == [True, False, False]
    assert meta._prefill_seqs_made and meta.prefill_seqs is meta.prefill_seqs
    assert make_batch("causal_prefill", 4, 2, 4).meta.prefill_seqs is not None  # lengths differ
    uniform = make_batch("uniform_prefill", 4, 2, 4).meta
    assert uniform.prefill_seqs is None  # one padded batch, exact
    assert uniform.store_token_idx is None and uniform.store_slots is uniform.slot_mapping  # all stored: one copy


def test_meta_rejects_inconsistent_seqs():
    slots = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match="q_len"):
        PagedAttentionMeta.build(slots, 4, [5], [3], [[0]], [], [], "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        PagedAttentionMeta.build(slots, 4, [6], [6], [[0]], [], [], "cpu")
    with pytest.raises(ValueError, match="fewer"):
        PagedAttentionMeta.build(slots[:1], 4, [2], [2], [[0]], [], [], "cpu")
    with pytest.raises(ValueError, match="differ in length"):
        PagedAttentionMeta.build(slots, 4, [], [], [], [3, 4], [[0]], "cpu")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_cpu_ops_match_naive_reference(scenario, num_heads, num_kv_heads, block_size, require_cpu_kernel):
    """The C++ decode kernel reads K/V in place: the same outputs as the naive reference, pads zero."""
    b = make_batch(scenario, num_heads, num_kv_heads, block_size, num_pad=2)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="cpu")
    torch.testing.assert_close(b.k_cache, b.expected_k_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 64, 128])
def test_cpu_ops_any_head_dim(head_dim, require_cpu_kernel):
    """Head dims the vectorized path unrolls (multiples of the vector width) and others (its plain loops)."""
    b = make_batch("long", 8, 2, 16, head_dim=head_dim)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="cpu")
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (9, 3)])
def test_cpu_ops_bfloat16_decode_runs_in_the_kernel_close_to_fp32(
    num_heads, num_kv_heads, require_cpu_kernel, monkeypatch
):
    """bf16 K/V are widened as they are read and everything is computed in fp32: close to the fp32 torch path
    on the same (bf16) values, to bf16's own rounding of the output."""
    from kernels.paged_attention import cpu_ops

    calls, decode = [], cpu_ops._decode
    monkeypatch.setattr(cpu_ops, "_decode", lambda *args: calls.append(1) or decode(*args))
    b = make_batch("mixed", num_heads, num_kv_heads, 16, head_dim=64, num_pad=1, dtype=torch.bfloat16)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="cpu")
    assert calls and out.dtype == torch.bfloat16
    k_cache, v_cache = b.k_cache.float(), b.v_cache.float()
    reference = paged_attention(b.q.float(), b.k.float(), b.v.float(), k_cache, v_cache, b.meta, b.scale)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["mixed", "long", "uniform_prefill"])
def test_cpu_ops_prefill_runs_in_the_kernel_over_cached_prefixes(scenario, dtype, require_cpu_kernel, monkeypatch):
    """Prefill chunks after a cached prefix and fresh prompts, through the C++ prefill (counted): the naive fp32
    reference's outputs in fp32; in bf16 the fp32 path's on the same bf16 values, to bf16's rounding."""
    from kernels.paged_attention import cpu_ops

    calls, prefill = [], cpu_ops._prefill
    monkeypatch.setattr(cpu_ops, "_prefill", lambda *args: calls.append(1) or prefill(*args))
    b = make_batch(scenario, 9, 3, 16, head_dim=64, num_pad=1, dtype=dtype)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="cpu")
    assert calls and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)
        return
    k_cache, v_cache = b.k_cache.float(), b.v_cache.float()
    reference = paged_attention(b.q.float(), b.k.float(), b.v.float(), k_cache, v_cache, b.meta, b.scale)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def test_cpu_prefill_kernel_refuses_what_its_tables_do_not_hold(require_cpu_kernel):
    b = make_batch("prefill_only", 4, 2, 4)
    m = b.meta
    args = (b.k_cache, b.v_cache, m.prefill_block_tables, m.prefill_cu_seqlens_q, m.prefill_context_lens, b.scale)
    require_cpu_kernel.paged_prefill_attention(b.q, *args)  # as built: fine
    bad_table = m.prefill_block_tables.clone()
    bad_table[0, 0] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        require_cpu_kernel.paged_prefill_attention(b.q, b.k_cache, b.v_cache, bad_table, *args[3:])
    short = m.prefill_context_lens.clone()
    short[0] = 3  # fewer keys than the sequence's 20 new tokens
    with pytest.raises(RuntimeError, match="q_len"):
        require_cpu_kernel.paged_prefill_attention(b.q, *args[:4], short, b.scale)
    with pytest.raises(RuntimeError, match="head_dim"):
        require_cpu_kernel.paged_prefill_attention(
            b.q[..., :24], *(c[..., :24].contiguous() for c in args[:2]), *args[2:]
        )


def test_cpu_decode_kernel_refuses_tables_and_lengths_out_of_range(require_cpu_kernel):
    b = make_batch("decode_only", 4, 2, 4)
    d = b.meta
    q = b.q[d.num_prefill_tokens :]
    bad_table = d.decode_block_tables.clone()
    bad_table[0, 0] = b.k_cache.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        require_cpu_kernel.paged_decode_attention(q, b.k_cache, b.v_cache, bad_table, d.decode_context_lens, b.scale)
    lens = d.decode_context_lens
    too_long = lens.clone()
    too_long[0] = d.decode_block_tables.shape[1] * 4 + 1  # more keys than its table holds
    with pytest.raises(RuntimeError, match="context_lens"):
        require_cpu_kernel.paged_decode_attention(q, b.k_cache, b.v_cache, d.decode_block_tables, too_long, b.scale)
    with pytest.raises(RuntimeError, match="float32"):
        require_cpu_kernel.paged_decode_attention(
            q.double(), b.k_cache, b.v_cache, d.decode_block_tables, lens, b.scale
        )


def test_backend_by_name():
    with pytest.raises(ValueError, match="unknown paged attention backend"):
        get_paged_attention("cuda")


def test_kernels_import_lazily_and_nothing_of_ours():
    code = (
        "import sys, kernels.paged_attention\n"
        "assert 'triton' not in sys.modules\n"
        "ours = ('engine', 'adapters', 'registry', 'gateway')\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ours]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


TRITON_CASES = [  # the interpreter is slow: "long" only with blocks of 16
    (scenario, num_heads, num_kv_heads, block_size)
    for scenario in SCENARIOS
    for num_heads, num_kv_heads in [(4, 4), (8, 2)]
    for block_size in [4, 16]
    if scenario != "long" or block_size == 16
]


@pytest.mark.parametrize(("scenario", "num_heads", "num_kv_heads", "block_size"), TRITON_CASES)
def test_triton_ops_match_torch_ops(scenario, num_heads, num_kv_heads, block_size):
    triton_ops = get_paged_attention("triton")
    b = make_batch(scenario, num_heads, num_kv_heads, block_size, num_pad=2, device=TRITON_DEVICE)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    triton_ops.store_kv(b.k, b.v, k_cache, v_cache, b.meta)
    torch_ops.store_kv(b.k, b.v, b.k_cache, b.v_cache, b.meta)
    torch.testing.assert_close(k_cache, b.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, b.v_cache, rtol=0, atol=0)
    out = triton_ops.attention(b.q, k_cache, v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, torch_ops.attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale))
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("scenario", "block_size"), [("long", 16), ("mixed", 4), ("decode_only", 16)])
def test_triton_split_decode_matches_naive_reference(scenario, block_size, monkeypatch):
    """Decode keys split into partitions of 64 (flash-decoding) and merged: the same outputs; partitions past a
    short context (decode_only has contexts of 1, 5, 40) must add nothing."""
    triton_ops = get_paged_attention("triton")
    monkeypatch.setattr(triton_ops, "DECODE_PARTITION", 64)
    b = make_batch(scenario, 8, 2, block_size, num_pad=2, device=TRITON_DEVICE)
    assert triton_ops.decode_partition(b.meta.num_decode_seqs * 2, b.meta.max_decode_context_len, 64, b.q.device)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="triton")
    torch.testing.assert_close(out, b.expected, rtol=1e-5, atol=1e-5)


def test_triton_splits_decode_only_where_the_device_would_idle():
    triton_ops = get_paged_attention("triton")
    cuda = torch.device("cuda")
    triton_ops.multiprocessors.cache_clear()
    try:
        with mock.patch("torch.cuda.get_device_properties") as props:
            props.return_value.multi_processor_count = 132
            assert triton_ops.decode_partition(256 * 8, 4096, 64, cuda) is None  # 2048 programs already
            assert triton_ops.decode_partition(8 * 8, 8192, 64, cuda) == 1024  # 9 parts wanted: 8 of 2**10
            assert triton_ops.decode_partition(8 * 8, triton_ops.MIN_PARTITION, 64, cuda) is None  # too short
            assert triton_ops.decode_partition(1, 1 << 20, 64, cuda) == (1 << 20) // triton_ops.MAX_PARTS
    finally:
        triton_ops.multiprocessors.cache_clear()
    assert triton_ops.decode_partition(8, 8192, 64, torch.device("cpu")) is None  # the interpreter: never
    with mock.patch.object(triton_ops, "DECODE_PARTITION", 0):
        assert triton_ops.decode_partition(8, 8192, 64, cuda) is None  # 0: never split


BF16_DOT_BROKEN = pytest.mark.skipif(
    INTERPRETED, reason="Triton's interpreter tl.dot multiplies bf16 bit patterns (triton#11584)"
)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_BROKEN)])
def test_triton_ops_half_precision(dtype):
    b = make_batch("mixed", 8, 2, 16, num_pad=1, dtype=dtype, device=TRITON_DEVICE)
    out = paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale, backend="triton")
    assert out.dtype == dtype
    torch.testing.assert_close(b.k_cache, b.expected_k_cache, rtol=0, atol=0)
    ref = torch_ops.attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, b.scale)
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_triton_rejects_odd_head_dim():
    b = make_batch("decode_only", 4, 2, 4, head_dim=24, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        get_paged_attention("triton").attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_ops_match_torch_ops_on_cuda(dtype):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    prefills = [(0, 700), (300, 512), (1000, 33)]
    decodes = torch.randint(1, 1000, (64,)).tolist()
    tables, num_blocks = random_block_tables([c + n for c, n in prefills] + decodes, block_size, spare=0)
    positions = [range(c, c + n) for c, n in prefills] + [[ctx - 1] for ctx in decodes]
    slots = [slot for ps, t in zip(positions, tables, strict=True) for slot in slots_of(t, ps, block_size)]
    meta = PagedAttentionMeta.build(
        torch.tensor(slots), block_size, [n for _, n in prefills], [c + n for c, n in prefills],
        tables[: len(prefills)], decodes, tables[len(prefills) :], "cuda",
    )  # fmt: skip
    q = torch.randn(len(slots), num_heads, head_dim, device="cuda", dtype=dtype)
    k, v = torch.randn(2, len(slots), num_kv_heads, head_dim, device="cuda", dtype=dtype)
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    ref_k, ref_v = k_cache.float(), v_cache.float()
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5, backend="triton")
    ref = paged_attention(q.float(), k.float(), v.float(), ref_k, ref_v, meta, head_dim**-0.5)
    torch.testing.assert_close(k_cache.float(), ref_k, rtol=0, atol=0)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
