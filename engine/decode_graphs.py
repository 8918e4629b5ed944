"""DecodeGraphs: decode-only steps replayed as CUDA graphs, one graph per batch-size bucket, with and without LoRA.

On a GPU a decode step's forward is a few hundred small kernel launches (~220 for an 8-layer Llama, ~285 with
LoRA), each costing the host more time than the device spends on it: measured on an H100, the device was busy 7%
of a W1 run. As vLLM and SGLang do, each bucket's whole forward is captured once at start and replayed: a step
writes its inputs into fixed buffers (three host-to-device copies), replays its bucket's graph and reads the first
rows of the graph's output.

A graph replays the launches it recorded, grids and scalar arguments included, so everything the forward reads
lives at a fixed address (the buffers here, the KV pool, the stacked LoRA rows, which adapter loads overwrite in
place) and every launch depends on the bucket alone: padding rows (no token to store, one key of block 0, no
adapter) fill the bucket, the attention meta declares the longest context the engine admits, and the LoRA meta has
one segment per device row, empty ones exiting (`PagedAttentionMeta.decode_over`, `LoraMeta.over_rows`).

On a CPU `capture=False` runs the same padded forward eagerly, so tests prove the padding and the buffers there,
with the Triton kernels interpreted; a GPU run compares the graphs with eager steps and with transformers + peft.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.scheduler import ScheduledBatch
from engine.step_meta import StepMeta
from kernels.lora import NO_ADAPTER, LoraMeta
from kernels.lora.meta import fill_graph_layout, graph_tiles
from kernels.paged_attention import PagedAttentionMeta

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: there the launches no longer dominate a step


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets, ascending: 1, 2, 4, then every multiple of 8 (vLLM's), up to max_num_seqs (included)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [size for size in (1, 2, 4) if size < top] + list(range(8, top, 8))
    return [*sizes, top]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        max_context_len: int,
        max_num_seqs: int,
        num_lora_rows: int | None,
        device: torch.device,
        capture: bool = True,
    ):
        """`num_lora_rows`: the stacked adapter rows (None: no LoRA, base graphs only). `capture`: record CUDA graphs
        (CUDA only); False runs each step's padded forward eagerly."""
        self.model, self.device = model, device
        self.block_size, self.max_context_len = block_size, max_context_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_context_len // block_size)
        self.num_lora_rows = num_lora_rows
        rows = num_lora_rows or 0
        pin = device.type == "cuda"
        # host staging, filled each step; [5, B]: input ids, positions, slots, adapter row, tokens sorted by row
        self.host_ids = torch.zeros(5, self.max_batch, dtype=torch.int64, pin_memory=pin)
        # [B + rows + 1 + 2 W]: each seq's context length, the LoRA segment bounds (segment a = row a), then the
        # LoRA tile table [2, W] (W = the most tiles the largest bucket can need; a bucket's graph reads the first)
        self.tile_width = graph_tiles(self.max_batch, rows) if rows else 0
        self.host_lens = torch.zeros(self.max_batch + rows + 1 + 2 * self.tile_width, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, pin_memory=pin)  # [B, M]
        self.ids, self.lens, self.tables = (t.to(device) for t in (self.host_ids, self.host_lens, self.host_tables))
        self.seg_adapter_idx = torch.arange(rows, dtype=torch.int64, device=device)  # [rows]: fixed, segment a = row a
        # the host buffers' LoRA layout and the adapter rows it was made for: a steady decode batch keeps its rows
        # step after step, and remaking the layout cost 211 µs a step of W1's host time on an H200's host (+13 ms a
        # run, the larger part of what LoRA added to its decode steps)
        self.host_layout = tuple(view.numpy() for view in self._lora_views(self.host_lens)) if rows else ()
        self.layout_rows: list[int] | None = None
        self.copied = torch.cuda.Event() if pin else None  # the last step's copies are done: staging may be rewritten
        # (bucket, with LoRA) -> a call that runs that step over the buffers and returns its [bucket, H] output
        self.graphs: dict[tuple[int, bool], Callable[[], torch.Tensor]] = {}
        self.capture = capture and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def takes(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` is a decode-only step a graph holds: one new token per seq, few enough seqs, and every
        block table within the buffers (always, for sequences within the engine's context limit)."""
        return (
            batch.num_prefills == 0
            and len(batch.seqs) <= self.max_batch
            and all(n == 1 for n in batch.num_new_tokens)
            and all(len(seq.block_table) <= self.max_blocks for seq in batch.seqs)
        )

    def bucket(self, num_seqs: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_seqs)

    def _forward(self, size: int, with_lora: bool) -> torch.Tensor:
        """The padded step of `size` rows over the buffers: [size, H]."""
        input_ids, positions, slots, adapter_idx, sorted_idx = self.ids[:, :size]
        attn = PagedAttentionMeta.decode_over(
            slots, self.block_size, self.lens[:size], self.tables[:size], self.max_context_len
        )
        lora = None
        if with_lora:
            seg_indptr, tiles = self._lora_views(self.lens)
            tiles = tiles[:, : graph_tiles(size, self.num_lora_rows)]  # [2, W(size)]: what this bucket can need
            lora = LoraMeta.over_rows(adapter_idx, sorted_idx, seg_indptr, self.seg_adapter_idx, tiles)
        return self.model(input_ids, positions, StepMeta(attn, lora))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Records every bucket's graph (largest first, all in one memory pool), each after one eager run of the
        same shapes (which compiles its kernels and makes its cached tensors outside the capture)."""
        start = time.perf_counter()
        self._fill([], [], self.max_batch)  # padding rows only: the forward stores nothing
        self._copy()
        modes = (False, True) if self.num_lora_rows else (False,)
        for size in reversed(self.batch_sizes):
            for with_lora in modes:
                self._forward(size, with_lora)  # warm-up
                if not self.capture:
                    self.graphs[size, with_lora] = functools.partial(self._forward, size, with_lora)
                    continue
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(size, with_lora)  # [size, H], in the graphs' pool
                self.graphs[size, with_lora] = functools.partial(_replay, graph, out)
        if self.capture:
            torch.cuda.synchronize(self.device)
            logger.info(
                "CUDA graphs: decode steps of %s seqs%s captured in %.1f s",
                _ranges(self.batch_sizes),
                " (base and LoRA)" if len(modes) == 2 else "",
                time.perf_counter() - start,
            )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """The final hidden states [B, H] of the decode step `batch` (`takes(batch)`), one row per seq."""
        num_seqs = len(batch.seqs)
        size = self.bucket(num_seqs)
        adapter_rows = [seq.adapter_idx for seq in batch.seqs]
        with_lora = self.num_lora_rows is not None and max(adapter_rows) != NO_ADAPTER
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies read the staging buffers: wait before refilling
        self._fill(batch.seqs, adapter_rows if with_lora else [NO_ADAPTER] * num_seqs, size)
        self._copy(size)
        # a copy: the next replay (of any bucket: they share a pool) overwrites a graph's output
        return self.graphs[size, with_lora]()[:num_seqs].clone()

    def _fill(self, seqs: list, adapter_rows: list[int], size: int) -> None:
        """Writes the step's inputs into the host staging buffers: seqs first, then padding rows up to `size`."""
        bs, n = self.block_size, len(seqs)
        ids, lens, tables = self.host_ids.numpy(), self.host_lens.numpy(), self.host_tables.numpy()
        for i, seq in enumerate(seqs):
            position = seq.num_computed_tokens
            table = seq.block_table
            ids[0, i], ids[1, i] = seq.token_ids[position], position
            ids[2, i] = table[position // bs] * bs + position % bs
            lens[i] = position + 1
            tables[i, : len(table)] = table
        ids[:2, n:size], ids[2, n:size], lens[n:size], tables[n:size, 0] = 0, -1, 1, 0  # padding rows
        ids[3, :n], ids[3, n:size] = adapter_rows, NO_ADAPTER
        if self.num_lora_rows and adapter_rows != self.layout_rows:  # segment a: the tokens of row a, in batch order
            seg_indptr, tiles = self.host_layout
            fill_graph_layout(adapter_rows, ids[4], seg_indptr, tiles)
            self.layout_rows = list(adapter_rows)

    def _lora_views(self, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The LoRA part of lens (the host staging buffer or its device copy), after the seqs' context lengths: the
        segment bounds [rows + 1] (segment a = row a) and the tile table [2, W]."""
        tables_at = self.max_batch + self.num_lora_rows + 1
        return lens[self.max_batch : tables_at], lens[tables_at:].view(2, self.tile_width)

    def _copy(self, size: int | None = None) -> None:
        """The staging buffers to the device: the ids and lengths whole, the first `size` rows of the block tables.
        Each source is contiguous: a strided one (the tables' first columns only, as before 2026-11-28) is copied
        by torch into a pageable temporary first, which on CUDA makes the copy wait for the stream and adds a copy
        kernel on the device (the three copies took 194 µs a step of an H200's host time). Whole rows cost bytes
        instead, asynchronously: 128 KB for 64 rows of an 8192-token context's tables."""
        size = size or self.max_batch
        self.ids.copy_(self.host_ids, non_blocking=True)
        self.lens.copy_(self.host_lens, non_blocking=True)
        self.tables[:size].copy_(self.host_tables[:size], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


def _replay(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return out


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]} ({len(sizes)} sizes)"
