"""Scheduler units (no model): budgets, decode-first order, chunked prefill, preemption of the newest."""

from __future__ import annotations

from types import SimpleNamespace

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from tests.test_block_manager import make_seq


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_step(scheduler: Scheduler, sample_token: int = 7):
    """What the engine does around the model: count computed tokens, append one token to sampling seqs."""
    batch = scheduler.schedule()
    sampling = batch.sampling_seqs()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        scheduler.block_manager.commit(seq, n)
    for seq in sampling:
        seq.token_ids.append(sample_token)
    return batch


def test_token_budget_chunks_long_prompts_and_respects_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    seqs = [make_seq(list(range(40))), make_seq(list(range(100, 105))), make_seq(list(range(200, 205)))]
    for seq in seqs:
        scheduler.add(seq)
    batch = run_step(scheduler)
    assert batch.seqs == [seqs[0]] and batch.num_new_tokens == [16]  # a chunk of the long prompt
    assert batch.sampling_seqs() == []
    run_step(scheduler)  # the budget goes to the running prompt first
    assert [s.num_computed_tokens for s in seqs[:2]] == [32, 0]
    batch = run_step(scheduler)  # its last 8 tokens, then the next prompt joins
    assert batch.num_new_tokens == [8, 5] and [s.num_output_tokens for s in seqs] == [1, 1, 0]
    assert len(scheduler.running) == 2 and seqs[2] in scheduler.waiting  # max_num_seqs = 2


def test_decodes_are_scheduled_before_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    short = make_seq(list(range(3)))
    scheduler.add(short)
    run_step(scheduler)  # short prefilled, now decoding
    long = make_seq(list(range(100)))
    scheduler.add(long)
    for _ in range(3):
        batch = run_step(scheduler)
        assert short in batch.seqs and batch.num_new_tokens[batch.seqs.index(short)] == 1
        assert batch.num_tokens <= 16
        assert batch.seqs[-1] is short  # prefill chunks first in the flat batch, decodes last


def test_dry_pool_preempts_the_newest_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    old, new = make_seq(list(range(7))), make_seq(list(range(7)))
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # 2 blocks each: the pool is full
    for _ in range(2):
        run_step(scheduler)
    assert scheduler.num_preemptions >= 1
    assert old in scheduler.running and scheduler.waiting[0] is new
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert old.num_output_tokens > new.num_output_tokens
