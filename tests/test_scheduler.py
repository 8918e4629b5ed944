"""Scheduler units (no model): budgets, decode-first order, chunked prefill, preemption of the newest; with an
adapter cache, at most max_loras adapters a step, no starvation, and one adapter pin per request."""

from __future__ import annotations

import time
from types import SimpleNamespace

from adapters.cache import AdapterCache
from engine.block_manager import BlockManager
from engine.scheduler import ROW_WAIT_STEPS, Scheduler
from engine.sequence import Sequence
from tests import test_adapter_cache
from tests.test_adapter_cache import make_cache
from tests.test_block_manager import make_seq

tiny_adapters, loaded = test_adapter_cache.tiny_adapters, test_adapter_cache.loaded  # fixtures shared with it


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    adapter_cache: AdapterCache | None = None,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = SimpleNamespace(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, scheduling_policy=scheduling_policy
    )
    return Scheduler(config, BlockManager(num_blocks, block_size), adapter_cache)


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


def finish_after(scheduler: Scheduler, num_output_tokens: int) -> None:
    for seq in list(scheduler.running):
        if seq.num_output_tokens >= num_output_tokens:
            scheduler.finish(seq)


def run_to_the_end(scheduler: Scheduler, max_steps: int = 400) -> None:
    """Steps until every request has 3 output tokens and is finished (a step with nothing to run waits for the
    loader thread), then checks that nothing is left held."""
    for _ in range(max_steps):
        finish_after(scheduler, 3)
        if not scheduler.has_unfinished:
            break
        if not run_step(scheduler).seqs:
            time.sleep(0.005)
    assert_idle(scheduler)


