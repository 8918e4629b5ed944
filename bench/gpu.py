"""`loraplex bench gpu`: the Triton kernels and the engine on a CUDA device, as figures.

    loraplex bench gpu [--sections ceilings,attention,lora,engine] [--dtype bfloat16] [--sweep] [--json F]
    python -m bench.gpu ...            (the same, without the CLI's gateway imports)

ceilings   the two rates every other figure is read against: a device-to-device copy (bytes read + written per
           second) and a large matrix product (TFLOP/s), measured here, not taken from a datasheet.
attention  the Triton paged decode attention on decode shapes (Llama-3-8B heads: 32 q, 8 kv, head_dim 128,
           blocks of 16, random block tables): achieved bandwidth = the fewest bytes it must move (each seq's K
           and V once, q read, out written) over its median time, as a share of the copy's; the torch backend's
           time beside it, and the largest error against it.
lora       shrink, expand and add_lora (Triton) on decode shapes (one token per seq, H 4096, qkv slices 4096 /
           1024 / 1024), a 1B-class prefill's and W1's decode layers: bandwidth over the adapters' A (shrink) or B
           (expand) rows in use plus activations; add_lora in one launch (fused) against shrink + expand.
engine     W1 of ../shared/peers (the random 56M Llama, 64 requests of 128 prompt ids, 64 greedy output tokens,
           K=8 rank-8 adapters on all seven modules) through the offline LLM on the device, base and LoRA engines
           side by side, their runs interleaved, and a bigger random Llama (1B-class layers, 8 of them) the same
           way: output tok/s and LoRA / base (the median of paired runs' ratios), and where a LoRA run's extra time
           goes (its prefill steps, its decode steps, outside them). Decode steps replay CUDA graphs, as the
           engine's default is; --eager also runs both with enforce_eager; --unfused also runs LoRA with no layer
           in one launch (shrink, then expand: what fusing gains); --models w1 or 1b runs one model only; steps take
           the engine's default budget (8192 tokens on CUDA) unless --max-num-batched-tokens says otherwise;
           --host-split also times the step's parts on the host in every run (bench/host_split.py) and prints
           each part's seconds a run, base against LoRA.

--sweep also times the kernels under several launch settings (key tile, warps, pipeline stages, split-decode
partition) and prints the best, to choose the modules' defaults. Kernel times are Triton's do_bench medians
(CUDA events, L2 flushed before each run). Without a CUDA device the sections run interpreted on the CPU, on
tiny shapes (as --smoke does on a GPU): a check that the script works, with no meaningful figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bench.host_split import timed_parts
from engine.config import DTYPES

SECTIONS = ("ceilings", "attention", "lora", "engine")
# The datasheet HBM bandwidth by device name, printed beside the measured copy (bytes/s)
DATASHEET_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}


@dataclass(frozen=True)
class AttentionShape:
    """A decode step: `batch` seqs of `context` keys each (the new one included)."""

    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class LoraShape:
    """A step's LoRA layer: `tokens` tokens over `adapters` distinct adapters (uniform) of rank `rank`."""

    tokens: int
    adapters: int
    rank: int
    hidden_in: int = 4096
    output_slices: tuple[int, ...] = (4096, 1024, 1024)


ATTENTION_SHAPES = [
    AttentionShape(64, 512),
    AttentionShape(64, 2048),
    AttentionShape(256, 1024),
    AttentionShape(16, 4096),
    AttentionShape(4, 16384),
]
LORA_SHAPES = [
    LoraShape(64, 8, 16),
    LoraShape(256, 32, 16),
    LoraShape(256, 128, 16),
    LoraShape(256, 64, 64),
    # a prefill step of the engine section's 1B-class model (2048 tokens, 16 adapters): gate_up, then down
    LoraShape(2048, 16, 16, 2048, (8192, 8192)),
    LoraShape(2048, 16, 16, 8192, (2048,)),
    # a decode step of the engine section's W1 model (64 tokens over 8 adapters of rank 8): qkv, gate_up, down
    LoraShape(64, 8, 8, 512, (512, 256, 256)),
    LoraShape(64, 8, 8, 512, (1408, 1408)),
    LoraShape(64, 8, 8, 1408, (512,)),
]
SWEEP_LAUNCHES = ((4, 2), (4, 3), (8, 2), (8, 3))  # (num_warps, num_stages)
SWEEP_REP = 60  # ms of timed runs per setting
SPLIT_PARTS = (1, 2, 4, 8, 16)  # the shrink's parts of H_in timed for each LoRA shape
EXPAND_GROUPS = (1, 2, 4, 8, 16)  # the expand's column tiles per program timed for each LoRA shape
# a profiled run's LoRA kernels, by their Triton names
LORA_KERNELS = ("_shrink_kernel", "_expand_kernel", "_fused_kernel")
ENGINE_MODELS = ("w1", "1b")  # the engine section's models: W1's 56M Llama, the 1B-class one
SMOKE_ATTENTION = [AttentionShape(3, 70, 4, 2, 16, 16)]
SMOKE_LORA = [LoraShape(5, 2, 8, 64, (64, 32))]


