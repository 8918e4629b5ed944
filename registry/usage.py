"""UsageRollups: the `usage_rollups` table, tokens served per (tenant, adapter, day): adding counters to rows
(one upsert that works on SQLite and PostgreSQL) and reading rows back by tenant, adapter and day range; and the
`usage_flushes` table, each Redis flush's outcome, which settles a flush whose flusher died while committing.

`UsageKey` names a row and `UsageCounts` holds its counters; "" stands for no tenant (auth off) and for the base
model (no adapter).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields

from sqlalchemy import delete, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from registry.models import UsageFlush, UsageRollup

COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
_ROWS_PER_STATEMENT = 500
COMMITTED, ABANDONED = "committed", "abandoned"  # usage_flushes.outcome
FLUSH_LOCK_TIMEOUT_MS = 5000  # PostgreSQL: how long settling a flush waits for its flusher's open transaction


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


class UsageRollups:
    def __init__(self, sessions: async_sessionmaker):
        self.sessions = sessions

    async def add(
        self,
        counters: Mapping[UsageKey, UsageCounts],
        commit_if: Callable[[], Awaitable[bool]] | None = None,
        flush_id: str | None = None,
    ) -> bool:
        """Adds `counters` to their rows (creating missing ones) in one transaction; returns whether it committed.

        `flush_id`, when given, is recorded as committed in the same transaction (before the rows, so a `settle_flush`
        of it waits for this transaction); one already settled raises IntegrityError and adds nothing. `commit_if`,
        when given, is awaited after the rows are written and before the commit: a false answer rolls the
        transaction back (nothing is added), an exception too (and is raised)."""
        if not counters and commit_if is None and flush_id is None:
            return True
        async with self.sessions() as session:
            if flush_id is not None:
                session.add(UsageFlush(flush_id=flush_id, outcome=COMMITTED))
                await session.flush()
            await self._upsert(session, counters)
            if commit_if is not None and not await commit_if():
                await session.rollback()
                return False
            await session.commit()
        return True

    @staticmethod
    async def _upsert(session: AsyncSession, counters: Mapping[UsageKey, UsageCounts]) -> None:
        # INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n is atomic per row, so concurrent flushes from several
        # gateways add up; rows go in key order so two transactions never lock them in opposite orders.
        insert = _INSERTS[session.get_bind().dialect.name]
        rows = [
            {"tenant": k.tenant, "adapter": k.adapter, "day": k.day, **counters[k].as_dict()} for k in sorted(counters)
        ]
        for start in range(0, len(rows), _ROWS_PER_STATEMENT):
            statement = insert(UsageRollup).values(rows[start : start + _ROWS_PER_STATEMENT])
            statement = statement.on_conflict_do_update(
                index_elements=["tenant", "adapter", "day"],
                set_={name: getattr(UsageRollup, name) + statement.excluded[name] for name in COUNTERS},
            )
            await session.execute(statement)

    async def settle_flush(self, flush_id: str) -> str:
        """The outcome of a flush whose flusher stopped answering: COMMITTED if its transaction committed, else
        ABANDONED, recorded here so that transaction can no longer commit. Waits for that transaction while it is
        still open (the flush_id's row is locked; PostgreSQL gives up after FLUSH_LOCK_TIMEOUT_MS and raises)."""
        async with self.sessions() as session:
            dialect = session.get_bind().dialect.name
            if dialect == "postgresql":
                await session.execute(text(f"SET LOCAL lock_timeout = {FLUSH_LOCK_TIMEOUT_MS}"))
            insert = _INSERTS[dialect](UsageFlush).values(flush_id=flush_id, outcome=ABANDONED)
            await session.execute(insert.on_conflict_do_nothing())
            outcome = await session.scalar(select(UsageFlush.outcome).where(UsageFlush.flush_id == flush_id))
            await session.commit()
        return outcome

    async def forget_flushes(self, before: dt.datetime) -> int:
        """Deletes the outcomes of flushes recorded before `before` (no flush can still need them); returns how many."""
        async with self.sessions() as session:
            result = await session.execute(delete(UsageFlush).where(UsageFlush.created_at < before))
            await session.commit()
        return result.rowcount

    async def read(
        self,
        tenant: str | None = None,
        adapter: str | None = None,
        from_day: dt.date | None = None,
        to_day: dt.date | None = None,
    ) -> dict[UsageKey, UsageCounts]:
        """The rows with `from_day <= day <= to_day` of `tenant` and `adapter`; None selects all."""
        query = select(UsageRollup)
        if tenant is not None:
            query = query.where(UsageRollup.tenant == tenant)
        if adapter is not None:
            query = query.where(UsageRollup.adapter == adapter)
        if from_day is not None:
            query = query.where(UsageRollup.day >= from_day)
        if to_day is not None:
            query = query.where(UsageRollup.day <= to_day)
        async with self.sessions() as session:
            rows = (await session.scalars(query)).all()
        return {
            UsageKey(row.tenant, row.adapter, row.day): UsageCounts(*(getattr(row, name) for name in COUNTERS))
            for row in rows
        }
