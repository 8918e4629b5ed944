"""PagedAttentionMeta: one step's attention metadata, built once by the model runner and read by every layer.

A step's flat batch of T tokens holds the prefill tokens first (sequence after sequence; a prefill may be a
chunk continuing a prompt already partly in the cache), then exactly one token per decode sequence, then
optional padding tokens (slot -1). Besides what the Triton kernels read, `build` precomputes the gather
indices and masks of the torch path (its per-sequence prefills and decode groups on first use), so that a layer
builds no index and runs no Python loop.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor


@dataclass(slots=True)
class PrefillSeq:
    """One prefill sequence for the torch path's per-sequence attention (host-side ints, device tensors)."""

    token_start: int  # its first token in the flat batch
    q_len: int
    context_len: int
    kv_blocks: Tensor  # [cdiv(context_len, block_size)] int64 block ids
    mask: Tensor | None  # [q_len, context_len] bool causal with the new tokens last; None: plain causal


@dataclass(slots=True)
class DecodeGroup:
    """Decode seqs of similar context length, attended as one padded batch by the torch path."""

    rows: Tensor  # [G] int64 their rows among the decode tokens
    kv_blocks: Tensor  # [G * nb] int64 block ids, nb = cdiv(longest context of the group, block_size)
    mask: Tensor  # [G, 1, 1, nb * block_size] bool, True = attend


# Padded keys per decode group: bounds the gathered K/V copy (and its padding waste) whatever the batch.
DECODE_GROUP_KEYS = 8192