def time_ms(fn: Callable[[], object], device: torch.device, rep: int = 200) -> float:
    """Median milliseconds of fn: do_bench on CUDA (events, L2 flushed per run); a few wall-clock runs elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


@contextlib.contextmanager
def patched(module, **values) -> Iterator[None]:
    """The module's constants set to `values` for the block (the sweep's launch settings)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def ceilings(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    n = 1 << (16 if smoke else 29)  # 1 GiB of fp16 / bf16: far past L2
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = time_ms(partial(dst.copy_, src), device)
    size = 256 if smoke else 8192
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    mm_ms = time_ms(lambda: a @ b, device)
    row = {
        "copy_bytes_per_s": 2 * src.numel() * src.element_size() / (copy_ms / 1e3),
        "matmul_tflops": 2 * size**3 / (mm_ms / 1e3) / 1e12,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        row["device"] = name
        row["datasheet_bytes_per_s"] = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in name), None)
    print(f"copy {row['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), {dtype} matmul "
          f"{row['matmul_tflops']:.0f} TFLOP/s", flush=True)  # fmt: skip
    return row


def attention_batch(shape: AttentionShape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(q, k_cache, v_cache, meta, scale) of one decode step on random non-contiguous blocks."""
    from kernels.paged_attention import PagedAttentionMeta

    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(shape.batch, blocks_per_seq)  # [B, nb]
    last = (shape.context - 1) // shape.block_size, (shape.context - 1) % shape.block_size
    slots = (tables[:, last[0]] * shape.block_size + last[1]).tolist()
    meta = PagedAttentionMeta.build(
        torch.tensor(slots), shape.block_size, [], [], [], [shape.context] * shape.batch, tables.tolist(), device
    )
    kv = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache, v_cache = (torch.randn(kv, generator=gen).to(device, dtype) for _ in range(2))
    q = torch.randn(shape.batch, shape.num_heads, shape.head_dim, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, meta, shape.head_dim**-0.5


def attention_bytes(shape: AttentionShape, element_size: int) -> int:
    kv = shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * 2
    q_out = shape.batch * shape.num_heads * shape.head_dim * 2
    return (kv + q_out) * element_size + shape.batch * -(-shape.context // shape.block_size) * 4


def attention_rows(device, dtype, shapes, copy_rate: float, sweep: bool, sweep_partitions: bool) -> list[dict]:
    from kernels.paged_attention import torch_ops, triton_ops

    rows = []
    for shape in shapes:
        q, k_cache, v_cache, meta, scale = attention_batch(shape, device, dtype)
        ref = torch_ops.attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
        out = triton_ops.attention(q, k_cache, v_cache, meta, scale)
        error = ((out.float() - ref).norm() / ref.norm()).item()
        nbytes = attention_bytes(shape, q.element_size())
        triton_ms = time_ms(partial(triton_ops.attention, q, k_cache, v_cache, meta, scale), device)
        torch_ms = time_ms(partial(torch_ops.attention, q, k_cache, v_cache, meta, scale), device)
        row = {
            **shape.__dict__,
            "bytes": nbytes,
            "partition": triton_ops.decode_partition(
                shape.batch * shape.num_kv_heads, shape.context, max(triton_ops.KEY_TILE, shape.block_size), device
            ),
            "triton_ms": triton_ms,
            "torch_ms": torch_ms,
            "bytes_per_s": nbytes / (triton_ms / 1e3),
            "rel_error": error,
        }
        row["of_copy"] = row["bytes_per_s"] / copy_rate
        if sweep:
            row["sweep"] = attention_sweep(q, k_cache, v_cache, meta, scale, nbytes, device)
        if sweep_partitions:
            row["partitions"] = partition_sweep(q, k_cache, v_cache, meta, scale, nbytes, device)
        rows.append(row)
        print(f"attention batch {shape.batch:>4} ctx {shape.context:>6}: {triton_ms * 1e3:8.1f} us "
              f"{row['bytes_per_s'] / 1e12:5.2f} TB/s = {row['of_copy']:.0%} of copy  (torch {torch_ms * 1e3:8.1f} us,"
              f" split {row['partition']}, rel err {error:.1e})", flush=True)  # fmt: skip
    return rows


def attention_sweep(q, k_cache, v_cache, meta, scale, nbytes, device) -> list[dict]:
    """Decode attention under each (key tile, warps, stages, partition), fastest first."""
    from kernels.paged_attention import triton_ops
    from kernels.triton_launch import FastLaunch

    results = []
    for key_tile in (32, 64, 128):
        for warps, stages in SWEEP_LAUNCHES:
            launch = {"num_warps": warps, "num_stages": stages}
            kernels = {"_decode": FastLaunch(triton_ops._decode_kernel, **launch),
                       "_decode_split": FastLaunch(triton_ops._decode_split_kernel, **launch)}  # fmt: skip
            for partition in (None, 512, 1024):
                if partition is not None and partition >= meta.max_decode_context_len:
                    continue
                with patched(triton_ops, KEY_TILE=key_tile, DECODE_PARTITION=partition, **kernels):
                    try:
                        ms = time_ms(partial(triton_ops.attention, q, k_cache, v_cache, meta, scale), device, SWEEP_REP)
                    except Exception as e:  # a setting the compiler refuses (shared memory)
                        results.append({"key_tile": key_tile, **launch, "partition": partition, "error": str(e)[:200]})
                        continue
                tb_s = nbytes / (ms / 1e3) / 1e12
                results.append({"key_tile": key_tile, **launch, "partition": partition, "ms": ms, "tb_s": tb_s})
    results.sort(key=lambda r: r.get("ms", float("inf")))
    best = results[0]
    print(f"    best: key tile {best['key_tile']}, {best['num_warps']} warps, {best['num_stages']} stages, "
          f"partition {best['partition']}: {best['ms'] * 1e3:.1f} us {best['tb_s']:.2f} TB/s", flush=True)  # fmt: skip
    return results


def partition_sweep(q, k_cache, v_cache, meta, scale, nbytes, device) -> dict[str, float]:
    """Decode attention (default launch settings) never split, split by the module's rule, and split into parts of
    256 / 512 / 1024 / 2048 keys: {setting: TB/s}."""
    from kernels.paged_attention import triton_ops

    results = {}
    for partition in (0, None, 256, 512, 1024, 2048):
        if partition and partition >= meta.max_decode_context_len:
            continue
        with patched(triton_ops, DECODE_PARTITION=partition):
            ms = time_ms(partial(triton_ops.attention, q, k_cache, v_cache, meta, scale), device, SWEEP_REP)
        results["never" if partition == 0 else "rule" if partition is None else str(partition)] = nbytes / ms / 1e9
    print("    TB/s by partition: " + ", ".join(f"{k} {v:.2f}" for k, v in results.items()), flush=True)
    return results


def lora_case(shape: LoraShape, device, dtype, seed: int = 0):
    """(x, lora_a, lora_b, y, meta, idx): tokens over adapters uniformly (every adapter used), 2 x the adapters
    stacked; idx [T] the tokens' rows."""
    from kernels.lora import LoraMeta

    gen = torch.Generator().manual_seed(seed)
    idx = torch.arange(shape.tokens) % shape.adapters * 2  # rows 0, 2, 4...: the stack holds unused rows too
    idx = idx[torch.randperm(shape.tokens, generator=gen)]
    meta = LoraMeta.build(idx, device)
    width, hidden_out = len(shape.output_slices) * shape.rank, sum(shape.output_slices)
    x = torch.randn(shape.tokens, shape.hidden_in, generator=gen).to(device, dtype)
    lora_a = (torch.randn(2 * shape.adapters, width, shape.hidden_in, generator=gen) / 64).to(device, dtype)
    lora_b = (torch.randn(2 * shape.adapters, hidden_out, shape.rank, generator=gen) / 4).to(device, dtype)
    y = torch.randn(shape.tokens, hidden_out, generator=gen).to(device, dtype)
    return x, lora_a, lora_b, y, meta, idx


def graph_meta(idx: torch.Tensor, num_rows: int, device):
    """The meta a CUDA graph's step over these tokens would use (LoraMeta.over_rows: one segment per stacked row,
    16-token tiles, the table as long as the bucket can need)."""
    from kernels.lora import LoraMeta
    from kernels.lora.meta import fill_graph_layout, graph_tiles

    sorted_idx = torch.empty(len(idx), dtype=torch.int64)  # [T]: every token has an adapter here
    seg_indptr = torch.empty(num_rows + 1, dtype=torch.int32)  # [N+1]
    tiles = torch.empty(2, graph_tiles(len(idx), num_rows), dtype=torch.int32)
    fill_graph_layout(idx.numpy(), sorted_idx.numpy(), seg_indptr.numpy(), tiles.numpy())  # as DecodeGraphs does
    return LoraMeta.over_rows(
        idx.to(device), sorted_idx.to(device), seg_indptr.to(device), torch.arange(num_rows, device=device),
        tiles.to(device),
    )  # fmt: skip


def lora_bytes(shape: LoraShape, element_size: int) -> dict[str, int]:
    width, hidden_out = len(shape.output_slices) * shape.rank, sum(shape.output_slices)
    shrink = shape.adapters * width * shape.hidden_in + shape.tokens * (shape.hidden_in + width)
    expand = shape.adapters * hidden_out * shape.rank + shape.tokens * (width + 2 * hidden_out)
    return {"shrink": shrink * element_size, "expand": expand * element_size}


def lora_rows(device, dtype, shapes, copy_rate: float, sweep: bool, quick: bool = False) -> list[dict]:
    from kernels.lora import LoraMeta, torch_ops, triton_ops

    rows = []
    for shape in shapes:
        x, lora_a, lora_b, y, meta, idx = lora_case(shape, device, dtype)
        slices = shape.output_slices
        z = triton_ops.shrink_out(x, lora_a, meta)  # [T, S * R], or [P, T, S * R] fp32 partials (split-K)
        triton_ops.lora_shrink(z, x, lora_a, meta)  # the expand's input, as in a layer
        ref = y.float().clone()
        torch_ops.add_lora(ref, x.float(), lora_a.float(), lora_b.float(), meta, slices)
        out = y.clone()
        triton_ops.add_lora(out, x, lora_a, lora_b, meta, slices)
        error = ((out.float() - ref).norm() / (ref - y.float()).norm()).item()  # of the LoRA delta
        nbytes = lora_bytes(shape, x.element_size())
        row = {
            **shape.__dict__,
            "bytes": nbytes,
            "rel_error_of_delta": error,
            "shrink_parts": z.shape[0] if z.dim() == 3 else 1,
        }
        row["shrink_ms"] = time_ms(partial(triton_ops.lora_shrink, z, x, lora_a, meta), device)
        row["expand_ms"] = time_ms(partial(triton_ops.lora_expand, y, z, lora_b, meta, slices), device)
        tile16 = LoraMeta.build(idx, device, tile_tokens=16)  # a CUDA graph's tiles
        row["shrink_ms_tile16"] = time_ms(partial(triton_ops.lora_shrink, z, x, lora_a, tile16), device)
        row["expand_ms_tile16"] = time_ms(partial(triton_ops.lora_expand, y, z, lora_b, tile16, slices), device)
        graph = graph_meta(idx, lora_a.shape[0], device)  # what a graph replays: one segment per stacked row
        z_graph = triton_ops.shrink_out(x, lora_a, graph)
        row["shrink_ms_graph"] = time_ms(partial(triton_ops.lora_shrink, z_graph, x, lora_a, graph), device)
        row["expand_ms_graph"] = time_ms(partial(triton_ops.lora_expand, y, z_graph, lora_b, graph, slices), device)
        with patched(triton_ops, SLICE_ALIGN=1):  # y moved element by element, as before the expand asserted it
            row["expand_ms_unaligned"] = time_ms(partial(triton_ops.lora_expand, y, z, lora_b, meta, slices), device)
            unaligned_graph = partial(triton_ops.lora_expand, y, z_graph, lora_b, graph, slices)
            row["expand_ms_graph_unaligned"] = time_ms(unaligned_graph, device)
        if not quick:  # the tables that chose the split of H_in and the expand's groups
            row["split_k"] = split_k_rows(x, lora_a, lora_b, y, {"plain": meta, "graph": graph}, slices, device)
            row["expand_groups"] = expand_group_rows(y, z, lora_b, {"plain": meta, "graph": graph}, slices, device)
        row["add_lora_ms"] = time_ms(partial(triton_ops.add_lora, y, x, lora_a, lora_b, meta, slices), device)
        row.update(fused_rows(x, lora_a, lora_b, y, {"plain": meta, "graph": graph}, slices, device))
        row["torch_add_lora_ms"] = time_ms(partial(torch_ops.add_lora, y, x, lora_a, lora_b, meta, slices), device)
        for op in ("shrink", "expand"):
            row[f"{op}_bytes_per_s"] = nbytes[op] / (row[f"{op}_ms"] / 1e3)
            row[f"{op}_of_copy"] = row[f"{op}_bytes_per_s"] / copy_rate
        if sweep:
            row["sweep"] = lora_sweep(x, lora_a, lora_b, y, z, meta, slices, nbytes, device)
        rows.append(row)
        print(f"lora T {shape.tokens:>4} N {shape.adapters:>4} R {shape.rank:>3}: shrink {row['shrink_ms'] * 1e3:7.1f} "
              f"us {row['shrink_of_copy']:4.0%}, expand {row['expand_ms'] * 1e3:7.1f} us {row['expand_of_copy']:4.0%}"
              f" of copy; add_lora {row['add_lora_ms'] * 1e3:7.1f} us (torch {row['torch_add_lora_ms'] * 1e3:7.1f});"
              f" rel err {error:.1e}; {row['shrink_parts']} part(s) of H_in; 16-token tiles: shrink "
              f"{row['shrink_ms_tile16'] * 1e3:.1f}, expand "
              f"{row['expand_ms_tile16'] * 1e3:.1f} us; graph meta: {row['shrink_ms_graph'] * 1e3:.1f}, "
              f"{row['expand_ms_graph'] * 1e3:.1f} us; expand with y unaligned {row['expand_ms_unaligned'] * 1e3:.1f}"
              f", graph meta {row['expand_ms_graph_unaligned'] * 1e3:.1f} us", flush=True)  # fmt: skip
        print(f"    one launch (fused{'' if row['fused_pays'] else ', not the default here'}): "
              f"{row['fused_ms_plain'] * 1e3:.1f} us against {row['two_launches_ms_plain'] * 1e3:.1f} for shrink + "
              f"expand; graph meta {row['fused_ms_graph'] * 1e3:.1f} against "
              f"{row['two_launches_ms_graph'] * 1e3:.1f}", flush=True)  # fmt: skip
    return rows


def fused_rows(x, lora_a, lora_b, y, metas: dict, slices, device) -> dict:
    """add_lora in one launch (lora_fused) and in two (shrink, then expand), ms, per meta; and whether the layer
    fuses by default (fused_pays). Ranks past MAX_FUSED_RANK have no fused time."""
    from kernels.lora import triton_ops

    found = {"fused_pays": triton_ops.fused_pays(x.shape[1], lora_b.shape[2], slices)}
    for name, meta in metas.items():
        z = triton_ops.shrink_out(x, lora_a, meta)
        two = partial(triton_ops._add_lora_in_two, y, x, lora_a, lora_b, meta, slices, z)
        found[f"two_launches_ms_{name}"] = time_ms(two, device)
        fused = partial(triton_ops.lora_fused, y, x, lora_a, lora_b, meta, slices)
        found[f"fused_ms_{name}"] = time_ms(fused, device) if lora_b.shape[2] <= triton_ops.MAX_FUSED_RANK else None
    return found


def split_k_rows(x, lora_a, lora_b, y, metas: dict, slices, device) -> list[dict]:
    """Shrink and expand µs for each split of H_in (SPLIT_PARTS; 1 = no partials) and meta: which split wins where."""
    from kernels.lora import triton_ops

    rows = []
    for name, meta in metas.items():
        found = {"meta": name}
        for parts in SPLIT_PARTS:
            shape = (x.shape[0], lora_a.shape[1])
            z = (
                torch.zeros(shape, device=device, dtype=x.dtype)
                if parts == 1
                else torch.zeros((parts, *shape), device=device, dtype=torch.float32)
            )
            found[f"shrink_{parts}"] = 1e3 * time_ms(
                partial(triton_ops.lora_shrink, z, x, lora_a, meta), device, SWEEP_REP
            )
            found[f"expand_{parts}"] = 1e3 * time_ms(
                partial(triton_ops.lora_expand, y, z, lora_b, meta, slices), device, SWEEP_REP
            )
        rows.append(found)
        print(f"    split-K {name}: " + ", ".join(f"{p}: {found[f'shrink_{p}']:.1f} + {found[f'expand_{p}']:.1f}"
                                              for p in SPLIT_PARTS) + " us", flush=True)  # fmt: skip
    return rows


def expand_group_rows(y, z, lora_b, metas: dict, slices, device) -> list[dict]:
    """Expand µs for each count of column tiles per program (EXPAND_GROUPS) and num_stages (2, 3), per meta."""
    from kernels.lora import triton_ops
    from kernels.triton_launch import FastLaunch

    rows = []
    for name, meta in metas.items():
        found = {"meta": name}
        for stages in (2, 3):
            launch = FastLaunch(triton_ops._expand_kernel, **{**triton_ops.EXPAND_LAUNCH, "num_stages": stages})
            for group in EXPAND_GROUPS:
                with patched(triton_ops, _expand=launch, expand_group_tiles=lambda programs, device, g=group: g):
                    run = partial(triton_ops.lora_expand, y, z, lora_b, meta, slices)
                    found[f"stages_{stages}_group_{group}"] = 1e3 * time_ms(run, device, SWEEP_REP)
        rows.append(found)
        timed = ", ".join(f"{k.removeprefix('stages_')}: {v:.1f}" for k, v in found.items() if k != "meta")
        print(f"    expand groups {name}: {timed} us", flush=True)
    return rows


def lora_sweep(x, lora_a, lora_b, y, z, meta, slices, nbytes, device) -> dict[str, list[dict]]:
    from kernels.lora import triton_ops
    from kernels.triton_launch import FastLaunch

    results: dict[str, list[dict]] = {"shrink": [], "expand": []}
    for warps, stages in SWEEP_LAUNCHES:
        launch = {"num_warps": warps, "num_stages": stages}
        shrink = FastLaunch(triton_ops._shrink_kernel, **launch)
        expand = FastLaunch(triton_ops._expand_kernel, **launch)
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                settings = {"SHRINK_BLOCK_N": block_n, "SHRINK_BLOCK_K": block_k, "_shrink": shrink}
                with patched(triton_ops, **settings):
                    ms = time_ms(partial(triton_ops.lora_shrink, z, x, lora_a, meta), device, SWEEP_REP)
                results["shrink"].append({"block_n": block_n, "block_k": block_k, **launch, "ms": ms})
        for block_n in (64, 128, 256):  # the expand's K is the rank: one step of up to 64
            settings = {"EXPAND_BLOCK_N": block_n, "_expand": expand}
            with patched(triton_ops, **settings):
                ms = time_ms(partial(triton_ops.lora_expand, y, z, lora_b, meta, slices), device, SWEEP_REP)
            results["expand"].append({"block_n": block_n, **launch, "ms": ms})
    for op, found in results.items():
        found.sort(key=lambda r: r["ms"])
        best = found[0]
        print(f"    {op} best: {best} = {nbytes[op] / (best['ms'] / 1e3) / 1e12:.2f} TB/s", flush=True)
    return results


@dataclass(frozen=True)
class EngineOptions:
    """What the engine section runs besides base and LoRA with decode graphs, from `bench gpu`'s flags: `eager`,
    both also with enforce_eager; `unfused`, LoRA also with no layer in one launch (built and run under
    FUSE_MAX_REPEATED_K 0); `graph_variants`, LoRA also with its graphs recorded "serial" and "plain"
    (lora_linear.GRAPH_LORA); `host_split`, each timed run's host parts (`timed_parts`); `profile`, a profile of
    each mode; `step_tokens`, the engines' max_num_batched_tokens; `models`, which of ENGINE_MODELS."""

    profile: bool = False
    eager: bool = False
    step_tokens: int | None = None
    unfused: bool = False
    models: tuple[str, ...] = ENGINE_MODELS
    graph_variants: bool = False
    host_split: bool = False


def engine_rows(device, dtype_name: str, smoke: bool, out_dir: Path, options: EngineOptions) -> list[dict]:
    """W1 and a bigger random Llama through the offline LLM on the device, base and LoRA (decode steps as CUDA
    graphs), and the modes `options` adds. Each mode's engine is built up front and their runs interleave (base,
    LoRA, base, LoRA...), so that a slow spell of a shared host falls on every mode alike; a ratio is the median of
    the runs' pairwise ratios."""
    import tempfile

    from bench.engine import MODEL_56M
    from engine.sampling_params import SamplingParams

    big = dict(MODEL_56M, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)
    models = [("W1 56M", MODEL_56M, 64, 128, 64, 8, 8), ("1B-class x8 layers", big, 256, 512, 128, 16, 16)]
    models = [model for model, key in zip(models, ENGINE_MODELS) if key in options.models]
    if smoke:
        tiny = dict(MODEL_56M, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        models = [("smoke", dict(tiny, num_key_value_heads=2), 4, 16, 4, 2, 4)]
    modes = ("base", "lora", "base-eager", "lora-eager") if options.eager else ("base", "lora")
    modes += ("lora-unfused",) if options.unfused else ()
    modes += ("lora-graph-serial", "lora-graph-plain") if options.graph_variants else ()
    rows = []
    for name, config, num_prompts, input_len, output_len, num_adapters, rank in models:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, adapters = write_model(Path(tmp), config, num_adapters, rank)
            row = {"model": name, "config": config, "num_prompts": num_prompts, "input_len": input_len,
                   "output_len": output_len, "adapters": num_adapters, "rank": rank, "dtype": dtype_name}  # fmt: skip
            llms = {}
            for mode in modes:
                with mode_settings(mode):
                    llms[mode] = make_llm(model_dir, len(adapters), device, dtype_name, mode, input_len + output_len,
                                          num_prompts, rank, options.step_tokens)  # fmt: skip
            row["max_num_batched_tokens"] = llms[modes[0]].engine.config.max_num_batched_tokens
            print(f"engine {name}: steps of up to {row['max_num_batched_tokens']} tokens", flush=True)
            gen = torch.Generator().manual_seed(1)
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
            loras = [adapters[i % len(adapters)] for i in range(num_prompts)]  # the LoRA modes' requests
            walls: dict[str, list[float]] = {mode: [] for mode in modes}
            step_walls: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}  # mode -> kind -> runs
            parts: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}  # mode -> part -> runs' seconds
            runs = 6 if num_prompts * input_len <= 8192 else 3  # small runs are short and noisy: more of them
            for run in range(1 + runs):  # the first warms up (compiles the kernels)
                prompts = torch.randint(10, config["vocab_size"], (num_prompts, input_len), generator=gen).tolist()
                for mode, llm in llms.items():
                    steps = step_walls[mode] if run else None
                    totals: dict[str, float] = {}
                    timing = timed_parts(totals) if options.host_split and run else contextlib.nullcontext()
                    with mode_settings(mode), timing:
                        wall = timed_generate(llm, prompts, params, loras if "lora" in mode else None, device, steps)
                    if run:
                        walls[mode].append(wall)
                        for part, seconds in totals.items():
                            parts[mode].setdefault(part, []).append(seconds)
            for mode in modes:
                steps_s = {kind: statistics.median(runs) for kind, runs in step_walls[mode].items()}
                row[mode] = {"walls_s": walls[mode], "tok_s": num_prompts * output_len / statistics.median(walls[mode]),
                             "steps_s": steps_s}  # fmt: skip
                print(f"engine {name} {mode}: {row[mode]['tok_s']:.0f} tok/s "
                      f"(runs {', '.join(f'{w:.3f}' for w in walls[mode])} s; median s in steps: "
                      f"{', '.join(f'{kind} {s:.3f}' for kind, s in steps_s.items())})", flush=True)  # fmt: skip
                if options.profile:
                    lora = loras if "lora" in mode else None
                    profile_to = out_dir / f"profile-{len(rows)}-{mode}.txt"
                    with mode_settings(mode):
                        row[mode]["profile"] = profile_run(llms[mode], prompts, params, lora, device, profile_to)
            if options.host_split:
                for mode in modes:
                    row[mode]["host_split_s"] = {part: statistics.median(s) for part, s in parts[mode].items()}
                print_host_split(name, row)
            row["lora_over_base"] = paired_ratio(walls["lora"], walls["base"])
            row["lora_extra_s"] = extra = lora_extra_seconds(walls, step_walls)
            print(f"engine {name}: LoRA / base {row['lora_over_base']:.2f} (median of paired runs); LoRA's extra "
                  f"seconds a run: {', '.join(f'{k} {s:+.4f}' for k, s in extra.items())}", flush=True)  # fmt: skip
            if options.unfused:
                row["fused_over_unfused"] = paired_ratio(walls["lora"], walls["lora-unfused"])
                print(
                    f"engine {name}: LoRA with its small layers in one launch / in two: "
                    f"{row['fused_over_unfused']:.3f} (median of paired runs)",
                    flush=True,
                )
            for mode in modes:
                if "graph-" in mode:
                    row[f"{mode}_over_lora"] = paired_ratio(walls[mode], walls["lora"])
                    print(f"engine {name}: {mode} / lora (branched graphs): {row[f'{mode}_over_lora']:.3f}", flush=True)
            if options.eager:
                row["eager_lora_over_base"] = paired_ratio(walls["lora-eager"], walls["base-eager"])
                print(f"engine {name}: eager LoRA / base {row['eager_lora_over_base']:.2f}; graphs / eager: base "
                      f"{paired_ratio(walls['base'], walls['base-eager']):.2f}, LoRA "
                      f"{paired_ratio(walls['lora'], walls['lora-eager']):.2f}", flush=True)  # fmt: skip
            del llms
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
    return rows


