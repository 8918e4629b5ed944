"""What one served request adds to usage: `UsageRecord`, and adding up the counters it adds to per (tenant, adapter,
day) (`UsageKey` -> `UsageCounts`, the registry's row types)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from registry.usage import UsageCounts, UsageKey


def utc_today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished or aborted request: the tokens it was served, for a tenant and an adapter, on a UTC day."""

    tenant: str
    adapter: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    day: dt.date = field(default_factory=utc_today)

    @property
    def key(self) -> UsageKey:
        return UsageKey(self.tenant, self.adapter, self.day)

    @property
    def counts(self) -> UsageCounts:
        return UsageCounts(1, self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def add_counts(into: dict[UsageKey, UsageCounts], key: UsageKey, counts: UsageCounts) -> None:
    into.setdefault(key, UsageCounts()).add(counts)


def merge_counters(*counters: dict[UsageKey, UsageCounts]) -> dict[UsageKey, UsageCounts]:
    merged: dict[UsageKey, UsageCounts] = {}
    for mapping in counters:
        for key, counts in mapping.items():
            add_counts(merged, key, counts)
    return merged
