"""LoraMeta: one step's batched-LoRA metadata, built once by the model runner and read by every LoRA layer.

Token t of the step's flat batch uses row `token_adapter_idx[t]` of the stacked weights, -1 = no adapter.
The tokens with an adapter are grouped by adapter: `sorted_token_idx` sorts them (stably) by row, and segment a
of it holds the tokens of row `active_adapters[a]`. The Triton kernels run one program per tile of up to
`tile_tokens` tokens of one segment (times column tiles): the tile table lists the tiles, so a launch holds no
program without tokens however unequal the segments are. Besides what the Triton kernels read, `build`
precomputes the two layouts the torch path may use without a gather (tokens already in runs) or with one padded
batch (many small segments), so that a layer builds no index.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .host_pack import HostPack

NO_ADAPTER = -1
# The padded layout is built only while padding at most doubles the rows: beyond that, padding costs more work
# than the per-segment loop it saves.
MAX_PADDED_ROWS_PER_TOKEN = 2
# Tokens per Triton tile: a power of two from the longest segment, at least 16 (tl.dot's least M), at most 64.
MIN_TILE_TOKENS, MAX_TILE_TOKENS = 16, 64
NO_TILE = -1  # a tile table's unused entry: its program exits


@dataclass(slots=True)
class LoraMeta:
    token_adapter_idx: Tensor  # [T] int64 on device: row of the stacked weights per token, -1 = none
    num_tokens: int  # T
    has_lora: bool  # host: some token has an adapter; False: every op returns at once
    active_adapters: list[int]  # [A] host: the rows in use, ascending
    sorted_token_idx: Tensor  # [L] int64 on device: the L tokens with an adapter, stably sorted by row
    seg_starts: list[int]  # [A] host: row active_adapters[a] owns sorted_token_idx[seg_starts[a]:seg_ends[a]]
    seg_ends: list[int]  # [A] host
    max_seg_len: int
    seg_indptr: Tensor  # [A+1] int32 on device: seg_starts then the last end (Triton)
    seg_adapter_idx: Tensor  # [A] int64 on device: active_adapters (Triton, and the torch padded layout)
    # Torch path only.
    run_starts: list[int] | None  # [A] host: when each row's tokens are one contiguous run of the batch, where
    # the runs start (segment a is tokens run_starts[a] + [0, seg_len)); None: the segments need a gather
    padded_token_idx: Tensor | None  # [A * max_seg_len] int64: segments padded to max_seg_len by repeating a
    # token of theirs; None: padding would more than double the rows, or one segment
    padded_rows: Tensor | None  # [L] int64: row of sorted token j in the padded layout
    padded_is_pad: Tensor | None  # [A * max_seg_len, 1] bool: True on the padding rows
    # CPU kernels: [N] int64 host, each row's rank (its A / B columns past it are zero and skipped), of the R =
    # max_rank of the stacked weights; None: every row uses all R
    row_ranks: Tensor | None = None
    max_rank: int = 0
    # Triton: tokens per program (a power of two >= 16), and the tiles' table: tile_table[0, j] = the segment
    # of tile j (NO_TILE: none, the program exits), tile_table[1, j] = its first position in sorted_token_idx
    tile_tokens: int = MIN_TILE_TOKENS
    tile_table: Tensor | None = None  # [2, W] int32 on device; W = the launch's tiles
    # its two rows as views [W], made once per step rather than at each launch
    tile_seg: Tensor | None = field(init=False, default=None)
    tile_start: Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.tile_table is not None:
            self.tile_seg, self.tile_start = self.tile_table.unbind(0)

    @property
    def num_active(self) -> int:
        return len(self.active_adapters)

    @classmethod
    def build(
        cls,
        token_adapter_idx: list[int] | np.ndarray | Tensor,
        device: torch.device | str,
        row_ranks: Tensor | None = None,
        max_rank: int = 0,
        tile_tokens: int = 0,
        torch_layouts: bool = True,
    ) -> "LoraMeta":
        """`tile_tokens`: the Triton tiles' tokens (0: from the longest segment). `torch_layouts`: also the torch
        path's layouts (run_starts, the padded layout); the Triton and CPU kernels read neither. Built with numpy
        (a torch CPU op costs several µs of dispatch, a step's meta took ~0.5 ms of host time for 2048 tokens) and
        moved to the device in one copy (HostPack); on a CPU the tensors are those arrays (packing them there cost
        ~30 µs a step for nothing)."""
        if isinstance(token_adapter_idx, Tensor):
            token_adapter_idx = token_adapter_idx.cpu().numpy()
        idx = np.array(token_adapter_idx, dtype=np.int64).reshape(-1)  # [T], a copy: the caller's may change
        if idx.size and idx.min() < NO_ADAPTER:
            raise ValueError(f"token_adapter_idx holds {idx.min()}; rows are >= 0, or -1 for no adapter")
        lora_tokens = np.flatnonzero(idx >= 0)  # [L]
        sorted_token_idx = lora_tokens[np.argsort(idx[lora_tokens], kind="stable")]  # [L]
        active, counts = np.unique(idx[sorted_token_idx], return_counts=True)  # [A], [A]
        seg_indptr = np.zeros(len(counts) + 1, dtype=np.int64)  # [A+1]
        np.cumsum(counts, out=seg_indptr[1:])
        max_seg_len = int(counts.max(initial=0))
        tile_tokens = tile_tokens or tile_tokens_for(max_seg_len)
        arrays = {
            "token_adapter_idx": idx,
            "sorted_token_idx": sorted_token_idx,
            "seg_adapter_idx": active,
            "seg_indptr": seg_indptr.astype(np.int32),
            "tile_table": tile_table(seg_indptr, tile_tokens),
        }
        run_starts = None
        if torch_layouts:
            run_starts = _run_starts(idx, sorted_token_idx, seg_indptr)
            if len(counts) > 1 and len(counts) * max_seg_len <= MAX_PADDED_ROWS_PER_TOKEN * len(sorted_token_idx):
                padded = _padded_layout(sorted_token_idx, seg_indptr, max_seg_len)
                arrays.update(zip(("padded_token_idx", "padded_rows", "padded_is_pad"), padded, strict=True))
        if torch.device(device).type == "cpu":  # the arrays are the step's own: the tensors share their memory
            on_device = {name: torch.from_numpy(array) for name, array in arrays.items()}
        else:
            on_device = HostPack(arrays).to(device)
        return cls(
            token_adapter_idx=on_device["token_adapter_idx"],
            num_tokens=idx.shape[0],
            has_lora=bool(len(counts)),
            active_adapters=active.tolist(),
            sorted_token_idx=on_device["sorted_token_idx"],
            seg_starts=seg_indptr[:-1].tolist(),
            seg_ends=seg_indptr[1:].tolist(),
            max_seg_len=max_seg_len,
            seg_indptr=on_device["seg_indptr"],
            seg_adapter_idx=on_device["seg_adapter_idx"],
            run_starts=run_starts,
            padded_token_idx=on_device.get("padded_token_idx"),
            padded_rows=on_device.get("padded_rows"),
            padded_is_pad=on_device.get("padded_is_pad"),
            row_ranks=row_ranks,
            max_rank=max_rank,
            tile_tokens=tile_tokens,
            tile_table=on_device["tile_table"],
        )

    @classmethod
    def over_rows(
        cls,
        token_adapter_idx: Tensor,
        sorted_token_idx: Tensor,
        seg_indptr: Tensor,
        seg_adapter_idx: Tensor,
        tile_table: Tensor,
    ) -> "LoraMeta":
        """A meta over fixed device buffers whose contents change from step to step but whose launches do not (a
        CUDA graph's): one segment per stacked row, segment a = row seg_adapter_idx[a] (empty where the row has no
        token), each up to every token long, in tiles of GRAPH_TILE_TOKENS. What the kernels read comes from the
        buffers, which the caller fills (`fill_tile_table` for the table, whose unused tiles hold segment -1); what
        they launch from the shapes alone. Only the Triton ops read it (the torch-path layouts and host lists are
        left empty).
        token_adapter_idx, sorted_token_idx: [T] int64 · seg_indptr: [N+1] int32 · seg_adapter_idx: [N] int64 ·
        tile_table: [2, graph_tiles(T, N)] int32"""
        num_tokens, num_rows = token_adapter_idx.shape[0], seg_adapter_idx.shape[0]
        if sorted_token_idx.shape[0] != num_tokens or seg_indptr.shape[0] != num_rows + 1:
            raise ValueError(
                f"{num_tokens} tokens, {sorted_token_idx.shape[0]} sorted; {num_rows} rows, {seg_indptr.shape[0]} "
                "segment bounds (want tokens + 0, rows + 1)"
            )
        if tile_table.shape != (2, graph_tiles(num_tokens, num_rows)):
            raise ValueError(f"tile_table is {tuple(tile_table.shape)}, want [2, {graph_tiles(num_tokens, num_rows)}]")
        return cls(
            token_adapter_idx=token_adapter_idx,
            num_tokens=num_tokens,
            has_lora=True,
            active_adapters=list(range(num_rows)),  # every row, as far as the launches (and checks) go
            sorted_token_idx=sorted_token_idx,
            seg_starts=[],
            seg_ends=[],
            max_seg_len=num_tokens,
            seg_indptr=seg_indptr,
            seg_adapter_idx=seg_adapter_idx,
            run_starts=None,
            padded_token_idx=None,
            padded_rows=None,
            padded_is_pad=None,
            tile_tokens=GRAPH_TILE_TOKENS,
            tile_table=tile_table,
        )


# A graph's tiles: its segments are a decode step's few tokens per adapter. H100, W1, 64 tokens over 8 rows: the
# LoRA graph replayed in 796 us with 16, 890 with 64 (before the tile table).
GRAPH_TILE_TOKENS = MIN_TILE_TOKENS


def tile_tokens_for(max_seg_len: int) -> int:
    """Tokens per Triton tile for segments of up to max_seg_len tokens."""
    return max(MIN_TILE_TOKENS, min(MAX_TILE_TOKENS, 1 << max(0, max_seg_len - 1).bit_length()))


def tile_table(seg_indptr: np.ndarray | list[int], tile_tokens: int) -> np.ndarray:
    """[2, W] int32: each segment cut into tiles of up to tile_tokens tokens, in order: row 0 the tile's segment,
    row 1 its first position in sorted_token_idx. seg_indptr: [A+1]. In numpy: a graph step builds one on the host
    (27 µs for 256 tokens over 16 rows, filling included; torch's CPU ops took ~0.4 ms on the H100's host)."""
    bounds = np.asarray(seg_indptr, dtype=np.int64)
    starts, lens = bounds[:-1], np.diff(bounds)  # [A]
    counts = -(-lens // tile_tokens)  # [A] tiles per segment
    segs = np.repeat(np.arange(len(counts)), counts)  # [W]
    within = np.arange(len(segs)) - (np.cumsum(counts) - counts)[segs]  # [W] the tile's index in its segment
    return np.stack([segs, starts[segs] + within * tile_tokens]).astype(np.int32)


def graph_tiles(num_tokens: int, num_rows: int) -> int:
    """The most tiles of GRAPH_TILE_TOKENS that num_tokens tokens over num_rows segments can need."""
    return -(-num_tokens // GRAPH_TILE_TOKENS) + num_rows


def fill_graph_layout(
    adapter_rows: np.ndarray | list[int], sorted_out: np.ndarray, seg_indptr_out: np.ndarray, tiles_out: np.ndarray
) -> None:
    """Writes a graph step's LoRA layout (`LoraMeta.over_rows`: segment a = the tokens of row a, in batch order) into
    host buffers: the L tokens with an adapter sorted by row into sorted_out[:L], the rows' segment bounds into
    seg_indptr_out [N+1] (N = its length - 1), and their tiles into tiles_out (`fill_tile_table`).
    adapter_rows: [T], -1 for none."""
    rows = np.asarray(adapter_rows, dtype=np.int64)  # [T]
    num_rows = len(seg_indptr_out) - 1
    counts = np.bincount(rows[rows >= 0], minlength=num_rows)  # [N]
    num_lora = int(counts.sum())
    sorted_out[:num_lora] = np.argsort(np.where(rows >= 0, rows, num_rows), kind="stable")[:num_lora]
    seg_indptr_out[0] = 0
    np.cumsum(counts, out=seg_indptr_out[1:])
    fill_tile_table(tiles_out, seg_indptr_out)


def fill_tile_table(out: np.ndarray, seg_indptr: np.ndarray) -> None:
    """Writes a graph step's tiles (GRAPH_TILE_TOKENS each) into the [2, W] int32 host buffer out, NO_TILE past them."""
    tiles = tile_table(seg_indptr, GRAPH_TILE_TOKENS)  # [2, w], w <= W
    out[:, : tiles.shape[1]] = tiles
    out[0, tiles.shape[1] :] = NO_TILE


def _run_starts(idx: np.ndarray, sorted_token_idx: np.ndarray, seg_indptr: np.ndarray) -> list[int] | None:
    """Each segment's first token when every row's tokens are one run of consecutive tokens; else None."""
    changes = idx[1:] != idx[:-1]  # [T-1]
    num_runs = int((changes & (idx[1:] >= 0)).sum()) + int(idx.size > 0 and idx[0] >= 0)
    if num_runs != len(seg_indptr) - 1:
        return None
    return sorted_token_idx[seg_indptr[:-1]].tolist()


def _padded_layout(
    sorted_token_idx: np.ndarray, seg_indptr: np.ndarray, max_seg_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment a's tokens at rows a * max_seg_len + [0, seg_len), the rest repeating its last token:
    (padded_token_idx [A * M], padded_rows [L], padded_is_pad [A * M, 1])."""
    starts, lens = seg_indptr[:-1], np.diff(seg_indptr)  # [A], [A]
    within = np.arange(max_seg_len)  # [M]
    src = starts[:, None] + np.minimum(within[None, :], lens[:, None] - 1)  # [A, M] positions in sorted order
    is_token = (within[None, :] < lens[:, None]).reshape(-1)  # [A * M]
    return sorted_token_idx[src.reshape(-1)], np.flatnonzero(is_token), ~is_token[:, None]


def check_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    """Shapes of a lora_shrink call, against each other and the meta (host-side only)."""
    check_shrink_shape(out.shape, x, lora_a, meta)


def check_shrink_shape(out_shape: tuple[int, int], x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    """check_shrink for a z of out_shape [T, S * R], which a fused kernel keeps in registers."""
    num_tokens, width = out_shape
    if x.shape[0] != num_tokens or num_tokens != meta.num_tokens:
        raise ValueError(f"out has {num_tokens} rows, x {x.shape[0]}, the meta {meta.num_tokens} tokens")
    if lora_a.shape[1:] != (width, x.shape[1]):
        raise ValueError(f"lora_a is {tuple(lora_a.shape)}, expected [N, {width}, {x.shape[1]}]")
    _check_rows(lora_a, meta)


def check_expand(y: Tensor, z: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]) -> None:
    """Shapes of a lora_expand call, against each other and the meta (host-side only)."""
    check_expand_shape(y, z.shape, lora_b, meta, output_slices)


def check_expand_shape(
    y: Tensor, z_shape: tuple[int, int], lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]
) -> None:
    """check_expand for a z of z_shape [T, S * R], which a fused kernel keeps in registers."""
    num_tokens, hidden_out = y.shape
    if z_shape[0] != num_tokens or num_tokens != meta.num_tokens:
        raise ValueError(f"y has {num_tokens} rows, z {z_shape[0]}, the meta {meta.num_tokens} tokens")
    if sum(output_slices) != hidden_out or lora_b.shape[1] != hidden_out:
        raise ValueError(f"output_slices {output_slices}, y {tuple(y.shape)} and lora_b {tuple(lora_b.shape)} differ")
    if z_shape[1] != len(output_slices) * lora_b.shape[2]:
        raise ValueError(f"z has {z_shape[1]} columns for {len(output_slices)} slices of rank {lora_b.shape[2]}")
    _check_rows(lora_b, meta)


def _check_rows(weights: Tensor, meta: LoraMeta) -> None:
    if meta.active_adapters[-1] >= weights.shape[0]:
        raise ValueError(f"adapter row {meta.active_adapters[-1]} is past the {weights.shape[0]} stacked rows")