def print_host_split(name: str, row: dict) -> None:
    """Each timed part's median seconds a run, base and LoRA side by side (ms)."""
    base, lora = row["base"]["host_split_s"], row["lora"]["host_split_s"]
    print(f"engine {name}: host time a run by part (ms, median; each part holds its callees)", flush=True)
    for part in dict.fromkeys([*base, *lora]):
        b, lo = base.get(part, 0.0) * 1e3, lora.get(part, 0.0) * 1e3
        print(f"    {part:24s} base {b:9.2f}  lora {lo:9.2f}  lora - base {lo - b:+8.2f}", flush=True)


def mode_settings(mode: str) -> contextlib.AbstractContextManager:
    """What a mode's engine is built and run under: "unfused" LoRA takes no layer in one launch; "graph-serial" and
    "graph-plain" LoRA record its graphs' LoRA layers as lora_linear.GRAPH_LORA says."""
    from engine.layers import lora_linear
    from kernels.lora import triton_ops

    if "unfused" in mode:
        return patched(triton_ops, FUSE_MAX_REPEATED_K=0)
    if "graph-" in mode:
        return patched(lora_linear, GRAPH_LORA=mode.rsplit("-", 1)[1])
    return contextlib.nullcontext()


def paired_ratio(walls: list[float], other_walls: list[float]) -> float:
    """The throughput of one mode over another's: the median of each interleaved pair of runs' ratio."""
    return statistics.median(other / wall for wall, other in zip(walls, other_walls, strict=True))


