"""BlockManager: the KV pool's free list, reference counts, prefix cache and every sequence's block table.

Prefix caching: a full block is registered under a hash chain `h_j = sha256(h_{j-1} || tokens_j)` (token ids packed
as little-endian int64) whose first link `h_0` hashes the sequence's adapter key (its content digest), so KV
computed under one adapter (or none) never serves another. A cryptographic hash, not Python's `hash()`: two
different prefixes sharing a key would silently serve one request another's KV. A freed block keeps its hash and
content until it is reused: such blocks wait at the back of the free queue, oldest-freed first, and a prefix hit
takes a block back out of it. A freed block that holds nothing to find again (prefix caching off, a partial block, a
duplicate of a prefix another block already caches) goes to the front and is taken first, so the engine keeps
writing pages it has already touched rather than walking the whole pool: on CPU each first touch of a page is a
fault (~2-10 us on a VM), and a 1 GiB pool walked once by W1's 64 requests took 50k of them per run.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


def first_link(adapter_digest: str | None) -> bytes:
    """h_0 of a chain: the adapter's content digest, or a distinct tag for the base model alone."""
    tag = b"base" if adapter_digest is None else b"adapter:" + adapter_digest.encode()
    return hashlib.sha256(b"loraplex-prefix\0" + tag).digest()


def next_link(parent: bytes, token_ids: list[int]) -> bytes:
    """h_j from h_{j-1} and block j's token ids."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block_id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------
    def _chain(self, seq: Sequence, upto_blocks: int) -> list[bytes]:
        """Hashes of the seq's first `upto_blocks` full blocks (reusing those already computed)."""
        hashes = seq.block_hashes[:upto_blocks]
        parent = hashes[-1] if hashes else first_link(seq.adapter_digest)
        bs = self.block_size
        for j in range(len(hashes), upto_blocks):
            parent = next_link(parent, seq.token_ids[j * bs : (j + 1) * bs])
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of the seq. At least one token is always left to
        compute, so the step that admits the sequence still produces its logits; none while its request waits for
        prompt logprobs (its blocks are still registered for others once computed)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        seq.block_hashes = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        if seq.group.wants_prompt_logprobs:  # every prompt token's logits are needed: none comes from the cache
            return hits
        for h in seq.block_hashes:
            block_id = self.cached_blocks.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Records that the step computed `num_new_tokens` more of the seq's tokens, and registers the blocks
        that became full in the prefix cache. Only computed blocks are registered: a block allocated for a
        step that never ran (its seq was preempted first) must never be found by a prefix lookup."""
        first = seq.num_computed_tokens // self.block_size
        seq.num_computed_tokens += num_new_tokens
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= first:
            return
        seq.block_hashes = self._chain(seq, num_full)
        for j in range(first, num_full):
            block_id, h = seq.block_table[j], seq.block_hashes[j]
            if self.block_hash[block_id] is None:
                self.block_hash[block_id] = h
                self.cached_blocks.setdefault(h, block_id)

    # ---- allocation ---------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:  # evict its cached content
            if self.cached_blocks.get(h) == block_id:
                del self.cached_blocks[h]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def can_allocate(self, cached: list[int], num_new_tokens: int) -> bool:
        num_cached_tokens = len(cached) * self.block_size
        new_blocks = self.blocks_needed(num_cached_tokens + num_new_tokens) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached but free: leave the free queue
        return new_blocks + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Gives a sequence without blocks its cached prefix plus room for `num_new_tokens` more tokens."""
        assert not seq.block_table, f"{seq} already has blocks"
        for block_id in cached:
            self._touch(block_id)
        num_cached_tokens = len(cached) * self.block_size
        new_blocks = self.blocks_needed(num_cached_tokens + num_new_tokens) - len(cached)
        seq.block_table = cached + [self._take_free_block() for _ in range(new_blocks)]
        seq.num_computed_tokens = num_cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Room for `num_new_tokens` more tokens of a running sequence. Returns the (src, dst) block copies
        that copy-on-write needs before the step runs, or None when the pool is too small right now."""
        total = seq.num_computed_tokens + num_new_tokens
        new_blocks = self.blocks_needed(total) - len(seq.block_table)
        partial = seq.num_computed_tokens % self.block_size != 0
        last = seq.block_table[seq.num_computed_tokens // self.block_size] if partial else None
        cow = last is not None and self.ref_counts[last] > 1
        if new_blocks + cow > self.num_free_blocks:
            return None
        copies = []
        if cow:
            dst = self._take_free_block()
            self.ref_counts[last] -= 1
            seq.block_table[seq.num_computed_tokens // self.block_size] = dst
            copies.append((last, dst))
        seq.block_table.extend(self._take_free_block() for _ in range(new_blocks))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes into a shared block copy it first."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def free(self, seq: Sequence) -> None:
        """Releases the seq's blocks, tail first, so a prefix's head stays cached longest."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if self.cached_blocks.get(self.block_hash[block_id]) != block_id:  # no lookup finds it: reused first
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
