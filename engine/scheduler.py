"""Scheduler: decides, every step, which sequences run and how many tokens each computes.

Iteration-level continuous batching under two budgets (`max_num_seqs`, `max_num_batched_tokens`):
running sequences go first (decodes, then the next chunk of partly prefilled prompts), then waiting ones
join while blocks and budget last, in the order of the admission policy (engine/fairness.py: arrival order,
or fair across tenants by virtual token counters; every token handed out is charged to its tenant).
When the pool runs dry the newest running sequence is preempted by recompute: its blocks are freed (their
full blocks stay in the prefix cache) and it goes back to the head of the waiting queue. Running sequences
are always served oldest first, so none starves.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from adapters.cache import AdapterCache
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.fairness import make_policy
from engine.sequence import NO_ADAPTER, Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]  # prefills (q_len > 1) first, then decodes (q_len == 1)
    num_new_tokens: list[int]  # per seq, tokens computed this step
    num_prefills: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self) -> list[bool]:
        """Per seq: its every token is computed after this step, so it samples its next token."""
        return [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    def sampling_seqs(self) -> list[Sequence]:
        return [s for s, samples in zip(self.seqs, self.samples()) if samples]


ROW_WAIT_STEPS = 32  # how long younger seqs may keep joining resident adapters while an older one waits


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, adapter_cache: AdapterCache | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.adapter_cache = adapter_cache
        self.failed: list[tuple[Sequence, Exception]] = []  # adapter loads that failed; the engine ends them
        self._row_waiter: Sequence | None = None  # the oldest seq waiting for a free adapter row
        self._row_wait_steps = 0  # steps it has been waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by arrival
        self.num_preemptions = 0
        self.policy = make_policy(config.scheduling_policy)

    def add(self, seq: Sequence) -> None:
        self.policy.on_arrival(seq, self.waiting)
        self.waiting.append(seq)
        lora = seq.group.lora
        if lora is not None and not self.adapter_cache.is_resident(lora):
            seq.group.adapter_tier = "host" if self.adapter_cache.on_host(lora) else "disk"
            if self.adapter_cache.num_staged < self._prefetch_window:
                self.adapter_cache.prefetch(lora)  # a cold adapter starts loading now, beside the running batch

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running batch next to its parent (sharing its request's adapter row)."""
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _insert_running(self, seq: Sequence) -> None:
        keys = [(s.group.arrival, s.index) for s in self.running]
        self.running.insert(bisect.bisect(keys, (seq.group.arrival, seq.index)), seq)

    def release_adapter(self, group: SequenceGroup) -> None:
        """Releases the request's one pin on its adapter row (a no-op when it holds none)."""
        if group.adapter_idx != NO_ADAPTER:
            self.adapter_cache.release(group.adapter_idx)
            group.adapter_idx = NO_ADAPTER

    def _preempt(self, seq: Sequence) -> None:
        """Frees the seq's blocks; its request keeps its adapter row, so it resumes on the same adapter version."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        picked: dict[int, int] = {}  # seq_id -> num_new_tokens
        copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> its copy-on-write block copies
        preempted = 0
        # decodes before chunked prefills, each group oldest first
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.group.arrival))
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted below to make room for an older seq
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while (cp := self.block_manager.append_slots(seq, num_new)) is None:
                victim = self.running.pop()
                picked.pop(victim.seq_id, None)
                copies.pop(victim.seq_id, None)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if cp is None:
                continue
            copies[seq.seq_id] = cp
            picked[seq.seq_id] = num_new
            budget -= num_new
        for seq in self.running:
            if seq.seq_id in picked:
                self._charge(seq, picked[seq.seq_id])
        if not preempted:
            budget, waiter = self._admit(budget, picked)
            self._count_row_wait(waiter)
        if self.adapter_cache is not None:
            self._prefetch_adapters()
        return self._batch(picked, [c for cp in copies.values() for c in cp], preempted)

    def _admit(self, budget: int, picked: dict[int, int]) -> tuple[int, Sequence | None]:
        """Waiting seqs join oldest first while budget, seats and blocks last. A seq whose adapter is still
        loading is passed over (others run meanwhile). Once an older seq waits for a free adapter row,
        younger ones may not take rows before it; for ROW_WAIT_STEPS steps of its wait they may still join
        adapters already on a row, after that not even those, so the rows drain and the older seq cannot starve.
        A seq whose request already pins a row (it was preempted) needs no new one. Returns the budget left and
        the first seq that found every row pinned (None when none did)."""
        waiter: Sequence | None = None
        for seq in self.policy.order(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            group, pinned_now = seq.group, False
            if group.lora is not None and group.adapter_idx == NO_ADAPTER:
                lenient = self._row_wait_steps < ROW_WAIT_STEPS and self.adapter_cache.is_resident(group.lora)
                if waiter is not None and not lenient:
                    continue
                status = self._pin_adapter(seq)
                if status == "failed":
                    self.waiting.remove(seq)
                    continue
                if status != "ok":
                    if status == "no_row" and waiter is None:
                        waiter = seq
                    continue
                pinned_now = True
            cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(cached, num_new):
                if pinned_now:
                    self.release_adapter(group)
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, cached, num_new)
            if seq.group.num_cached_tokens is None:  # first admission: what the prefix cache saved
                seq.group.num_cached_tokens = seq.num_computed_tokens
                seq.group.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            self._charge(seq, num_new)
            picked[seq.seq_id] = num_new
            budget -= num_new
        return budget, waiter

    def _count_row_wait(self, waiter: Sequence | None) -> None:
        """Counts the steps of one wait for a row: it ends when the seq that began it holds a row (or is gone),
        so the next wait starts from zero; while it lasts, another seq blocked first does not restart it."""
        if waiter is None:
            self._row_waiter, self._row_wait_steps = None, 0
            return
        last = self._row_waiter
        if last is None or last.status is not SequenceStatus.WAITING or last.group.adapter_idx != NO_ADAPTER:
            self._row_waiter, self._row_wait_steps = waiter, 0
        self._row_wait_steps += 1

    def _charge(self, seq: Sequence, num_new: int) -> None:
        """Bills the tokens a seq computes this step to its tenant (prompt tokens as prefill, the rest as decode)."""
        prefill = max(0, min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens))
        if prefill:
            self.policy.charge(seq, prefill, prefill=True)
        if num_new > prefill:
            self.policy.charge(seq, num_new - prefill, prefill=False)

    def _prefetch_adapters(self) -> None:
        """Starts loading the adapters the queue will want next, oldest first, but only as many as host
        memory holds beside the device rows, so a prefetched adapter is not evicted before its turn."""
        cache, wanted, window = self.adapter_cache, set(), self._prefetch_window
        for seq in self.waiting:
            lora = seq.group.lora
            if lora is None or lora.key in wanted or cache.is_resident(lora):
                continue
            wanted.add(lora.key)
            cache.prefetch(lora)
            if len(wanted) >= window:
                break

    @property
    def _prefetch_window(self) -> int:
        """How many adapters may wait in host memory (loaded or loading) beside the device rows."""
        return max(1, self.adapter_cache.max_cpu_loras - self.adapter_cache.max_loras)

    def _pin_adapter(self, seq: Sequence) -> str:
        """Pins the adapter row of the seq's request: "ok", "loading", "no_row" (every row pinned) or "failed"."""
        group = seq.group
        try:
            row = self.adapter_cache.acquire(group.lora)
        except Exception as e:
            self.failed.append((seq, e))
            return "failed"
        if row is None:
            return "no_row" if self.adapter_cache.on_host(group.lora) else "loading"
        if group.adapter_tier is None:
            group.adapter_tier = "device"
        else:  # it had to come from host memory or disk: how long that held the request back
            group.adapter_load_s = time.monotonic() - group.arrival_time
        group.adapter_idx = row
        group.adapter_digest = self.adapter_cache.digest(group.lora)  # the prefix cache's key: content, not name
        return "ok"

    def _batch(self, picked: dict[int, int], copies: list[tuple[int, int]], preempted: int) -> ScheduledBatch:
        seqs = [s for s in self.running if s.seq_id in picked]
        prefills = [s for s in seqs if picked[s.seq_id] > 1]
        decodes = [s for s in seqs if picked[s.seq_id] == 1]
        ordered = prefills + decodes
        return ScheduledBatch(
            seqs=ordered,
            num_new_tokens=[picked[s.seq_id] for s in ordered],
            num_prefills=len(prefills),
            block_copies=copies,
            num_preempted=preempted,
        )

    def finish(self, seq: Sequence) -> None:
        """Removes a finished (or aborted) sequence from wherever it is and frees its blocks at once; the last
        one of its request also releases the request's adapter row."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        if seq.group.is_finished:
            self.release_adapter(seq.group)
