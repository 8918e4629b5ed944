"""Adds usage counters to the registry's `usage_rollups` table: one upsert that works on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.usage.record import COUNTERS, UsageCounts, UsageKey
from registry.models import UsageRollup

_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
_ROWS_PER_STATEMENT = 500


async def add_to_rollups(session: AsyncSession, counters: Mapping[UsageKey, UsageCounts]) -> None:
    """Adds `counters` to their rows (creating missing ones) inside the caller's transaction.

    `INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n` is atomic per row, so concurrent flushes from
    several gateways add up; rows go in key order so two transactions never lock them in opposite orders."""
    insert = _INSERTS[session.get_bind().dialect.name]
    rows = [{"tenant": k.tenant, "adapter": k.adapter, "day": k.day, **counters[k].as_dict()} for k in sorted(counters)]
    for start in range(0, len(rows), _ROWS_PER_STATEMENT):
        statement = insert(UsageRollup).values(rows[start : start + _ROWS_PER_STATEMENT])
        statement = statement.on_conflict_do_update(
            index_elements=["tenant", "adapter", "day"],
            set_={name: getattr(UsageRollup, name) + statement.excluded[name] for name in COUNTERS},
        )
        await session.execute(statement)


async def write_rollups(sessionmaker: async_sessionmaker, counters: Mapping[UsageKey, UsageCounts]) -> None:
    """Adds `counters` to `usage_rollups` in one transaction of its own."""
    if counters:
        async with sessionmaker() as session, session.begin():
            await add_to_rollups(session, counters)
