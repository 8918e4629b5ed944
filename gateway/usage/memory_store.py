"""`MemoryUsageStore`: usage counters in this process, for a single gateway without Redis."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gateway.usage.record import UsageRecord, add_counts, merge_counters
from gateway.usage.store import DEDUPE_TTL_S, T, UsageStore
from registry.usage import UsageCounts, UsageKey, UsageRollups


class MemoryUsageStore(UsageStore):
    def __init__(self, dedupe_ttl_s: float = DEDUPE_TTL_S):
        self.dedupe_ttl_s = dedupe_ttl_s
        self._counters: dict[UsageKey, UsageCounts] = {}
        self._seen: OrderedDict[str, float] = OrderedDict()  # request_id -> when it was recorded, oldest first
        self._moving = asyncio.Lock()  # held while a flush moves counters into the registry, and while a report reads

    async def record(self, request_id: str, record: UsageRecord) -> None:
        now = time.monotonic()
        while self._seen and next(iter(self._seen.values())) < now - self.dedupe_ttl_s:
            self._seen.popitem(last=False)
        if request_id in self._seen:
            return
        self._seen[request_id] = now
        add_counts(self._counters, record.key, record.counts)

    async def flush(self, rollups: UsageRollups, final: bool = False) -> dict[UsageKey, UsageCounts]:
        async with self._moving:
            flushing, self._counters = self._counters, {}  # no await in between: later records go to the next flush
            try:
                await rollups.add(flushing)
            except BaseException:
                self._counters = merge_counters(flushing, self._counters)
                raise
        return flushing

    async def pending(self) -> dict[UsageKey, UsageCounts]:
        return merge_counters(self._counters)

    async def read_with_pending(self, read: Callable[[], Awaitable[T]]) -> tuple[T, dict[UsageKey, UsageCounts]]:
        async with self._moving:
            return await read(), await self.pending()
