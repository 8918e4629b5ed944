"""Batched multi-LoRA shrink and expand in Triton: SGMV over the meta's adapter segments.

Same signatures and semantics as torch_ops. A program owns (tile of up to meta.tile_tokens tokens of one segment,
tile of output columns): the meta's tile table names the tile's segment and first token, so a launch holds no
program without tokens, whether its segments are one long prompt and a few decode tokens or a CUDA graph's
fixed one-segment-per-row layout. A program reads the segment's adapter row once, gathers its tokens through
sorted_token_idx, and accumulates tl.dot products in fp32.
The expand's second grid axis walks (slice, column tile), so a packed layer is one launch whatever its slices. An
expand program can walk a group of column tiles when one tile each would make more programs than the device holds at
once, its tokens looked up and z loaded once for the group (MAX_EXPAND_GROUP_TILES: one tile a program by default).
Split-K: a decode step's shrink has a few tiles of tokens, so one program per (tile, column tile) would leave most
multiprocessors idle while each walks all of H_in. `shrink_out` then gives the shrink a [P, T, S * R] fp32 buffer: a
third grid axis cuts H_in into P parts, each program writes its part's partial sums, and the expand adds the P
partials as it loads z (no atomics, no zeroing, the same rounding to the weights' dtype before its dot).
One launch: where a layer's shrink is small beside its output (`fused_pays`: few column tiles times H_in, a rank of
at most 64), `add_lora` runs both in one kernel (`lora_fused`): each (token tile, slice, column tile) program computes
its tokens' z for its slice, a [BLOCK_M, R] fp32 tile kept in registers, then adds z @ B.T to its columns of y. The
shrink is repeated once per column tile, which costs little where H_in and the tiles are few, and a decode step of a
small model is bound by its kernels' count and latency, not by their bytes.
Ranks and hidden sizes need not be powers of two: every load is masked and the rank is padded to 16 in
registers (tl.dot needs every dimension >= 16). Launched through FastLaunch (kernels/triton_launch.py: the compiled
kernel's own launcher, not the JIT's per-call binding). Imported only when the "triton" backend is chosen.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_launch import FastLaunch, multiprocessors
from .compose import compose_add_lora
from .meta import LoraMeta, check_expand, check_expand_shape, check_shrink, check_shrink_shape

MIN_DOT = 16  # tl.dot needs every dimension >= 16 (meta.tile_tokens is, too)
# Tile sizes and launch options chosen by `loraplex bench gpu --sweep` on an H100 (bf16, decode shapes of 64-256
# tokens over 8-128 adapters of rank 16-64): the fastest, or within 5% of it, on every shape swept.
SHRINK_BLOCK_N = 32  # output columns (of S * R) per shrink program
SHRINK_BLOCK_K = 256  # H_in per step for 16-bit inputs (half as many for fp32: the same bytes in shared memory)
EXPAND_BLOCK_N = 128  # output columns (of one slice) per expand program
MAX_EXPAND_BLOCK_K = 64  # rank per step
SHRINK_LAUNCH = {"num_warps": 4, "num_stages": 3}
# Split-K: parts enough for about this many shrink programs per multiprocessor, a power of two up to
# MAX_SHRINK_PARTS: each part costs every expand program one more partial to load. H100, bf16, the shrink + the
# expand (µs) at 1 / 2 / 4 / 8 / 16 parts: 64 tokens over 8 adapters (Llama-3-8B qkv) 23.3 / 20.4 / 18.0 / 18.2 /
# 19.4; 256 over 32: 33.9 / 30.9 / 32.0 / 33.4 / 36.6; a 2048-token prefill's down_proj (H_in 8192) 54.9 / 46.8 /
# 46.2 / 52.4 / 65.1, its gate_up (H_in 2048) 116.6 / 119.7 / 126.2 / 143.5 / 185.1.
SHRINK_PROGRAMS_PER_SM = 1
MAX_SHRINK_PARTS = 4
EXPAND_LAUNCH = {"num_warps": 4, "num_stages": 2}
# Columns: the alignment the expand asserts for its slices' bounds when every slice width has it (_slice_layout).
# H200, bf16, a 2048-token prefill's gate_up expand 57.4 µs asserted, 105.8 not; in a profiled 1B-class LoRA run
# the expand's 4,608 calls took 11.8 µs each against 18.8.
SLICE_ALIGN = 16
# An expand program can take several column tiles while more than EXPAND_PROGRAMS_PER_SM programs per multiprocessor
# would remain, up to MAX_EXPAND_GROUP_TILES. That paid while y moved element by element (H100, bf16, µs at 1 / 2 /
# 4 / 8 / 16 tiles a program: a 2048-token prefill's gate_up 104.8 / 109.4 / 100.9 / 96.4 / 93.9), no longer since
# it moves in vectors (SLICE_ALIGN): H200, a profiled 1B-class LoRA run's expand took 54.0 ms of device time at up to
# 8 tiles a program, 51.3-51.5 at up to 2 and 48.5 at 1 (4,608 calls, two runs each). `bench gpu` still times groups.
EXPAND_PROGRAMS_PER_SM = 4
MAX_EXPAND_GROUP_TILES = 1
# One launch (lora_fused) where the shrink it repeats for every column tile of a slice is at most this much H_in in
# all (column tiles x H_in): the 56M Llama's layers (H_in 512-1408, 1-11 tiles a slice) fuse, a 1B-class model's
# (H_in 2048-8192, 16-64 tiles) do not. 0: never. The fused kernel's rank is one step of at most MAX_FUSED_RANK.
FUSE_MAX_REPEATED_K = 8192
MAX_FUSED_RANK = 64
# x a fused program holds per step of H_in, for 16-bit inputs (half for fp32): 16 tokens x 512 (a decode graph's
# tiles: W1's H_in in one step), 64 x 128 (a prompt's)
FUSED_X_TILE = 8192


def lora_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    """out[t] = x[t] @ lora_a[i].T, i = token_adapter_idx[t]; rows with i == -1 untouched.
    out: [T, S * R], or [P, T, S * R] fp32: P partial sums over parts of H_in, which lora_expand adds (shrink_out)
    x: [T, H_in] · lora_a: [N, S * R, H_in]"""
    if not meta.has_lora:
        return
    parts = _partials(out)
    check_shrink(parts[0], x, lora_a, meta)
    _check_dtypes(x, lora_a)
    width = out.shape[-1]
    block_n, block_k = _shrink_blocks(width, x)
    k_per_part = -(-x.shape[1] // (block_k * parts.shape[0])) * block_k  # H_in per part, whole blocks
    _shrink(
        (meta.tile_seg.shape[0], -(-width // block_n), parts.shape[0]),
        parts, x, lora_a, meta.sorted_token_idx, meta.seg_indptr, meta.seg_adapter_idx, meta.tile_seg,
        meta.tile_start, x.shape[1], width, k_per_part,
        x.stride(0), x.stride(1), parts.stride(0), parts.stride(1), parts.stride(2),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        meta.tile_tokens, block_n, block_k, _precision(x),
    )  # fmt: skip


def shrink_out(x: Tensor, lora_a: Tensor, meta: LoraMeta) -> Tensor:
    """The buffer lora_shrink writes and lora_expand reads: [T, S * R] in x's dtype when the shrink's (tile, column
    tile) programs fill the device, else [P, T, S * R] fp32 for P parts of H_in (from the launch's shape alone, so a
    CUDA graph's bucket always gets the same). x: [T, H_in] · lora_a: [N, S * R, H_in]"""
    width = lora_a.shape[1]
    parts = shrink_parts(meta.tile_seg.shape[0], width, x)
    if parts == 1:
        return x.new_empty(x.shape[0], width)  # [T, S * R]
    return x.new_empty(parts, x.shape[0], width, dtype=torch.float32)  # [P, T, S * R]


def shrink_parts(tiles: int, width: int, x: Tensor) -> int:
    """How many parts of H_in a shrink over `tiles` token tiles splits into: 1 when its programs fill the device."""
    block_n, block_k = _shrink_blocks(width, x)
    programs = tiles * -(-width // block_n)
    wanted = -(-SHRINK_PROGRAMS_PER_SM * multiprocessors(x.device) // max(programs, 1))
    parts = min(wanted, -(-x.shape[1] // block_k), MAX_SHRINK_PARTS)
    return 1 << (parts.bit_length() - 1)  # a power of two: few expand variants to compile


def lora_expand(y: Tensor, z: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]) -> None:
    """y[t, off_s:off_s + out_s] += z[t, s * R:(s + 1) * R] @ lora_b[i, off_s:off_s + out_s].T for each slice s,
    i = token_adapter_idx[t], off_s = sum(output_slices[:s]); rows with i == -1 untouched.
    y: [T, H_out] · z: [T, S * R], or [P, T, S * R] fp32 partial sums (lora_shrink) · lora_b: [N, H_out, R],
    H_out = sum(output_slices)"""
    if not meta.has_lora:
        return
    parts = _partials(z)
    check_expand(y, parts[0], lora_b, meta, output_slices)
    if parts.shape[0] == 1:
        _check_dtypes(z, lora_b)
    rank = lora_b.shape[2]
    block_k = max(MIN_DOT, min(MAX_EXPAND_BLOCK_K, triton.next_power_of_2(rank)))
    tiles, col_tiles = meta.tile_seg.shape[0], column_tiles(output_slices)
    group_tiles = expand_group_tiles(tiles * len(output_slices) * col_tiles, y.device)
    col_groups = -(-col_tiles // group_tiles)
    slice_bounds, slice_align = _slice_layout(output_slices, y.device, SLICE_ALIGN)
    _expand(
        (tiles, len(output_slices) * col_groups),
        y, parts, lora_b, meta.sorted_token_idx, meta.seg_indptr, meta.seg_adapter_idx, meta.tile_seg,
        meta.tile_start, slice_bounds, rank, col_groups, group_tiles,
        y.stride(0), y.stride(1), parts.stride(0), parts.stride(1), parts.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        meta.tile_tokens, EXPAND_BLOCK_N, block_k, parts.shape[0], rank <= block_k, _precision(lora_b), slice_align,
    )  # fmt: skip


def column_tiles(output_slices: tuple[int, ...]) -> int:
    """EXPAND_BLOCK_N-column tiles of the widest slice: the expand's and the fused kernel's programs per slice."""
    return -(-max(output_slices) // EXPAND_BLOCK_N)


def fused_pays(hidden_in: int, rank: int, output_slices: tuple[int, ...]) -> bool:
    """Whether add_lora takes a layer of these sizes in one launch (lora_fused) rather than a shrink and an expand:
    a rank of one step, and a shrink small enough to repeat for each of a slice's column tiles."""
    return rank <= MAX_FUSED_RANK and column_tiles(output_slices) * hidden_in <= FUSE_MAX_REPEATED_K


def lora_fused(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices) -> None:
    """add_lora in one launch, without the z buffer: each program computes its tile's z for its slice (fp32, rounded
    to the weights' dtype as the two-kernel path rounds it) and adds z @ lora_b-slice.T to its column tile of y.
    y: [T, H_out] · x: [T, H_in] · lora_a: [N, S * R, H_in] · lora_b: [N, H_out, R]"""
    if not meta.has_lora:
        return
    rank = lora_b.shape[2]
    z_shape = (x.shape[0], lora_a.shape[1])  # [T, S * R]
    check_shrink_shape(z_shape, x, lora_a, meta)
    check_expand_shape(y, z_shape, lora_b, meta, output_slices)
    _check_dtypes(x, lora_a)
    _check_dtypes(x, lora_b)
    if rank > MAX_FUSED_RANK:
        raise ValueError(f"the fused LoRA kernel takes a rank of at most {MAX_FUSED_RANK}, got {rank}")
    block_r = max(MIN_DOT, triton.next_power_of_2(rank))
    x_tile = FUSED_X_TILE * 2 // x.element_size() // meta.tile_tokens
    block_k = max(MIN_DOT, min(triton.next_power_of_2(x.shape[1]), x_tile))
    col_tiles = column_tiles(output_slices)
    slice_bounds, slice_align = _slice_layout(output_slices, y.device, SLICE_ALIGN)
    _fused(
        (meta.tile_seg.shape[0], len(output_slices) * col_tiles),
        y, x, lora_a, lora_b, meta.sorted_token_idx, meta.seg_indptr, meta.seg_adapter_idx, meta.tile_seg,
        meta.tile_start, slice_bounds, x.shape[1], rank, col_tiles,
        y.stride(0), y.stride(1), x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        meta.tile_tokens, EXPAND_BLOCK_N, block_k, block_r, _precision(x), slice_align,
    )  # fmt: skip


def expand_group_tiles(programs: int, device: torch.device) -> int:
    """Column tiles per expand program, given the programs one tile each would make: as many as leave about
    EXPAND_PROGRAMS_PER_SM programs per multiprocessor, up to MAX_EXPAND_GROUP_TILES (each program looks its tokens
    up and loads z once for all its tiles)."""
    return max(1, min(MAX_EXPAND_GROUP_TILES, programs // (EXPAND_PROGRAMS_PER_SM * multiprocessors(device))))


def _partials(buffer: Tensor) -> Tensor:
    """A shrink buffer as [P, T, S * R]: a [T, S * R] one is its single part."""
    if buffer.dim() == 2:
        return buffer.unsqueeze(0)
    if buffer.dim() != 3 or buffer.dtype != torch.float32:
        shape = tuple(buffer.shape)
        raise ValueError(f"a shrink buffer is [T, S * R], or [P, T, S * R] fp32; got {buffer.dtype} {shape}")
    return buffer


def _shrink_blocks(width: int, x: Tensor) -> tuple[int, int]:
    """(output columns, H_in) per shrink program and step; the same bytes of x per step whatever its dtype."""
    block_n = max(MIN_DOT, min(SHRINK_BLOCK_N, triton.next_power_of_2(width)))
    return block_n, max(MIN_DOT, SHRINK_BLOCK_K * 2 // x.element_size())


def _precision(x: Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for fp16 / bf16 operands


def _check_dtypes(activations: Tensor, weights: Tensor) -> None:
    if activations.dtype != weights.dtype:
        raise ValueError(f"tl.dot needs one dtype: activations are {activations.dtype}, weights {weights.dtype}")


@functools.cache
def _slice_layout(output_slices: tuple[int, ...], device: torch.device, max_align: int) -> tuple[Tensor, int]:
    """[S+1] int32 bounds on device (slice s is columns [bounds[s], bounds[s+1]) of y), and the largest of max_align,
    max_align / 2... 1 that divides every slice width: what the expand may tell the compiler of its slices' first
    columns, so that a row of y is loaded and stored in 16-byte vectors rather than element by element (a column
    read from the bounds is otherwise of unknown alignment). One per layer shape (and SLICE_ALIGN, which `bench gpu`
    sets to 1 to time the expand unaligned)."""
    bounds = [0]
    for size in output_slices:
        bounds.append(bounds[-1] + size)
    align = max_align
    while any(size % align for size in output_slices):
        align //= 2
    return torch.tensor(bounds, dtype=torch.int32, device=device), align


@triton.jit
def _tile_tokens(tile_start_ptr, seg, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, BLOCK_M: tl.constexpr):
    """A tile's adapter row, its BLOCK_M token indices and which of them are tokens of the segment."""
    start = tl.load(tile_start_ptr)
    seg_end = tl.load(seg_indptr_ptr + seg + 1)
    positions = start + tl.arange(0, BLOCK_M)
    row_valid = positions < seg_end
    tokens = tl.load(sorted_token_idx_ptr + positions, mask=row_valid, other=0).to(tl.int64)
    return tl.load(seg_adapter_idx_ptr + seg).to(tl.int64), tokens, row_valid


@triton.jit
def _x_at_rows(
    x_ptr, tokens, row_valid, a_rows, a_row_valid, k_begin, k_end, stride_xt, stride_xh, stride_ah,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """x[tokens, k_begin:k_end] @ A.T, [BLOCK_M, BLOCK_A] fp32, A's rows at a_rows ([BLOCK_A, 1] pointers) read
    along H_in with stride_ah; masked rows and rows of A give zeros: the shrink's sum, in its kernel and the fused."""
    acc = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < k_end
        x_offs = tokens[:, None] * stride_xt + ks[None, :] * stride_xh  # [BLOCK_M, BLOCK_K]
        x = tl.load(x_ptr + x_offs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :] * stride_ah, mask=a_row_valid[:, None] & k_valid[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _shrink_kernel(
    out_ptr, x_ptr, lora_a_ptr, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, tile_seg_ptr,
    tile_start_ptr, hidden_in, width, k_per_part,
    stride_xt, stride_xh, stride_op, stride_ot, stride_ow, stride_an, stride_aw, stride_ah,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (token tile, column tile, part of H_in): out[part, tokens, cols] for up to BLOCK_M tokens of one
    segment, summed over H_in[part * k_per_part:][:k_per_part] (a part past H_in writes zeros)."""
    tile, tile_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seg = tl.load(tile_seg_ptr + tile)
    if seg >= 0:
        adapter, tokens, row_valid = _tile_tokens(
            tile_start_ptr + tile, seg, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, BLOCK_M
        )
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < width
        a_rows = lora_a_ptr + adapter * stride_an + cols[:, None] * stride_aw  # [BLOCK_N, 1]
        k_begin = part * k_per_part
        k_end = tl.minimum(hidden_in, k_begin + k_per_part)
        acc = _x_at_rows(
            x_ptr, tokens, row_valid, a_rows, col_valid, k_begin, k_end, stride_xt, stride_xh, stride_ah,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        out_offs = part * stride_op + tokens[:, None] * stride_ot + cols[None, :] * stride_ow
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, z_ptr, lora_b_ptr, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, tile_seg_ptr,
    tile_start_ptr, slice_bounds_ptr, rank, col_groups, group_tiles,
    stride_yt, stride_yh, stride_zp, stride_zt, stride_zw, stride_bn, stride_bh, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr,
    ONE_K_STEP: tl.constexpr, DOT_PRECISION: tl.constexpr, SLICE_ALIGN: tl.constexpr,
):  # fmt: skip
    """Program (token tile, slice * col_groups + group): y[tokens, cols] += z-slice @ lora_b-slice.T for up to
    BLOCK_M tokens of one segment and group_tiles column tiles of BLOCK_N, one after the other (the next tile's loads
    pipelined behind this one's dot and store), z the sum of the shrink's PARTS partials, loaded once when the rank
    is one step (ONE_K_STEP)."""
    tile, slice_group = tl.program_id(0), tl.program_id(1)
    s, group = slice_group // col_groups, slice_group % col_groups
    seg = tl.load(tile_seg_ptr + tile)
    col_start = tl.multiple_of(tl.load(slice_bounds_ptr + s), SLICE_ALIGN)
    slice_width = tl.multiple_of(tl.load(slice_bounds_ptr + s + 1) - col_start, SLICE_ALIGN)
    first = group * group_tiles * BLOCK_N  # the group's first column in its slice
    if (seg >= 0) & (first < slice_width):
        adapter, tokens, row_valid = _tile_tokens(
            tile_start_ptr + tile, seg, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, BLOCK_M
        )
        group_end = tl.minimum(slice_width, first + group_tiles * BLOCK_N)
        z_rows = z_ptr + tokens[:, None] * stride_zt + s * rank * stride_zw  # [BLOCK_M, 1]
        b_base = lora_b_ptr + adapter * stride_bn + col_start * stride_bh
        if ONE_K_STEP:
            z_first = _load_z(z_rows, tl.arange(0, BLOCK_K), rank, row_valid, stride_zp, stride_zw, PARTS)
        for n_start in range(first, group_end, BLOCK_N):
            in_slice = n_start + tl.arange(0, BLOCK_N)
            col_valid = in_slice < group_end
            mask = row_valid[:, None] & col_valid[None, :]
            y_ptrs = y_ptr + tokens[:, None] * stride_yt + (col_start + in_slice)[None, :] * stride_yh
            acc = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)  # y first: its load overlaps the dot's
            b_rows = b_base + in_slice[:, None] * stride_bh  # [BLOCK_N, 1]
            for k_start in range(0, rank, BLOCK_K):
                ks = k_start + tl.arange(0, BLOCK_K)
                z = z_first if ONE_K_STEP else _load_z(z_rows, ks, rank, row_valid, stride_zp, stride_zw, PARTS)
                b = tl.load(b_rows + ks[None, :] * stride_br, mask=col_valid[:, None] & (ks < rank)[None, :], other=0.0)
                acc += tl.dot(z.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_z(z_rows, ks, rank, row_valid, stride_zp, stride_zw, PARTS: tl.constexpr):
    """z[tokens, s * rank + ks] as [BLOCK_M, BLOCK_K] fp32: the sum of the PARTS partials (masked past the rank)."""
    mask = row_valid[:, None] & (ks < rank)[None, :]
    offs = ks[None, :] * stride_zw
    z = tl.load(z_rows + offs, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):
        z += tl.load(z_rows + p * stride_zp + offs, mask=mask, other=0.0)
    return z


@triton.jit
def _fused_kernel(
    y_ptr, x_ptr, lora_a_ptr, lora_b_ptr, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, tile_seg_ptr,
    tile_start_ptr, slice_bounds_ptr, hidden_in, rank, col_tiles,
    stride_yt, stride_yh, stride_xt, stride_xh, stride_an, stride_aw, stride_ah, stride_bn, stride_bh, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SLICE_ALIGN: tl.constexpr,
):  # fmt: skip
    """Program (token tile, slice * col_tiles + column tile): z = x[tokens] @ lora_a-slice.T over all of H_in
    ([BLOCK_M, BLOCK_R] fp32, the rank padded), then y[tokens, cols] += z @ lora_b[cols].T for up to BLOCK_M tokens of
    one segment and BLOCK_N columns of the slice."""
    tile, slice_tile = tl.program_id(0), tl.program_id(1)
    s, tile_n = slice_tile // col_tiles, slice_tile % col_tiles
    seg = tl.load(tile_seg_ptr + tile)
    col_start = tl.multiple_of(tl.load(slice_bounds_ptr + s), SLICE_ALIGN)
    slice_width = tl.multiple_of(tl.load(slice_bounds_ptr + s + 1) - col_start, SLICE_ALIGN)
    if (seg >= 0) & (tile_n * BLOCK_N < slice_width):
        adapter, tokens, row_valid = _tile_tokens(
            tile_start_ptr + tile, seg, sorted_token_idx_ptr, seg_indptr_ptr, seg_adapter_idx_ptr, BLOCK_M
        )
        in_slice = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = in_slice < slice_width
        mask = row_valid[:, None] & col_valid[None, :]
        y_ptrs = y_ptr + tokens[:, None] * stride_yt + (col_start + in_slice)[None, :] * stride_yh
        acc = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)  # y first: its load overlaps the shrink
        ranks = tl.arange(0, BLOCK_R)
        rank_valid = ranks < rank
        a_rows = lora_a_ptr + adapter * stride_an + (s * rank + ranks)[:, None] * stride_aw  # [BLOCK_R, 1]
        z = _x_at_rows(
            x_ptr, tokens, row_valid, a_rows, rank_valid, 0, hidden_in, stride_xt, stride_xh, stride_ah,
            BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        b_ptrs = lora_b_ptr + adapter * stride_bn + (col_start + in_slice)[:, None] * stride_bh  # [BLOCK_N, 1]
        b = tl.load(b_ptrs + ranks[None, :] * stride_br, mask=col_valid[:, None] & rank_valid[None, :], other=0.0)
        acc += tl.dot(z.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_shrink = FastLaunch(_shrink_kernel, **SHRINK_LAUNCH)
_expand = FastLaunch(_expand_kernel, **EXPAND_LAUNCH)
_fused = FastLaunch(_fused_kernel, **EXPAND_LAUNCH)
_add_lora_in_two = compose_add_lora(lora_shrink, lora_expand, shrink_out)  # shrink + expand, whatever the layer
add_lora = compose_add_lora(lora_shrink, lora_expand, shrink_out, lora_fused, fused_pays)
