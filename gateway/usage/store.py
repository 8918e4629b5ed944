"""The `UsageStore` interface: counts each served request once, and moves the counts into the registry's rollups."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.usage.record import UsageRecord
from registry.usage import UsageCounts, UsageKey, UsageRollups

DEDUPE_TTL_S = 24 * 3600  # how long a request_id is remembered, so a replay of it is not counted again

T = TypeVar("T")


class UsageStore(ABC):
    @abstractmethod
    async def record(self, request_id: str, record: UsageRecord) -> None:
        """Counts a finished or aborted request; a second call with the same request_id counts nothing.
        Never raises for an unreachable Redis: the record waits in a local buffer until Redis is back."""

    @abstractmethod
    async def flush(self, rollups: UsageRollups, final: bool = False) -> dict[UsageKey, UsageCounts]:
        """Adds the counted but unflushed counters to `rollups` exactly once, and returns them.
        On a database error the counters stay pending (and the error is raised). `final` (at shutdown) also
        writes what this process could not hand to Redis straight to the database."""

    @abstractmethod
    async def pending(self) -> dict[UsageKey, UsageCounts]:
        """Counted but not yet flushed to the database."""

    @abstractmethod
    async def read_with_pending(self, read: Callable[[], Awaitable[T]]) -> tuple[T, dict[UsageKey, UsageCounts]]:
        """`await read()` (of the rollups) and `pending()` as of one moment: no flush (of any process) commits
        between the two reads, so a report that adds them up counts every flushed counter once, never twice nor not
        at all."""

    async def close(self) -> None:
        """Releases connections; call `flush(..., final=True)` first (UsageFlusher.close does)."""
        return None


def make_usage_store(redis_url: str | None, key_prefix: str = "loraplex:") -> UsageStore:
    """Redis when a URL is given (needed for several gateway processes), in process otherwise."""
    if redis_url:
        from gateway.usage.redis_store import RedisUsageStore

        return RedisUsageStore(redis_url, key_prefix=key_prefix)
    from gateway.usage.memory_store import MemoryUsageStore

    return MemoryUsageStore()