@dataclass(slots=True)
class PagedAttentionMeta:
    slot_mapping: Tensor  # [T] int64: block_id * block_size + offset where token t's K/V go; -1 = don't store
    block_size: int
    num_prefill_tokens: int
    prefill_cu_seqlens_q: Tensor  # [P+1] int32
    prefill_context_lens: Tensor  # [P] int32: keys each prefill seq attends, its new tokens last
    prefill_block_tables: Tensor  # [P, max_blocks] int32, padded with 0
    max_prefill_q_len: int
    max_prefill_context_len: int
    decode_context_lens: Tensor  # [D] int32: keys incl. the new token
    decode_block_tables: Tensor  # [D, max_blocks] int32, padded with 0
    max_decode_context_len: int
    # Torch path only: built here so that layers only gather.
    store_token_idx: Tensor | None  # [S] int64 tokens whose slot >= 0; None when every token is stored
    store_slots: Tensor  # [S] int64 their slots
    prefill_kv_blocks: Tensor  # [P * nb] int64 block ids, nb = cdiv(max_prefill_context_len, block_size)
    # Per-sequence prefill (torch path) when padding would waste work: lengths differ or a prefix is cached; None:
    # every prefill has the same length and no cached prefix, so one padded batch is exact. Made on first use
    # (`prefill_seqs`), as the decode groups are: each prefill seq's block ids (and mask) are a copy to the device
    # that a C++ or Triton kernel's step would pay for and never read.
    make_prefill_seqs: Callable[[], list[PrefillSeq] | None]
    # decode seqs sorted by context length, split under DECODE_GROUP_KEYS: made on first use (`decode_groups`), as
    # only the torch path reads them and a C++ or Triton kernel's step would pay for them every step
    make_decode_groups: Callable[[], list[DecodeGroup]]
    _decode_groups: list[DecodeGroup] | None = None
    _prefill_seqs: list[PrefillSeq] | None = None
    _prefill_seqs_made: bool = False

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        if self._decode_groups is None:
            self._decode_groups = self.make_decode_groups()
        return self._decode_groups

    @property
    def prefill_seqs(self) -> list[PrefillSeq] | None:
        if not self._prefill_seqs_made:
            self._prefill_seqs, self._prefill_seqs_made = self.make_prefill_seqs(), True
        return self._prefill_seqs

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_context_lens.shape[0]

    @property
    def num_decode_seqs(self) -> int:
        return self.decode_context_lens.shape[0]

    @classmethod
    def build(
        cls,
        slot_mapping: Tensor,
        block_size: int,
        prefill_q_lens: list[int],
        prefill_context_lens: list[int],
        prefill_block_tables: list[list[int]],
        decode_context_lens: list[int],
        decode_block_tables: list[list[int]],
        device: torch.device | str,
    ) -> "PagedAttentionMeta":
        _check_seqs(block_size, prefill_q_lens, prefill_context_lens, prefill_block_tables, with_q=True)
        _check_seqs(block_size, [1] * len(decode_context_lens), decode_context_lens, decode_block_tables)
        num_prefill_tokens = sum(prefill_q_lens)
        if slot_mapping.shape[0] < num_prefill_tokens + len(decode_context_lens):
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} tokens, fewer than the batch holds")
        # on the host when the caller's slots are (the runner's are): no device round trip to find the stored tokens
        store_token_idx, store_slots = _store_indices(slot_mapping.to(torch.int64))
        max_p_ctx = max(prefill_context_lens, default=0)
        max_d_ctx = max(decode_context_lens, default=0)
        p_tables = _pad_tables(prefill_block_tables)  # [P, max_blocks]
        d_tables = _pad_tables(decode_block_tables)  # [D, max_blocks]

        def dev(x: list[int] | Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.as_tensor(x).to(device=device, dtype=dtype, non_blocking=True)

        p_ctx, d_ctx = dev(prefill_context_lens), dev(decode_context_lens)
        slots_on_device = dev(slot_mapping)
        make_prefill_seqs = _no_prefill_seqs
        if len(set(prefill_q_lens)) > 1 or prefill_q_lens != prefill_context_lens:
            make_prefill_seqs = partial(_prefill_seqs, prefill_q_lens, prefill_context_lens, p_tables, block_size, dev)
        return cls(
            slot_mapping=slots_on_device,
            block_size=block_size,
            num_prefill_tokens=num_prefill_tokens,
            prefill_cu_seqlens_q=dev([0, *itertools.accumulate(prefill_q_lens)], torch.int32),
            prefill_context_lens=dev(p_ctx, torch.int32),
            prefill_block_tables=dev(p_tables, torch.int32),
            max_prefill_q_len=max(prefill_q_lens, default=0),
            max_prefill_context_len=max_p_ctx,
            decode_context_lens=dev(d_ctx, torch.int32),
            decode_block_tables=dev(d_tables, torch.int32),
            max_decode_context_len=max_d_ctx,
            store_token_idx=None if store_token_idx is None else dev(store_token_idx),
            store_slots=slots_on_device if store_token_idx is None else dev(store_slots),
            prefill_kv_blocks=dev(p_tables[:, : -(-max_p_ctx // block_size)].flatten()),
            make_prefill_seqs=make_prefill_seqs,
            make_decode_groups=partial(_decode_groups, decode_context_lens, d_tables, block_size, dev),
        )

    @classmethod
    def decode_over(
        cls, slot_mapping: Tensor, block_size: int, context_lens: Tensor, block_tables: Tensor, max_context_len: int
    ) -> "PagedAttentionMeta":
        """A decode-only meta over fixed device buffers whose contents change from step to step but whose launches
        do not (a CUDA graph's): one token per sequence, `max_context_len` the longest context any step may hold
        (it sizes the split-decode launch). The caller fills the buffers; a padding row has slot -1 and a context of
        1 over any block. Only the Triton ops read it (the torch path's fields raise).
        slot_mapping: [D] int64 · context_lens: [D] int32 · block_tables: [D, max_blocks] int32"""
        num_seqs = slot_mapping.shape[0]
        if context_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
            raise ValueError(f"{num_seqs} slots, {context_lens.shape[0]} context lengths, {len(block_tables)} tables")
        if block_tables.shape[1] * block_size < max_context_len:
            raise ValueError(f"{block_tables.shape[1]} blocks of {block_size} hold fewer than {max_context_len} keys")
        none = torch.zeros(0, dtype=torch.int32, device=slot_mapping.device)  # [0]: no prefill

        def no_torch_path() -> list[DecodeGroup]:
            raise RuntimeError("a decode_over meta is for the Triton kernels only")

        return cls(
            slot_mapping=slot_mapping,
            block_size=block_size,
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=slot_mapping.device),
            prefill_context_lens=none,
            prefill_block_tables=none.view(0, 0),
            max_prefill_q_len=0,
            max_prefill_context_len=0,
            decode_context_lens=context_lens,
            decode_block_tables=block_tables,
            max_decode_context_len=max_context_len,
            store_token_idx=None,
            store_slots=slot_mapping,
            prefill_kv_blocks=none.long(),
            make_prefill_seqs=_no_prefill_seqs,
            make_decode_groups=no_torch_path,
        )


def _store_indices(slot_mapping: Tensor) -> tuple[Tensor | None, Tensor]:
    """(tokens with slot >= 0, their slots); None for the tokens when all are stored."""
    stored = slot_mapping >= 0  # [T]
    if bool(stored.all()):
        return None, slot_mapping
    token_idx = stored.nonzero().squeeze(1)  # [S]
    return token_idx, slot_mapping[token_idx]


def _no_prefill_seqs() -> None:
    return None


def _prefill_seqs(q_lens: list[int], context_lens: list[int], tables: Tensor, block_size: int, dev) -> list[PrefillSeq]:
    seqs, start = [], 0
    for i, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        mask = None
        if q_len != ctx:  # query i sits at position ctx - q_len + i
            mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
        blocks = tables[i, : -(-ctx // block_size)]
        seqs.append(PrefillSeq(start, q_len, ctx, dev(blocks), None if mask is None else dev(mask, torch.bool)))
        start += q_len
    return seqs


def _check_seqs(
    block_size: int, q_lens: list[int], context_lens: list[int], block_tables: list[list[int]], with_q=False
) -> None:
    if not len(q_lens) == len(context_lens) == len(block_tables):
        raise ValueError("per-sequence lists differ in length")
    for q_len, ctx, table in zip(q_lens, context_lens, block_tables, strict=True):
        if with_q and not 1 <= q_len <= ctx:
            raise ValueError(f"prefill needs 1 <= q_len <= context_len, got q_len={q_len}, context_len={ctx}")
        if ctx < 1 or len(table) * block_size < ctx:
            raise ValueError(f"context_len {ctx} does not fit {len(table)} blocks of {block_size}")


def _pad_tables(tables: list[list[int]]) -> Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int64).view(len(tables), width)


def _decode_groups(context_lens: list[int], tables: Tensor, block_size: int, dev) -> list[DecodeGroup]:
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    groups, start = [], 0
    while start < len(order):
        end = start + 1  # grow while the group's padded keys stay under budget (sorted: the last is longest)
        while end < len(order) and (end + 1 - start) * _padded(context_lens[order[end]], block_size) <= (
            DECODE_GROUP_KEYS
        ):
            end += 1
        rows = order[start:end]
        num_blocks = -(-context_lens[rows[-1]] // block_size)
        lens = torch.tensor([context_lens[r] for r in rows])
        groups.append(
            DecodeGroup(
                rows=dev(rows),
                kv_blocks=dev(tables[rows, :num_blocks].flatten()),
                mask=dev(_key_mask(lens, int(lens[-1]), block_size)[:, None, None, :], torch.bool),
            )
        )
        start = end
    return groups


def _padded(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size) * block_size


def _key_mask(context_lens: Tensor, max_context_len: int, block_size: int) -> Tensor:
    """mask[s, j] = j < context_lens[s], over the keys gathered from whole blocks."""
    num_keys = -(-max_context_len // block_size) * block_size
    key_pos = torch.arange(num_keys, device=context_lens.device)  # [num_keys]
    return key_pos[None, :] < context_lens[:, None]  # [S, num_keys]
