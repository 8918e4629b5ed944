"""Usage reports: the registry's rollups by tenant, adapter and day range, plus the counters not flushed yet, with
totals."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.usage.record import add_counts
from registry.usage import UsageCounts, UsageKey, UsageRollups


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant: str
    adapter: str
    day: dt.date
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class UsageReport:
    rows: list[UsageRow]  # by day, tenant, adapter
    totals: UsageCounts = field(default_factory=UsageCounts)


def _selected(key: UsageKey, tenant, adapter, from_day, to_day) -> bool:
    return (
        (tenant is None or key.tenant == tenant)
        and (adapter is None or key.adapter == adapter)
        and (from_day is None or key.day >= from_day)
        and (to_day is None or key.day <= to_day)
    )


async def usage_report(
    rollups: UsageRollups,
    tenant: str | None = None,
    adapter: str | None = None,
    from_day: dt.date | None = None,
    to_day: dt.date | None = None,
    pending: Mapping[UsageKey, UsageCounts] | None = None,
) -> UsageReport:
    """Usage per (tenant, adapter, day) with `from_day <= day <= to_day`; None selects all. `pending` (a
    store's `pending()`) adds the counters not flushed yet."""
    counters = await rollups.read(tenant, adapter, from_day, to_day)
    for key, counts in (pending or {}).items():
        if _selected(key, tenant, adapter, from_day, to_day):
            add_counts(counters, key, counts)
    report = UsageReport(rows=[])
    for key in sorted(counters, key=lambda k: (k.day, k.tenant, k.adapter)):
        report.rows.append(UsageRow(key.tenant, key.adapter, key.day, **counters[key].as_dict()))
        report.totals.add(counters[key])
    return report