def lora_extra_seconds(walls: dict[str, list[float]], step_walls: dict[str, dict[str, list[float]]]) -> dict:
    """What a LoRA run spends beyond its paired base run, in each kind of step and outside the steps (admitting
    the requests, ending the generate): the medians of the pairs' differences."""
    extra = {}
    for kind in STEP_KINDS:
        lora, base = step_walls["lora"][kind], step_walls["base"][kind]
        extra[f"{kind} steps"] = statistics.median(a - b for a, b in zip(lora, base, strict=True))

    def outside(mode: str) -> list[float]:
        return [wall - sum(runs) for wall, *runs in zip(walls[mode], *step_walls[mode].values(), strict=True)]

    extra["outside steps"] = statistics.median(a - b for a, b in zip(outside("lora"), outside("base"), strict=True))
    return extra


def write_model(directory: Path, config: dict, num_adapters: int, rank: int) -> tuple[Path, list]:
    from bench.engine import build_model
    from bench.lora import make_adapters

    model = build_model(directory / "base", config=config)
    return directory / "base", make_adapters(model, directory, num_adapters, rank)


def make_llm(model_dir, num_adapters, device, dtype_name, mode, max_model_len, num_prompts, rank, step_tokens=None):
    from engine.llm import LLM

    return LLM(
        model=str(model_dir),
        dtype=dtype_name,
        device=str(device),
        max_model_len=max_model_len,
        max_num_seqs=num_prompts,
        max_num_batched_tokens=step_tokens,  # None: the engine's default for the device
        enable_prefix_caching=False,
        kv_cache_memory=4 << 30 if device.type == "cuda" else None,  # not 85% of an 80 GB card for a small run
        enable_lora=mode.startswith("lora"),
        max_loras=max(1, num_adapters),
        max_cpu_loras=max(1, num_adapters),
        max_lora_rank=rank,
        enforce_eager=mode.endswith("eager"),
    )


