"""Usage counting (invariant 4): once per request, in process and in a real Redis, flushed exactly once into the
registry on SQLite and a real PostgreSQL, across Redis outages, concurrent flushers and client disconnects."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import redis.exceptions
import sqlalchemy.exc
from sqlalchemy import select, update

from gateway.usage import UsageCounts, UsageFlusher, UsageKey, UsageRecord, usage_report
from gateway.usage.memory_store import MemoryUsageStore
from gateway.usage.record import merge_counters
from gateway.usage.redis_store import RedisUsageStore
from registry.db import create_engine, sessionmaker, upgrade
from registry.models import UsageFlush
from registry.usage import ABANDONED, UsageRollups
from tests import usage_crash
from tests.services import RedisProcess

DAY = dt.date(2026, 3, 10)
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def migrated_postgres_url(postgres_url):
    upgrade(postgres_url)
    return postgres_url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A migrated registry database; tests keep apart by using tenant names of their own."""
    if request.param == "postgresql":
        return request.getfixturevalue("migrated_postgres_url")
    url = f"sqlite:///{tmp_path}/registry.db"
    upgrade(url)
    return url


@pytest.fixture(params=["memory", "redis"])
def new_store(request):
    """Makes stores of one kind; Redis stores made by one test share that test's own key prefix."""
    if request.param == "memory":
        return MemoryUsageStore
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_key_prefix")
    return lambda **options: RedisUsageStore(url, key_prefix=prefix, **options)


@pytest.fixture
def tenant():
    return f"tenant-{uuid.uuid4().hex[:8]}"


class Database:
    def __init__(self, url: str):
        self.engine = create_engine(url)
        self.rollups = UsageRollups(sessionmaker(self.engine))

    async def totals(self, tenant: str) -> dict[tuple[str, dt.date], dict[str, int]]:
        report = await usage_report(self.rollups, tenant=tenant)
        return {(row.adapter, row.day): _counts(row) for row in report.rows}

    async def close(self) -> None:
        await self.engine.dispose()


