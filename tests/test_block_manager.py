"""BlockManager and Scheduler units: no model, no tokenizer."""

from __future__ import annotations

import hashlib
import struct

from adapters.ref import LoRARequest
from engine.block_manager import BlockManager, first_link, next_link
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup

_arrivals = iter(range(10**6))


def make_seq(
    token_ids: list[int], adapter_digest: str | None = None, lora: LoRARequest | None = None, n: int = 1
) -> Sequence:
    """A request's first sequence (its group holds the request: adapter, n samples)."""
    arrival = next(_arrivals)
    request = EngineRequest(f"r{arrival}", token_ids, SamplingParams(n=n), lora=lora, adapter_digest=adapter_digest)
    group = SequenceGroup(request, arrival)
    seq = Sequence(group, 0, list(token_ids), detokenizer=None)
    group.seqs.append(seq)
    return seq


def allocate_all(bm: BlockManager, seq: Sequence) -> int:
    cached = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    assert bm.can_allocate(cached, num_new)
    bm.allocate(seq, cached, num_new)
    bm.commit(seq, num_new)
    return len(cached)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    allocate_all(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and all(rc == 0 for rc in bm.ref_counts)


def test_prefix_hits_full_blocks_only_and_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)))
    allocate_all(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)  # freed blocks keep their cached content
    assert a_blocks[2] not in bm.cached_blocks.values()  # the partial block was never cached
    b = make_seq([*range(8), 99, 98, 97])
    assert allocate_all(bm, b) == 2  # blocks [0..3] and [4..7]
    assert b.block_table[:2] == a_blocks[:2] and b.num_computed_tokens == 11
    exact = make_seq(list(range(8)))  # fully cached prompt: the last block is recomputed for its logits
    assert len(bm.find_cached_prefix(exact)) == 1


def test_adapter_digest_separates_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    allocate_all(bm, make_seq(list(range(12)), adapter_digest=None))
    assert bm.find_cached_prefix(make_seq(list(range(12)), adapter_digest="sha256:a")) == []
    assert len(bm.find_cached_prefix(make_seq(list(range(12)), adapter_digest=None))) == 2


def test_cached_free_blocks_are_evicted_oldest_first_when_space_is_needed():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(8)))
    allocate_all(bm, a)
    bm.free(a)
    big = make_seq(list(range(100, 116)))  # needs all 4 blocks: evicts a's cached blocks
    allocate_all(bm, big)
    assert bm.find_cached_prefix(make_seq(list(range(9)))) == []
    bm.free(big)
    assert bm.num_free_blocks == 4


def test_freed_blocks_that_cache_nothing_are_reused_before_untouched_ones():
    """Without prefix caching a freed sequence's blocks are the next ones taken, so the engine keeps writing the
    pages it has touched; with it, the blocks holding a cached prefix stay findable and a partial block goes first."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    allocate_all(bm, a)
    a_blocks = set(a.block_table)
    bm.free(a)
    b = make_seq(list(range(100, 110)))
    allocate_all(bm, b)
    assert set(b.block_table) == a_blocks
    cached = BlockManager(num_blocks=64, block_size=4)
    a = make_seq(list(range(10)))
    allocate_all(cached, a)
    full, partial = a.block_table[:2], a.block_table[2]
    cached.free(a)
    c = make_seq([50, 51, 52])
    allocate_all(cached, c)
    assert c.block_table == [partial]
    assert cached.find_cached_prefix(make_seq(list(range(9)))) == full
    # two sequences that computed one prefix side by side: the copy no lookup can find is reused first
    twin, copy = make_seq(list(range(200, 208))), make_seq(list(range(200, 208)))
    for seq in (twin, copy):
        cached.allocate(seq, [], 8)
    for seq in (twin, copy):
        cached.commit(seq, 8)
    copy_blocks = list(copy.block_table)
    assert set(copy_blocks).isdisjoint(twin.block_table)
    cached.free(copy)
    d = make_seq([60, 61, 62])
    allocate_all(cached, d)
    assert d.block_table == copy_blocks[:1]
    assert cached.find_cached_prefix(make_seq([*range(200, 208), 0])) == twin.block_table


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(list(range(10)))  # 2 full blocks + 2 tokens in the third
    allocate_all(bm, parent)
    child = make_seq(list(range(10)))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 2]
    parent.token_ids.append(1)
    copies = bm.append_slots(parent, 1)
    assert len(copies) == 1 and copies[0][0] == child.block_table[2]
    assert parent.block_table[:2] == child.block_table[:2] and parent.block_table[2] != child.block_table[2]
    child.token_ids.append(2)
    assert bm.append_slots(child, 1) == []  # now its own: written in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16


def test_append_slots_refuses_when_the_pool_is_dry():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(8)))
    allocate_all(bm, seq)
    seq.token_ids.append(0)
    assert bm.append_slots(seq, 1) is None
    assert len(seq.block_table) == 2


def test_blocks_enter_the_prefix_cache_only_once_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(9)))
    bm.allocate(seq, [], 9)  # scheduled, then preempted before its step ran: its KV was never written
    bm.free(seq)
    assert bm.find_cached_prefix(make_seq(list(range(9)))) == []
    seq = make_seq(list(range(9)))
    bm.allocate(seq, [], 9)
    bm.commit(seq, 9)  # the step ran
    assert bm.find_cached_prefix(make_seq(list(range(9)))) == seq.block_table[:2]


def test_block_keys_are_a_sha256_chain_over_packed_token_ids_and_the_adapter_digest():
    parent = first_link("sha256:a")
    assert parent == hashlib.sha256(b"loraplex-prefix\0adapter:sha256:a").digest()
    assert next_link(parent, [1, -2, 3]) == hashlib.sha256(parent + struct.pack("<3q", 1, -2, 3)).digest()
    keys = {next_link(first_link(d), t) for d in (None, "sha256:a", "sha256:b") for t in ([1, 2], [2, 1], [1, 3])}
    assert len(keys) == 9  # other tokens or another adapter: never one key
    assert next_link(first_link("sha256:a"), [1, 2]) == next_link(first_link("sha256:a"), [1, 2])


def test_a_python_hash_collision_no_longer_shares_kv():
    assert hash(-1) == hash(-2)  # CPython: under the old hash((parent, tokens)) chain these blocks had one key
    bm = BlockManager(num_blocks=16, block_size=4)
    allocate_all(bm, make_seq([5, 6, 7, -1, 8], adapter_digest="sha256:a"))
    assert bm.find_cached_prefix(make_seq([5, 6, 7, -2, 8], adapter_digest="sha256:a")) == []
    assert bm.find_cached_prefix(make_seq([5, 6, 7, -1, 9], adapter_digest="sha256:b")) == []
    assert len(bm.find_cached_prefix(make_seq([5, 6, 7, -1, 9], adapter_digest="sha256:a"))) == 1  # same prefix: a hit