def timed_generate(llm, prompts, params, lora, device, steps: dict[str, list[float]] | None = None) -> float:
    """Seconds for one offline generate of `prompts`, the device's queue drained before and after; `steps` (kind
    -> seconds) gets each engine step's seconds added, by `step_kind`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with step_times(llm.engine, steps if steps is not None else {}):
        outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return time.perf_counter() - start


@contextlib.contextmanager
def step_times(engine, totals: dict[str, list[float]]) -> Iterator[None]:
    """While inside, times every step of `engine` (each ends with its sampled tokens on the host, so its wall
    holds its device time) and adds it to totals[kind]: one entry per generate, the sum of its steps' seconds."""
    run = {kind: 0.0 for kind in STEP_KINDS}
    step = engine.step

    def timed_step():
        steps_before, start = engine.stats.num_steps, time.perf_counter()
        outputs = step()
        if engine.stats.num_steps != steps_before:  # it ran a batch
            run[step_kind(engine.step_trace[-1].scheduled)] += time.perf_counter() - start
        return outputs

    engine.step = timed_step
    try:
        yield
    finally:
        del engine.step  # the class's method again
        for kind, seconds in run.items():
            totals.setdefault(kind, []).append(seconds)


STEP_KINDS = ("prefill", "decode")


def step_kind(scheduled: list[tuple[str, int]]) -> str:
    """A step of one new token per seq is "decode" (the CUDA graphs' steps), any other "prefill" (prompt tokens)."""
    return "decode" if all(n == 1 for _, n in scheduled) else "prefill"