def assert_idle(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert not scheduler.has_unfinished and bm.num_free_blocks == bm.num_blocks
    assert scheduler.adapter_cache.num_pinned == 0


def test_never_more_than_max_loras_adapters_in_a_step_and_every_adapter_gets_its_turn(loaded):
    cache, loras = loaded  # 2 device rows, 4 adapters in host memory
    scheduler = make_scheduler(adapter_cache=cache, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(list(range(i, i + 6)), lora=loras[i % 4]) for i in range(12)]
    for seq in seqs:
        scheduler.add(seq)
    ran: set[str] = set()
    for _ in range(100):
        batch = run_step(scheduler)
        adapters = {seq.group.lora.adapter_id for seq in batch.seqs}
        assert len(adapters) <= 2 and len({seq.adapter_idx for seq in batch.seqs}) == len(adapters)
        ran |= adapters
        finish_after(scheduler, 3)
        if not scheduler.has_unfinished:
            break
    assert all(seq.is_finished and seq.num_output_tokens == 3 for seq in seqs)
    assert ran == {lora.adapter_id for lora in loras}
    assert_idle(scheduler)


def test_an_adapter_waiting_for_a_row_gets_one_while_requests_keep_coming_for_the_resident_one(tiny_adapters):
    spec, (a, b, *_) = tiny_adapters
    cache = make_cache(spec, max_loras=1, max_cpu_loras=2)
    cache.load(a)
    cache.load(b)
    scheduler = make_scheduler(adapter_cache=cache, max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(make_seq([1, 2, 3], lora=a))
    run_step(scheduler)  # a holds the only row
    waiting = make_seq([4, 5, 6], lora=b)
    scheduler.add(waiting)
    steps = 0
    while waiting not in run_step(scheduler).seqs and steps < 200:
        finish_after(scheduler, 3)
        scheduler.add(make_seq([7, 8], lora=a))  # each would extend a's hold on the row
        steps += 1
    assert waiting.adapter_idx == 0 and steps <= ROW_WAIT_STEPS + 4  # a's row drained, then b took it
    run_to_the_end(scheduler)  # and the queued requests for a run after b's
    cache.shutdown()


def test_each_wait_for_a_row_starts_its_own_count_of_lenient_steps(tiny_adapters):
    spec, (a, b, c, _) = tiny_adapters
    cache = make_cache(spec, max_loras=1, max_cpu_loras=3)
    for lora in (a, b, c):
        cache.load(lora)
    scheduler = make_scheduler(adapter_cache=cache, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_seq([1, 2, 3], lora=a)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(make_seq([4, 5, 6], lora=b))
    scheduler.add(make_seq([7, 8, 9], lora=c))
    for _ in range(ROW_WAIT_STEPS + 2):  # b's request waits out its lenient steps while a's request runs
        run_step(scheduler)
    scheduler.finish(first)
    batch = run_step(scheduler)  # b's request takes the row, c's begins its own wait
    assert {seq.group.lora.adapter_id for seq in batch.seqs} == {b.adapter_id}
    joiner = make_seq([10, 11], lora=b)
    scheduler.add(joiner)
    assert joiner in run_step(scheduler).seqs  # a younger request may join b's row: c has only begun to wait
    run_to_the_end(scheduler)


def test_arrivals_start_loading_only_as_many_adapters_as_host_memory_holds_beside_the_rows(tiny_adapters):
    spec, loras = tiny_adapters
    cache = make_cache(spec, max_loras=1, max_cpu_loras=2)  # one adapter may wait in host memory
    scheduler = make_scheduler(adapter_cache=cache, max_num_seqs=8, max_num_batched_tokens=64)
    for lora in loras:
        scheduler.add(make_seq([1, 2, 3], lora=lora))
    assert [cache.tier(lora) for lora in loras[1:]] == ["disk"] * (len(loras) - 1)
    run_to_the_end(scheduler, max_steps=2000)
    assert cache.stats.loads == len(loras) and cache.stats.failures == 0  # none read twice
    cache.shutdown()


def test_a_request_pins_its_adapter_row_once_for_all_its_samples(loaded):
    """The n samples forked when the prompt is prefilled share the request's one pin, also when the adapter
    was removed meanwhile (they never look it up again); the row is freed when the last sample ends."""
    cache, (a, *_) = loaded
    scheduler = make_scheduler(adapter_cache=cache)
    parent = make_seq(list(range(6)), lora=a, n=4)
    scheduler.add(parent)
    run_step(scheduler)  # prefilled, its first token sampled
    row = parent.adapter_idx
    assert cache.evict(a) is True  # deleted while the request runs: its row drains
    for index in range(1, 4):
        child = Sequence(parent.group, index, list(parent.token_ids), detokenizer=None)
        parent.group.seqs.append(child)
        scheduler.block_manager.fork(parent, child)
        scheduler.add_running(child)
    assert [seq.adapter_idx for seq in parent.group.seqs] == [row] * 4 and cache._rows.pins[row] == 1
    run_step(scheduler)  # the four samples decode on the one row
    for seq in parent.group.seqs[:3]:
        scheduler.finish(seq)
    assert cache._rows.pins[row] == 1  # the last sample still runs
    scheduler.finish(parent.group.seqs[3])
    assert cache.num_resident == 0  # the removed adapter's row is free at last
    assert_idle(scheduler)


def test_a_preempted_request_keeps_its_adapter_row_and_resumes_on_it(loaded):
    cache, (a, b, c, _) = loaded
    scheduler = make_scheduler(adapter_cache=cache, num_blocks=4, block_size=4, max_num_batched_tokens=64)
    old, new = make_seq(list(range(7)), lora=a), make_seq(list(range(7)), lora=b)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # 2 blocks each: the pool is full
    row_b = new.adapter_idx
    for _ in range(2):
        run_step(scheduler)
    assert scheduler.num_preemptions >= 1 and scheduler.waiting[0] is new and not new.block_table
    assert new.adapter_idx == row_b and cache._rows.pins[row_b] == 1  # still pinned while it waits
    third = make_seq([9, 9, 9], lora=c)
    scheduler.add(third)
    run_step(scheduler)
    assert third.adapter_idx == -1 and cache.tier(b) == "device"  # c cannot take b's row
    scheduler.finish(old)
    batch = run_step(scheduler)
    assert new in batch.seqs and new.adapter_idx == row_b  # resumed on the same row
    run_to_the_end(scheduler, max_steps=20)
