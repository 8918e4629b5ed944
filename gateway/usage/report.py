"""Usage reports: the registry's rollups by tenant, adapter and day range, plus the counters not flushed yet, with
totals."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from gateway.usage.record import add_counts
from gateway.usage.store import UsageStore
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
    store: UsageStore | None = None,
) -> UsageReport:
    """Usage per (tenant, adapter, day) with `from_day <= day <= to_day`; None selects all. `store` adds the
    counters it holds that are not flushed yet, read with the rollups as of one moment."""

    async def read_rollups() -> dict[UsageKey, UsageCounts]:
        return await rollups.read(tenant, adapter, from_day, to_day)

    counters, pending = await store.read_with_pending(read_rollups) if store is not None else (await read_rollups(), {})
    for key, counts in pending.items():
        if _selected(key, tenant, adapter, from_day, to_day):
            add_counts(counters, key, counts)
    report = UsageReport(rows=[])
    for key in sorted(counters, key=lambda k: (k.day, k.tenant, k.adapter)):
        report.rows.append(UsageRow(key.tenant, key.adapter, key.day, **counters[key].as_dict()))
        report.totals.add(counters[key])
    return report