def profile_run(llm, prompts, params, lora, device, path: Path) -> dict:
    """One more run under torch.profiler: its wall, the device's busy time, kernel launches per engine step, and
    the ops by self CPU time (written to `path`): is the step bound by the device or by the host?"""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps_before = llm.engine.stats.num_steps
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    steps = llm.engine.stats.num_steps - steps_before
    events = prof.key_averages()
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
    launches = sum(e.count for e in events if e.key in launch_names)
    summary = {
        "wall_s": wall,
        "steps": steps,
        "device_busy_s": sum(e.self_device_time_total for e in events) / 1e6,
        "launches_per_step": launches / max(steps, 1),
        "lora_kernels": kernel_totals(events, LORA_KERNELS),
    }
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    by_device = events.table(sort_by="self_device_time_total", row_limit=30) if device.type == "cuda" else ""
    path.write_text(json.dumps(summary) + "\n" + table + "\n" + by_device)
    print(f"    profiled: {summary}", flush=True)
    print("\n".join(table.splitlines()[:16]), flush=True)
    return summary


def kernel_totals(events, names: tuple[str, ...]) -> dict[str, dict]:
    """{kernel: {"calls", "device_s", "us_per_call"}} for the named kernels among a profile's key_averages()."""
    return {
        e.key: {
            "calls": e.count,
            "device_s": e.self_device_time_total / 1e6,
            "us_per_call": e.self_device_time_total / max(e.count, 1),
        }
        for e in events
        if e.key in names
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help="of " + ", ".join(SECTIONS))
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))  # the engine's dtype names
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' launch settings")
    parser.add_argument(
        "--sweep-partitions", action="store_true", help="also time decode attention never split and split in parts"
    )
    parser.add_argument("--profile", action="store_true", help="also profile one engine run of each model and mode")
    parser.add_argument("--eager", action="store_true", help="also run the engine with enforce_eager (no CUDA graphs)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (implied without a CUDA device)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="the engine section's step budget (default: the engine's)"
    )
    parser.add_argument(
        "--unfused", action="store_true", help="also run LoRA with no layer in one launch (shrink, then expand)"
    )
    parser.add_argument("--lora-quick", action="store_true", help="without the split-K and expand group tables")
    parser.add_argument(
        "--graph-variants", action="store_true", help="also LoRA with its graphs' layers serial, and plain (fused)"
    )
    parser.add_argument("--models", default=",".join(ENGINE_MODELS), help="the engine section's: w1, 1b or both")
    parser.add_argument(
        "--host-split", action="store_true", help="also time each engine step's parts on the host (base vs LoRA)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench-results/gpu.json"))
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if {"attention", "lora"} & set(sections) and "ceilings" not in sections:
        sections.append("ceilings")  # their "of copy" figures are read against the device's copy rate
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type != "cuda"
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import (the kernels import it)
    dtype = DTYPES[args.dtype]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "dtype": args.dtype, "device": str(device)}
    failures = {}

    def section(name: str, run: Callable[[], object]) -> None:
        if name not in sections:
            return
        try:
            results[name] = run()
        except Exception as e:  # one broken section must not hide the others' figures
            import traceback

            traceback.print_exc()
            failures[name] = f"{type(e).__name__}: {e}"

    section("ceilings", lambda: ceilings(device, dtype, smoke))
    copy_rate = results.get("ceilings", {}).get("copy_bytes_per_s", float("nan"))
    section("attention", lambda: attention_rows(
        device, dtype, SMOKE_ATTENTION if smoke else ATTENTION_SHAPES, copy_rate, args.sweep, args.sweep_partitions
    ))  # fmt: skip
    section("lora", lambda: lora_rows(
        device, dtype, SMOKE_LORA if smoke else LORA_SHAPES, copy_rate, args.sweep, args.lora_quick
    ))  # fmt: skip
    engine_options = EngineOptions(
        profile=args.profile,
        eager=args.eager,
        step_tokens=args.max_num_batched_tokens,
        unfused=args.unfused,
        models=tuple(args.models.split(",")),
        graph_variants=args.graph_variants,
        host_split=args.host_split,
    )
    section("engine", lambda: engine_rows(device, args.dtype, smoke, args.json.parent, engine_options))
    results["failures"] = failures
    args.json.write_text(json.dumps(results, indent=2, default=str))
    print(f"saved {args.json}" + (f"; failed sections: {failures}" if failures else ""), flush=True)
    return results


if __name__ == "__main__":
    main()