def _counts(row) -> dict[str, int]:
    return {name: getattr(row, name) for name in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")}


def usage(tenant: str, prompt: int, completion: int, cached: int = 0, adapter: str = "sql", day=DAY) -> UsageRecord:
    return UsageRecord(tenant, adapter, prompt, completion, cached, day=day)


def expected(*records: UsageRecord) -> dict[tuple[str, dt.date], dict[str, int]]:
    sums: dict[tuple[str, dt.date], UsageCounts] = {}
    for record in records:
        sums.setdefault((record.adapter, record.day), UsageCounts()).add(record.counts)
    return {key: counts.as_dict() for key, counts in sums.items()}


def pending_of(pending: dict[UsageKey, UsageCounts], tenant: str) -> dict[tuple[str, dt.date], dict[str, int]]:
    return {(k.adapter, k.day): c.as_dict() for k, c in pending.items() if k.tenant == tenant}


def test_each_request_is_counted_once(new_store, tenant):
    async def main():
        store = new_store()
        records = [usage(tenant, 10, 5, 2), usage(tenant, 7, 3), usage(tenant, 4, 1, adapter="")]
        records.append(usage(tenant, 1, 1, day=DAY + dt.timedelta(days=1)))
        for i, record in enumerate(records):
            await store.record(f"req-{i}", record)
        await store.record("req-0", usage(tenant, 10, 5, 2))  # a replay of a request already counted
        await store.record("req-1", usage(tenant, 999, 999))  # the same request id never counts again
        pending = pending_of(await store.pending(), tenant)
        await store.close()
        return records, pending

    records, pending = asyncio.run(main())
    assert pending == expected(*records)
    assert pending[("sql", DAY)] == {"requests": 2, "prompt_tokens": 17, "completion_tokens": 8, "cached_tokens": 2}


def test_flush_adds_to_existing_rows(new_store, db_url, tenant):
    async def main():
        db, store = Database(db_url), new_store()
        first = [usage(tenant, 10, 5, 1), usage(tenant, 3, 2, adapter="")]
        for i, record in enumerate(first):
            await store.record(f"a{i}", record)
        flushed = await store.flush(db.rollups)
        after_first = await db.totals(tenant)
        second = [usage(tenant, 20, 10, 4), usage(tenant, 1, 1)]
        for i, record in enumerate(second):
            await store.record(f"b{i}", record)
        await store.record("a0", first[0])  # a replay after its flush still counts nothing
        await store.flush(db.rollups)
        await store.flush(db.rollups)  # nothing left: adds nothing
        totals, pending = await db.totals(tenant), pending_of(await store.pending(), tenant)
        await store.close()
        await db.close()
        return first, second, flushed, after_first, totals, pending

    first, second, flushed, after_first, totals, pending = asyncio.run(main())
    assert after_first == expected(*first)
    assert {(k.adapter, k.day): c.as_dict() for k, c in flushed.items()} == expected(*first)
    assert totals == expected(*first, *second)
    assert totals[("sql", DAY)] == {"requests": 3, "prompt_tokens": 31, "completion_tokens": 16, "cached_tokens": 5}
    assert pending == {}


def test_failed_flush_keeps_counters_pending(new_store, tmp_path, tenant):
    good_url, broken_url = f"sqlite:///{tmp_path}/good.db", f"sqlite:///{tmp_path}/unmigrated.db"
    upgrade(good_url)

    async def main():
        good, broken, store = Database(good_url), Database(broken_url), new_store()
        await store.record("r1", usage(tenant, 5, 5))
        with pytest.raises(Exception, match="no such table: usage_"):
            await store.flush(broken.rollups)
        pending = pending_of(await store.pending(), tenant)
        await store.record("r2", usage(tenant, 1, 2))
        await store.flush(good.rollups)
        totals = await good.totals(tenant)
        await store.close()
        await good.close()
        await broken.close()
        return pending, totals

    pending, totals = asyncio.run(main())
    assert pending == expected(usage(tenant, 5, 5))
    assert totals == expected(usage(tenant, 5, 5), usage(tenant, 1, 2))


def test_two_gateways_on_one_redis_flush_exactly_once(redis_url, redis_key_prefix, db_url, tenant):
    async def main():
        db = Database(db_url)
        stores = [RedisUsageStore(redis_url, key_prefix=redis_key_prefix) for _ in range(2)]
        records = [usage(tenant, i, 2 * i, i % 3, adapter=f"a{i % 3}") for i in range(60)]

        async def gateway(index: int):
            store = stores[index]
            for i, record in enumerate(records):
                if i % 2 == index or i % 5 == 0:  # every fifth request is replayed by the other gateway too
                    await store.record(f"req-{i}", record)
                if i % 7 == 0:
                    await store.flush(db.rollups)

        await asyncio.gather(gateway(0), gateway(1))
        await asyncio.gather(*(store.flush(db.rollups) for store in stores))
        totals = await db.totals(tenant)
        for store in stores:
            await store.close()
        await db.close()
        return records, totals

    records, totals = asyncio.run(main())
    assert totals == expected(*records)


@pytest.mark.parametrize("database", ["fast", "slow"])
@pytest.mark.parametrize("flusher", ["this", "another gateway"])
def test_a_report_read_while_a_flush_commits_counts_each_record_once(new_store, db_url, tenant, flusher, database):
    """A flush that moves the counters into the database while a report reads the rollups and the pending counters
    (it commits between the two reads, or it is still writing when the rollups are read) is counted once: the
    report waits for it or reads again, it never adds the counters from both places nor from neither."""
    if flusher == "another gateway" and new_store is MemoryUsageStore:
        pytest.skip("in-process counters have one gateway")

    async def main():
        db, store = Database(db_url), new_store()
        other = store if flusher == "this" else new_store()
        records = [usage(tenant, 10, 1), usage(tenant, 20, 2, adapter="")]
        for i, record in enumerate(records):
            await store.record(f"{tenant}-{i}", record)
        flushes = []

        async def read_rollups_while_a_flush_runs():
            if database == "slow" and not flushes:
                asyncio.get_running_loop().call_later(0.4, lock_rollups(db_url, tenant))
            flushes.append(asyncio.create_task(other.flush(db.rollups)))
            await asyncio.sleep(0.2)  # the flush claims, writes and commits or waits for the database meanwhile
            return await db.rollups.read(tenant)

        rollups, pending = await store.read_with_pending(read_rollups_while_a_flush_runs)
        flushed = await asyncio.gather(*flushes)
        reported = merge_counters(rollups, pending)
        totals = await db.totals(tenant)
        for each in {store, other}:
            await each.close()
        await db.close()
        return flushed, pending_of(reported, tenant), totals

    flushed, reported, totals = asyncio.run(main())
    assert any(flushed), "no flush moved the counters: the test proves nothing"
    assert reported == expected(*[usage(tenant, 10, 1), usage(tenant, 20, 2, adapter="")])
    assert totals == reported


def test_claim_of_a_dead_flusher_is_taken_back(redis_url, redis_key_prefix, tmp_path, tenant):
    url = f"sqlite:///{tmp_path}/registry.db"
    upgrade(url)

    async def main():
        db = Database(url)
        dead = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        alive = RedisUsageStore(redis_url, key_prefix=redis_key_prefix, stale_claim_s=0.3)
        await dead.record("r1", usage(tenant, 8, 4))
        flushing, pending, claims, _ = dead._claim_keys("dead-flush")
        # The dead gateway claimed the pending counters, then died before writing them to the database.
        assert await dead._claim(keys=[pending, flushing, claims], args=["dead-flush", time.time(), 3600])
        await dead.close()
        claimed = pending_of(await alive.pending(), tenant)
        early = await alive.flush(db.rollups)  # the claim is not stale yet: left alone
        await asyncio.sleep(0.4)
        await alive.flush(db.rollups)
        await alive.flush(db.rollups)
        totals = await db.totals(tenant)
        await alive.close()
        await db.close()
        return claimed, early, totals

    claimed, early, totals = asyncio.run(main())
    assert claimed == expected(usage(tenant, 8, 4))
    assert early == {}
    assert totals == expected(usage(tenant, 8, 4))


def lock_rollups(db_url: str, tenant: str):
    """Blocks writers of `tenant`'s rows from another connection (a slow database); returns the unlock."""
    if db_url.startswith("sqlite"):
        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
    else:
        conn = psycopg.connect(db_url)
        conn.execute("INSERT INTO usage_rollups VALUES (%s, 'sql', %s, 0, 0, 0, 0)", (tenant, DAY))

    def unlock():
        conn.commit()
        conn.close()

    return unlock


def test_slow_flusher_whose_claim_was_taken_back_commits_nothing(redis_url, redis_key_prefix, db_url, tenant):
    async def main():
        db = Database(db_url)
        slow = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        other = RedisUsageStore(redis_url, key_prefix=redis_key_prefix, stale_claim_s=0.3)
        await slow.record("r1", usage(tenant, 8, 4))
        unlock = lock_rollups(db_url, tenant)
        slow_flush = asyncio.create_task(slow.flush(db.rollups))  # claims, then waits for the database
        await asyncio.sleep(0.5)
        other_flush = asyncio.create_task(other.flush(db.rollups))  # takes the stale claim back, flushes it
        await asyncio.sleep(0.2)
        unlock()
        flushed = await asyncio.gather(slow_flush, other_flush)
        totals = await db.totals(tenant)
        for store in (slow, other):
            await store.close()
        await db.close()
        return flushed, totals

    flushed, totals = asyncio.run(main())
    assert flushed[0] == {}
    assert totals == expected(usage(tenant, 8, 4))


def test_redis_outage_loses_nothing_and_counts_nothing_twice(db_url, tenant, caplog):
    async def main(redis: RedisProcess):
        db = Database(db_url)
        store = RedisUsageStore(redis.url, key_prefix="outage:")
        before = [usage(tenant, 10 + i, i) for i in range(5)]
        for i, record in enumerate(before):
            await store.record(f"before-{i}", record)
        redis.stop(kill=True)
        during = [usage(tenant, 100 + i, 2 * i, adapter="") for i in range(5)]
        started = time.monotonic()
        for i, record in enumerate(during):
            await store.record(f"during-{i}", record)  # must not raise
        await store.record("during-0", during[0])  # a replay while down
        await store.record("before-1", before[1])  # a replay of a request Redis already holds
        await store.flush(db.rollups)  # Redis down: postponed, nothing lost
        recording_s = time.monotonic() - started
        buffered = pending_of(await store.pending(), tenant)
        redis.start()
        await store.record("before-2", before[2])  # replays after the restart count nothing either
        after = usage(tenant, 1000, 1)
        await store.record("after-0", after)
        await store.flush(db.rollups)
        totals, pending = await db.totals(tenant), pending_of(await store.pending(), tenant)
        await store.close()
        await db.close()
        return before, during, after, recording_s, buffered, totals, pending

    with RedisProcess(persistent=True) as redis:
        before, during, after, recording_s, buffered, totals, pending = asyncio.run(main(redis))
    assert recording_s < 5
    assert buffered == expected(*during, before[1])  # only Redis can tell that before-1 is a replay
    assert totals == expected(*before, *during, after)
    assert pending == {}
    assert sum("Redis unreachable" in r.message for r in caplog.records if r.name.endswith("redis_store")) >= 1


def test_a_flush_that_died_committing_holds_no_report_back(redis_url, redis_key_prefix, db_url, tenant, caplog):
    """A gateway that died between its flush's commit and its last word leaves that flush in `committing`: reports
    wait for it (a bounded while, then still count what is pending), and not at all once it is stale."""
    from gateway.usage import redis_store

    async def main():
        db, store = Database(db_url), RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        await store.record("r1", usage(tenant, 10, 1))
        committing = store._keys + "committing"
        reports = []
        for age_s in (0.0, redis_store.COMMITTING_STALE_S + 60):
            await store.redis.zadd(committing, {"dead-flush": time.time() - age_s})
            started = time.monotonic()
            reports.append((await usage_report(db.rollups, tenant=tenant, store=store), time.monotonic() - started))
            await store.redis.zrem(committing, "dead-flush")
        await store.close()
        await db.close()
        return reports

    (fresh, fresh_s), (stale, stale_s) = asyncio.run(main())
    assert fresh.totals == stale.totals == UsageCounts(1, 10, 1, 0)
    assert fresh_s >= (redis_store.REPORT_TRIES - 1) * redis_store.REPORT_RETRY_S > stale_s
    assert sum("flushes kept committing" in r.message for r in caplog.records) == 1


def flush_and_die(redis_url: str, prefix: str, db_url: str, tenant: str, moment: str) -> None:
    """Runs tests/usage_crash.py's flush that dies at `moment`, in a process of its own."""
    argv = [sys.executable, "-m", "tests.usage_crash", redis_url, prefix, db_url, tenant, moment]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == usage_crash.DIED, result.stderr


async def flush_state(store: RedisUsageStore) -> tuple[int, list[str]]:
    """How many flushes are in `committing`, and the claimed hashes left in Redis."""
    committing = await store.redis.zcard(store._keys + "committing")
    claimed = [key.decode() async for key in store.redis.scan_iter(match=store._keys + "flushing:*")]
    return committing, sorted(claimed)


@pytest.mark.parametrize("moment", ["before-commit", "after-commit"])
def test_a_flush_whose_gateway_died_committing_is_settled_once(redis_url, redis_key_prefix, db_url, tenant, moment):
    """A gateway killed with its flush in `committing`: before its commit, the counters must go back to pending and
    reach the database through the next flush anywhere (they used to be lost); after it, its claimed copy must go,
    counted once. Each way, nothing is left in `committing` or claimed."""
    flush_and_die(redis_url, redis_key_prefix, db_url, tenant, moment)

    async def main():
        db = Database(db_url)
        alive = RedisUsageStore(redis_url, key_prefix=redis_key_prefix, stale_commit_s=0.3)
        left = await flush_state(alive)
        early = await alive.flush(db.rollups)  # not stale yet: left alone
        await asyncio.sleep(0.4)
        await alive.flush(db.rollups)  # settles it (before-commit: back to pending, then flushed with the rest)
        await alive.flush(db.rollups)
        totals, pending = await db.totals(tenant), pending_of(await alive.pending(), tenant)
        settled_state = await flush_state(alive)
        await alive.close()
        await db.close()
        return left, early, totals, pending, settled_state

    left, early, totals, pending, settled_state = asyncio.run(main())
    assert left[0] == 1 and len(left[1]) == 1  # the dead flush: in `committing`, its claimed hash still there
    assert early == {}
    assert totals == expected(usage_crash.crash_record(tenant))
    assert pending == {}
    assert settled_state == (0, [])


class RollupsWhoseCommitAnswerIsLost(UsageRollups):
    """Commits, then raises as a connection that broke before the database's answer came back would."""

    async def add(self, counters, commit_if=None, flush_id=None):
        await super().add(counters, commit_if=commit_if, flush_id=flush_id)
        lost = psycopg.OperationalError("server closed the connection unexpectedly")
        raise sqlalchemy.exc.OperationalError("COMMIT", {}, lost)


def test_a_commit_whose_answer_was_lost_counts_once(redis_url, redis_key_prefix, db_url, tenant):
    """The commit took but its answer never came: giving the counters back would count them twice; the flusher asks
    the database (usage_flushes) instead and drops its claimed copy."""

    async def main():
        db = Database(db_url)
        store = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        await store.record("r1", usage(tenant, 8, 4))
        with pytest.raises(sqlalchemy.exc.OperationalError):
            await store.flush(RollupsWhoseCommitAnswerIsLost(db.rollups.sessions))
        await store.flush(db.rollups)
        totals, pending = await db.totals(tenant), pending_of(await store.pending(), tenant)
        state = await flush_state(store)
        await store.close()
        await db.close()
        return totals, pending, state

    totals, pending, state = asyncio.run(main())
    assert totals == expected(usage(tenant, 8, 4))
    assert pending == {}
    assert state == (0, [])


def lose_an_answer(store: RedisUsageStore, other: RedisUsageStore, moment: str, retried: bool, meanwhile) -> None:
    """Makes one Redis call of `store`'s next flush go as a crash or a socket timeout makes it go: the claim's or the
    start of the commit's script runs in Redis and its answer is lost ('read': the read of the claimed hash fails);
    meanwhile `other` records `meanwhile`; `retried`: the client's one retry runs the call again and gets its answer."""
    target, name = {"claim": (store, "_claim"), "read": (store.redis, "hgetall"), "commit": (store, "_start_commit")}[
        moment
    ]
    real = getattr(target, name)
    calls = 0

    async def call(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 1:
            return await real(*args, **kwargs)
        if moment != "read":
            await real(*args, **kwargs)
        await other.record("r2", meanwhile)
        if retried:
            return await real(*args, **kwargs)
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    setattr(target, name, call)


@pytest.mark.parametrize(
    "moment, retried", [("claim", False), ("claim", True), ("read", False), ("commit", False), ("commit", True)]
)
def test_a_flush_that_loses_a_redis_answer_loses_no_usage(redis_url, redis_key_prefix, db_url, tenant, moment, retried):
    """Redis killed, or too slow, in the middle of a flush: the claim it took, or the commit it started, is resolved
    by the flusher's next flush (not left for stale_claim_s), and a retried script neither drops nor repeats a
    counter."""

    async def main():
        db = Database(db_url)
        store, other = (RedisUsageStore(redis_url, key_prefix=redis_key_prefix) for _ in range(2))
        await store.record("r1", usage(tenant, 8, 4))
        lose_an_answer(store, other, moment, retried, usage(tenant, 5, 2))
        await store.flush(db.rollups)
        await store.flush(db.rollups)
        totals, pending = await db.totals(tenant), pending_of(await store.pending(), tenant)
        state = await flush_state(store)
        for each in (store, other):
            await each.close()
        await db.close()
        return totals, pending, state

    totals, pending, state = asyncio.run(main())
    assert totals == expected(usage(tenant, 8, 4), usage(tenant, 5, 2))
    assert pending == {}
    assert state == (0, [])


def test_a_record_whose_answer_was_lost_counts_once_in_reports(redis_url, redis_key_prefix, db_url, tenant):
    """A record's write ran in Redis but its answer was lost (Redis killed, or a timeout): the record also waits in
    the process's buffer until Redis answers again. A report meanwhile counts it once (the buffer's copy is dropped
    where Redis holds the request), and the flush writes it once."""

    async def main():
        db = Database(db_url)
        store = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        await store.record("r1", usage(tenant, 8, 4))
        real = store._record

        async def ran_then_lost(*args, **kwargs):
            await real(*args, **kwargs)
            raise redis.exceptions.ConnectionError("Connection closed by server.")

        store._record = ran_then_lost
        await store.record("r2", usage(tenant, 5, 2))
        store._record = real
        await store.record("r3", usage(tenant, 3, 1))  # Redis taken as down for retry_interval_s: buffered
        buffered = sorted(store._buffer)
        pending = pending_of(await store.pending(), tenant)

        async def read() -> None:
            return None

        _, reported = await store.read_with_pending(read)
        await store.flush(db.rollups)
        totals, after = await db.totals(tenant), pending_of(await store.pending(), tenant)
        await store.close()
        await db.close()
        return buffered, pending, pending_of(reported, tenant), totals, after

    buffered, pending, reported, totals, after = asyncio.run(main())
    records = (usage(tenant, 8, 4), usage(tenant, 5, 2), usage(tenant, 3, 1))
    assert buffered == ["r2", "r3"]
    assert pending == reported == expected(*records)
    assert totals == expected(*records) and after == {}


def test_a_slow_commit_is_not_settled_under_it(redis_url, redis_key_prefix, db_url, tenant):
    """A flusher alive but slow to commit, past another gateway's stale_commit_s: the other's settle waits for its
    transaction (the flush_id's row is locked) and finds it committed, instead of giving the counters back."""

    class SlowCommit(UsageRollups):
        async def add(self, counters, commit_if=None, flush_id=None):
            async def slowly() -> bool:
                taken = await commit_if()
                await asyncio.sleep(1.0)
                return taken

            return await super().add(counters, commit_if=slowly, flush_id=flush_id)

    async def main():
        db = Database(db_url)
        slow = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)
        other = RedisUsageStore(redis_url, key_prefix=redis_key_prefix, stale_commit_s=0.2)
        await slow.record("r1", usage(tenant, 8, 4))
        slow_flush = asyncio.create_task(slow.flush(SlowCommit(db.rollups.sessions)))
        await asyncio.sleep(0.5)  # the slow flush is in `committing`, stale to `other`
        assert (await flush_state(other))[0] == 1
        flushed = await asyncio.gather(slow_flush, other.flush(db.rollups))
        totals, state = await db.totals(tenant), await flush_state(other)
        for store in (slow, other):
            await store.close()
        await db.close()
        return flushed, totals, state

    flushed, totals, state = asyncio.run(main())
    assert pending_of(flushed[0], tenant) == expected(usage(tenant, 8, 4))
    assert totals == expected(usage(tenant, 8, 4))
    assert state == (0, [])


def test_old_flush_outcomes_are_forgotten(db_url):
    async def main():
        db = Database(db_url)
        old, new = f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"
        for flush_id in (old, new):
            assert await db.rollups.settle_flush(flush_id) == ABANDONED
        async with db.rollups.sessions() as session:
            await session.execute(
                update(UsageFlush)
                .where(UsageFlush.flush_id == old)
                .values(created_at=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
            )
            await session.commit()
        await db.rollups.forget_flushes(dt.datetime(2021, 1, 1, tzinfo=dt.UTC))
        async with db.rollups.sessions() as session:
            left = set(await session.scalars(select(UsageFlush.flush_id).where(UsageFlush.flush_id.in_([old, new]))))
        await db.close()
        return left, new

    left, new = asyncio.run(main())
    assert left == {new}


def test_a_report_answers_when_redis_goes_down_while_it_reads(db_url, tenant, caplog):
    """Redis killed between a report's reads: the report still answers, with what it read, and says so."""

    async def main(redis: RedisProcess):
        db = Database(db_url)
        store = RedisUsageStore(redis.url, key_prefix="report-outage:")
        await store.record("flushed", usage(tenant, 10, 1))
        await store.flush(db.rollups)
        await store.record("pending", usage(tenant, 20, 2, adapter=""))

        async def read_while_redis_dies():
            redis.stop(kill=True)
            return await db.rollups.read(tenant)

        rollups, pending = await store.read_with_pending(read_while_redis_dies)
        later = await usage_report(db.rollups, tenant=tenant, store=store)  # Redis still down: the database's rows
        await store.close()
        await db.close()
        return pending_of(merge_counters(rollups, pending), tenant), later

    with RedisProcess(persistent=True) as redis:
        reported, later = asyncio.run(main(redis))
    assert reported == expected(usage(tenant, 10, 1), usage(tenant, 20, 2, adapter=""))
    assert [(row.adapter, row.requests) for row in later.rows] == [("sql", 1)]
    assert any("Redis unreachable as a report read" in r.message for r in caplog.records)


def test_final_flush_writes_the_buffer_when_redis_stays_down(tmp_path, tenant):
    url = f"sqlite:///{tmp_path}/registry.db"
    upgrade(url)

    async def main(redis: RedisProcess):
        db = Database(url)
        store = RedisUsageStore(redis.url, key_prefix="final:")
        flusher = UsageFlusher(store, db.rollups, interval_s=3600)
        await store.record("r0", usage(tenant, 3, 3))
        redis.stop()
        await store.record("r1", usage(tenant, 4, 4))
        await flusher.close()  # shutdown while Redis is down: r1 goes straight to the database
        at_close = await db.totals(tenant)
        redis.start()
        await store.flush(db.rollups)  # r0 was in Redis all along: flushed once, r1 not again
        totals = await db.totals(tenant)
        await store.close()
        await db.close()
        return at_close, totals

    with RedisProcess(persistent=True) as redis:
        at_close, totals = asyncio.run(main(redis))
    assert at_close == expected(usage(tenant, 4, 4))
    assert totals == expected(usage(tenant, 3, 3), usage(tenant, 4, 4))


def test_flusher_flushes_every_interval_and_at_close(new_store, tmp_path, tenant):
    url = f"sqlite:///{tmp_path}/registry.db"
    upgrade(url)

    async def main():
        db, store = Database(url), new_store()
        flusher = UsageFlusher(store, db.rollups, interval_s=0.05)
        flusher.start()
        await store.record("r0", usage(tenant, 1, 2))
        deadline = time.monotonic() + 5
        while not await db.totals(tenant) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        periodic = await db.totals(tenant)
        flusher.interval_s = 3600
        await asyncio.sleep(0.1)  # the loop is now asleep for an hour
        await store.record("r1", usage(tenant, 3, 4))
        await flusher.close()
        totals = await db.totals(tenant)
        await store.close()
        await db.close()
        return periodic, totals

    periodic, totals = asyncio.run(main())
    assert periodic == expected(usage(tenant, 1, 2))
    assert totals == expected(usage(tenant, 1, 2), usage(tenant, 3, 4))


def test_record_completes_when_the_request_task_is_cancelled(redis_url, redis_key_prefix, tenant):
    async def main():
        store = RedisUsageStore(redis_url, key_prefix=redis_key_prefix)

        async def request_handler():
            try:
                await asyncio.sleep(3600)  # streaming, until the client disconnects
            finally:
                await store.record("r0", usage(tenant, 6, 7))

        task = asyncio.create_task(request_handler())
        await asyncio.sleep(0.01)
        task.cancel()  # the client disconnects mid-stream
        await asyncio.sleep(0)
        task.cancel()  # and the server cancels again while the record is in flight
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        pending = pending_of(await store.pending(), tenant)
        await store.close()
        return pending

    assert asyncio.run(main()) == expected(usage(tenant, 6, 7))


def test_usage_report_filters_and_totals(tmp_path):
    url = f"sqlite:///{tmp_path}/registry.db"
    upgrade(url)
    next_day = DAY + dt.timedelta(days=1)

    async def main():
        db, store = Database(url), MemoryUsageStore()
        records = [usage("acme", 10, 1), usage("acme", 20, 2, adapter=""), usage("acme", 30, 3, day=next_day)]
        records += [usage("globex", 40, 4), usage("", 50, 5, adapter="")]
        for i, record in enumerate(records):
            await store.record(str(i), record)
        await store.flush(db.rollups)
        await store.record("late", usage("acme", 7, 7, day=next_day))
        reports = {
            "all": await usage_report(db.rollups),
            "acme": await usage_report(db.rollups, tenant="acme"),
            "sql": await usage_report(db.rollups, adapter="sql"),
            "day": await usage_report(db.rollups, from_day=next_day, to_day=next_day),
            "acme+pending": await usage_report(db.rollups, tenant="acme", store=store),
        }
        await db.close()
        return reports

    reports = asyncio.run(main())
    assert [(r.tenant, r.adapter, r.day) for r in reports["all"].rows] == [
        ("", "", DAY),
        ("acme", "", DAY),
        ("acme", "sql", DAY),
        ("globex", "sql", DAY),
        ("acme", "sql", next_day),
    ]
    assert reports["all"].totals == UsageCounts(5, 150, 15, 0)
    assert reports["acme"].totals == UsageCounts(3, 60, 6, 0)
    assert {(r.tenant, r.day) for r in reports["sql"].rows} == {("acme", DAY), ("globex", DAY), ("acme", next_day)}
    assert [r.prompt_tokens for r in reports["day"].rows] == [30]
    assert reports["acme+pending"].totals == UsageCounts(4, 67, 13, 0)
