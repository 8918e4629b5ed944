"""A gateway's usage flush that dies at a chosen moment (test-only).

`python -m tests.usage_crash REDIS_URL PREFIX DB_URL TENANT MOMENT` records one request's usage, flushes it, and
ends the process with os._exit (no cleanup, no give-back, its database connection dropped) at MOMENT:

  before-commit  its transaction written but not committed, its flush in `committing`
  after-commit   its transaction committed, before its last word to Redis
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys

from gateway.usage import UsageRecord
from gateway.usage.redis_store import RedisUsageStore
from registry.db import create_engine, sessionmaker
from registry.usage import UsageRollups

DIED = 17  # the exit status of a process that died where it was told to


def crash_record(tenant: str) -> UsageRecord:
    """The usage the dying flush records and flushes."""
    return UsageRecord(tenant, "sql", 8, 4, day=dt.date(2026, 3, 10))


class RollupsThatDieBeforeCommit(UsageRollups):
    async def add(self, counters, commit_if=None, flush_id=None):
        async def then_die() -> bool:
            if await commit_if():
                os._exit(DIED)
            return False

        return await super().add(counters, commit_if=then_die, flush_id=flush_id)


async def main(redis_url: str, prefix: str, db_url: str, tenant: str, moment: str) -> None:
    store = RedisUsageStore(redis_url, key_prefix=prefix)
    sessions = sessionmaker(create_engine(db_url))
    rollups = RollupsThatDieBeforeCommit(sessions) if moment == "before-commit" else UsageRollups(sessions)
    if moment == "after-commit":

        async def die(*args, **kwargs):
            os._exit(DIED)

        store._committed = die
    await store.record("crash-1", crash_record(tenant))
    await store.flush(rollups)
    raise SystemExit(f"the flush of {moment} did not die")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
