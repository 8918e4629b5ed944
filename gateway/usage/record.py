"""What one served request adds to usage: `UsageRecord`, and the counters it adds to per (tenant, adapter, day)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields

COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


def utc_today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


@dataclass(frozen=True, slots=True, order=True)
class UsageKey:
    """One row of `usage_rollups`: "" stands for no tenant (auth off) and for the base model (no adapter)."""

    tenant: str
    adapter: str
    day: dt.date


@dataclass(slots=True)
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (a part of prompt_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: UsageCounts) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
