"""`RedisUsageStore`: usage counters in Redis, shared by every gateway process and flushed to the registry once.

Keys (one hash tag, `{usage}`, so the scripts also run on a Redis Cluster):
  {p}usage:{usage}:seen:<request_id>    set once per request (NX, with a TTL), so a replay counts nothing
  {p}usage:{usage}:pending              hash: json([tenant, adapter, day, counter]) -> count
  {p}usage:{usage}:flushing:<flush_id>  the pending hash, renamed by one flusher: the atomic claim
  {p}usage:{usage}:claims               zset flush_id -> claim time; a claim older than `stale_claim_s` (its
                                        flusher died) is handed back to pending by the next flush anywhere
  {p}usage:{usage}:committing           zset flush_id -> time: flushes between taking their claim and their DEL
  {p}usage:{usage}:flushes              how many flushes have committed: with `committing`, lets a report see
                                        whether a flush moved counters into the database while it read them

Flush: claim -> read -> record the flush_id and upsert in a DB transaction -> move the claim to `committing` (the
flusher and a reclaimer race for it; the loser does nothing or rolls back) -> commit -> DEL, leave `committing`,
count the flush. A failed upsert gives the counters back. A flush in `committing` for over `stale_commit_s` (its
gateway died, or its commit failed without saying whether it took) is settled by the next flush anywhere through the
database's `usage_flushes`: its flush_id's row says the transaction committed (the claimed copy is dropped), or
`settle_flush` records it abandoned, after waiting for a transaction still open, and the counters go back to pending.

Report: pending and claimed hashes in one script, then the database, then the `flushes` count again; it reads
again while a flush is committing or when one committed in between, so no counter is counted twice or missed. A flush
in `committing` for over `stale_commit_s` (its gateway died) is not waited for. The same script says which requests
of this process's buffer Redis holds already (a write that ran but lost its answer): the report counts those once.

Outage: `record` never raises. While Redis is unreachable records wait in a local buffer (keyed by request_id)
and go to Redis, through the same idempotent script, on the next record or flush after it is back. A final
flush at shutdown writes a buffer that Redis never took straight to the database. Redis must persist its data
(appendonly) for unflushed counters to survive a Redis restart. A command can take in Redis and lose its answer (a
crash or a timeout after it ran): the client retries it once, so every script gives the same outcome run twice, and a
flush that lost Redis after its claim hands the claim back on its next flush instead of leaving it to `stale_claim_s`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.usage.record import UsageRecord, add_counts, merge_counters
from gateway.usage.store import DEDUPE_TTL_S, T, UsageStore
from registry.errors import UNAVAILABLE, describe
from registry.usage import COMMITTED, UsageCounts, UsageKey, UsageRollups

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError)
CLAIM_TTL_S = 7 * 24 * 3600  # a claimed hash nobody could resolve is dropped after this, never earlier
REPORT_TRIES = 100  # reads of a report that a committing flush can spoil before it settles for the last one
REPORT_RETRY_S = 0.01
# A flush commits within milliseconds of entering `committing`: one still there after this died (or its database
# hangs): a report stops waiting for it (at worst, that report counts that flush twice), and the next flush settles it.
COMMITTING_STALE_S = 10.0
FORGET_FLUSHES_EVERY_S = 3600.0  # how often a store deletes flush outcomes older than any claimed hash can live

# KEYS: seen, pending. ARGV: dedupe ttl, then (field, increment) pairs.
_RECORD = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
  return 1
end
return 0
"""
# KEYS: pending, flushing, claims. ARGV: flush_id, now, claim ttl. A retried claim (its first answer was lost) finds its
# hash already there and keeps it: renaming pending over it again would drop what the first claim took.
_CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return 1
"""
# KEYS: flushing, pending, claims, committing. ARGV: flush_id, guarded (1: only if the claim is still there to take).
_GIVE_BACK = """
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 and ARGV[2] == '1' then return 0 end
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do redis.call('HINCRBY', KEYS[2], fields[i], fields[i + 1]) end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""
# KEYS: claims, committing. ARGV: flush_id, now. Run in the transaction, before its commit; a retry whose first answer
# was lost finds the flush already in `committing` (only its own flusher moves a flush there).
_START_COMMIT = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 1 end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""
# KEYS: flushing, pending, committing, flushes. ARGV: flush_id, committed (0/1). Settles a stale `committing` flush.
_SETTLE = """
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '0' then
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do redis.call('HINCRBY', KEYS[2], fields[i], fields[i + 1]) end
end
redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[4])
return 1
"""
# KEYS: flushing, committing, flushes. ARGV: flush_id. Run after the commit.
_COMMITTED = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('INCR', KEYS[3])
"""
# KEYS: flushes, committing, pending, claims. ARGV: flushing key prefix, oldest live commit time, with hashes (0/1),
# seen key prefix, then request ids of the caller's buffer. Returns [flushes, committing] and, with hashes, [whether
# Redis holds each of those requests (0/1), pending hash, claimed hashes...].
_SNAPSHOT = """
local out = {redis.call('GET', KEYS[1]) or '0', redis.call('ZCOUNT', KEYS[2], ARGV[2], '+inf')}
if ARGV[3] == '1' then
  local held = {}
  for i = 5, #ARGV do held[#held + 1] = redis.call('EXISTS', ARGV[4] .. ARGV[i]) end
  table.insert(out, held)
  table.insert(out, redis.call('HGETALL', KEYS[3]))
  for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
    table.insert(out, redis.call('HGETALL', ARGV[1] .. id))
  end
end
return out
"""


def _field(key: UsageKey, counter: str) -> str:
    return json.dumps([key.tenant, key.adapter, key.day.isoformat(), counter], separators=(",", ":"))


def _parse_hash(raw: dict[bytes, bytes] | list[bytes]) -> dict[UsageKey, UsageCounts]:
    if isinstance(raw, list):  # HGETALL inside a script answers a flat [field, value, ...] list
        raw = dict(zip(raw[::2], raw[1::2], strict=True))
    counters: dict[UsageKey, UsageCounts] = {}
    for field, value in raw.items():
        tenant, adapter, day, counter = json.loads(field)
        counts = counters.setdefault(UsageKey(tenant, adapter, dt.date.fromisoformat(day)), UsageCounts())
        setattr(counts, counter, getattr(counts, counter) + int(value))
    return counters


class RedisUsageStore(UsageStore):
    def __init__(
        self,
        redis_url: str,
        key_prefix: str = "loraplex:",
        dedupe_ttl_s: int = DEDUPE_TTL_S,
        stale_claim_s: float = 300.0,
        retry_interval_s: float = 1.0,
        stale_commit_s: float = COMMITTING_STALE_S,
    ):
        self.redis = aioredis.from_url(
            redis_url, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 1)
        )
        self.dedupe_ttl_s = int(dedupe_ttl_s)
        self.stale_claim_s = stale_claim_s
        self.stale_commit_s = stale_commit_s
        self.retry_interval_s = retry_interval_s
        self._keys = f"{key_prefix}usage:{{usage}}:"
        self._record = self.redis.register_script(_RECORD)
        self._claim = self.redis.register_script(_CLAIM)
        self._give_back = self.redis.register_script(_GIVE_BACK)
        self._start_commit = self.redis.register_script(_START_COMMIT)
        self._committed = self.redis.register_script(_COMMITTED)
        self._settle = self.redis.register_script(_SETTLE)
        self._snapshot = self.redis.register_script(_SNAPSHOT)
        self._buffer: dict[str, UsageRecord] = {}  # request_id -> record Redis did not take yet
        self._unresolved: set[str] = set()  # our claims whose give-back failed: retried on the next flush
        self._draining = asyncio.Lock()
        self._in_flight: set[asyncio.Task] = set()  # records still running after their caller was cancelled
        self._retry_at = 0.0  # monotonic time before which Redis is taken as down without asking
        self._in_outage = False
        self._forget_at = 0.0  # monotonic time of the next deletion of old flush outcomes

    # ---- recording ----

    async def record(self, request_id: str, record: UsageRecord) -> None:
        # Shielded: a client disconnecting cancels the request's task, but its usage must still be counted.
        task = asyncio.ensure_future(self._record_once(request_id, record))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        await asyncio.shield(task)

    async def _record_once(self, request_id: str, record: UsageRecord) -> None:
        if self._buffer:
            await self._drain_buffer()
        if self._buffer or not await self._write(request_id, record):
            self._buffer.setdefault(request_id, record)

    async def _write(self, request_id: str, record: UsageRecord) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        increments: list[str | int] = []
        for name, value in record.counts.as_dict().items():
            if value:
                increments += [_field(record.key, name), value]
        try:
            await self._record(
                keys=[self._keys + "seen:" + request_id, self._keys + "pending"], args=[self.dedupe_ttl_s, *increments]
            )
        except REDIS_ERRORS as e:
            self._redis_failed(e)
            return False
        self._redis_ok()
        return True

    async def _drain_buffer(self) -> bool:
        """Hands buffered records to Redis; True when the buffer is empty afterwards."""
        async with self._draining:
            for request_id, record in list(self._buffer.items()):
                if not await self._write(request_id, record):
                    return False
                self._buffer.pop(request_id, None)
        return not self._buffer

    def _redis_failed(self, error: BaseException) -> None:
        self._retry_at = time.monotonic() + self.retry_interval_s
        if not self._in_outage:
            self._in_outage = True
            logger.warning("usage: Redis unreachable (%s); buffering usage records in this process", error)

    def _redis_ok(self) -> None:
        if self._in_outage:
            self._in_outage = False
            logger.info("usage: Redis is back; %d buffered usage records to hand over", len(self._buffer))

    # ---- flushing ----

    async def flush(self, rollups: UsageRollups, final: bool = False) -> dict[UsageKey, UsageCounts]:
        flushed: dict[UsageKey, UsageCounts] = {}
        self._retry_at = 0.0  # a flush always asks Redis, even right after a failed record
        try:
            if await self._drain_buffer():
                await self._give_back_claims()
                await self._settle_stale_commits(rollups)
                flushed = await self._flush_pending(rollups)
                await self._forget_old_flushes(rollups)
        except REDIS_ERRORS as e:
            self._redis_failed(e)
            logger.warning("usage: flush postponed, Redis unreachable: %s", e)
        if final and self._buffer:
            flushed = merge_counters(flushed, await self._flush_buffer_to_db(rollups))
        return flushed

    async def _give_back_claims(self) -> None:
        """Returns to pending our own claims left unresolved and any claim whose flusher died."""
        for flush_id in list(self._unresolved):
            await self._give_back(keys=self._claim_keys(flush_id), args=[flush_id, 0])
            self._unresolved.discard(flush_id)
        stale = await self.redis.zrangebyscore(self._keys + "claims", "-inf", time.time() - self.stale_claim_s)
        for flush_id in (raw.decode() for raw in stale):
            if await self._give_back(keys=self._claim_keys(flush_id), args=[flush_id, 1]):
                logger.warning("usage: took back counters of flush %s, whose flusher did not finish", flush_id)

    async def _settle_stale_commits(self, rollups: UsageRollups) -> None:
        """Settles each flush left in `committing` for over stale_commit_s by its outcome in the database: its claimed
        copy is dropped if its transaction committed, given back to pending if not."""
        stale = await self.redis.zrangebyscore(self._keys + "committing", "-inf", time.time() - self.stale_commit_s)
        for flush_id in (raw.decode() for raw in stale):
            await self._settle_commit(rollups, flush_id)

    async def _forget_old_flushes(self, rollups: UsageRollups) -> None:
        """Once an hour, deletes the flush outcomes no claimed hash can outlive: a flush's outcome is recorded after
        its claim, whose hash expires CLAIM_TTL_S after it (plus a day of slack for the clocks)."""
        if time.monotonic() < self._forget_at:
            return
        self._forget_at = time.monotonic() + FORGET_FLUSHES_EVERY_S
        before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=CLAIM_TTL_S + 24 * 3600)
        try:
            await rollups.forget_flushes(before)
        except UNAVAILABLE as e:
            logger.warning("usage: could not delete old flush outcomes (next try in an hour): %s", describe(e))

    async def _settle_commit(self, rollups: UsageRollups, flush_id: str) -> None:
        """Settles one flush in `committing` (see _settle_stale_commits); where the database cannot say yet, it stays
        there for the next flush."""
        try:
            committed = await rollups.settle_flush(flush_id) == COMMITTED
        except UNAVAILABLE as e:
            logger.warning("usage: flush %s, stopped while committing, stays unsettled: %s", flush_id, describe(e))
            return
        flushing, pending, _, committing = self._claim_keys(flush_id)
        keys = [flushing, pending, committing, self._keys + "flushes"]
        if await self._settle(keys=keys, args=[flush_id, int(committed)]):
            if committed:
                logger.warning("usage: flush %s had committed before its flusher stopped; dropped its copy", flush_id)
            else:
                logger.warning("usage: flush %s stopped before its commit; its counters are pending again", flush_id)

    def _claim_keys(self, flush_id: str) -> list[str]:
        keys = self._keys
        return [keys + "flushing:" + flush_id, keys + "pending", keys + "claims", keys + "committing"]

    async def _flush_pending(self, rollups: UsageRollups) -> dict[UsageKey, UsageCounts]:
        flush_id = uuid.uuid4().hex
        flushing, pending, claims, committing = self._claim_keys(flush_id)
        try:
            if not await self._claim(keys=[pending, flushing, claims], args=[flush_id, time.time(), CLAIM_TTL_S]):
                return {}
            counters = _parse_hash(await self.redis.hgetall(flushing))
        except REDIS_ERRORS:
            self._unresolved.add(flush_id)  # the claim may have taken (its answer lost): given back on the next flush
            raise
        commit_started = False

        async def commit_if() -> bool:
            # committed only if the claim is still ours: a reclaimer that took it back made it pending again
            nonlocal commit_started
            commit_started = await self._take_claim_to_commit(flush_id)
            return commit_started

        try:
            if not await rollups.add(counters, commit_if=commit_if, flush_id=flush_id):
                return {}
        except BaseException as e:
            if commit_started:  # the commit failed, but may have taken: the database's outcome decides
                await asyncio.shield(self._settle_commit(rollups, flush_id))
            elif isinstance(e, REDIS_ERRORS):
                self._unresolved.add(flush_id)  # the claim may have moved to `committing`: resolved on the next flush
            else:
                await self._give_back_own(flush_id)
            raise
        await self._committed(keys=[flushing, committing, self._keys + "flushes"], args=[flush_id])
        return counters

    async def _take_claim_to_commit(self, flush_id: str) -> bool:
        keys = [self._keys + "claims", self._keys + "committing"]
        return bool(await self._start_commit(keys=keys, args=[flush_id, time.time()]))

    async def _give_back_own(self, flush_id: str) -> None:
        try:
            await self._give_back(keys=self._claim_keys(flush_id), args=[flush_id, 0])
        except REDIS_ERRORS as e:
            self._redis_failed(e)
            self._unresolved.add(flush_id)

    async def _flush_buffer_to_db(self, rollups: UsageRollups) -> dict[UsageKey, UsageCounts]:
        """At shutdown with Redis still down: the records Redis never took go straight to the database."""
        taken, self._buffer = self._buffer, {}
        counters = self._buffer_counters(taken)
        try:
            await rollups.add(counters)
        except BaseException:
            self._buffer = {**taken, **self._buffer}
            raise
        logger.warning("usage: Redis unreachable at shutdown; wrote %d buffered records to the database", len(taken))
        return counters

    @staticmethod
    def _buffer_counters(buffer: dict[str, UsageRecord]) -> dict[UsageKey, UsageCounts]:
        counters: dict[UsageKey, UsageCounts] = {}
        for record in buffer.values():
            add_counts(counters, record.key, record.counts)
        return counters

    # ---- reporting ----

    async def pending(self) -> dict[UsageKey, UsageCounts]:
        try:
            _, _, hashes, held = await self._read_snapshot(with_hashes=True)
        except REDIS_ERRORS as e:
            logger.warning("usage: Redis unreachable, pending counters are this process's only: %s", e)
            hashes, held = [], set()
        return self._pending_of(hashes, held)

    async def read_with_pending(self, read: Callable[[], Awaitable[T]]) -> tuple[T, dict[UsageKey, UsageCounts]]:
        for attempt in range(REPORT_TRIES):
            if attempt:
                await asyncio.sleep(REPORT_RETRY_S)
            try:
                flushes, committing, hashes, held = await self._read_snapshot(with_hashes=True)
            except REDIS_ERRORS as e:
                logger.warning("usage: Redis unreachable, pending counters are this process's only: %s", e)
                return await read(), self._pending_of([], set())
            if committing:
                continue
            pending = self._pending_of(hashes, held)
            rollups = await read()
            try:
                settled = (await self._read_snapshot(with_hashes=False))[:2] == (flushes, 0)
            except REDIS_ERRORS as e:
                logger.warning("usage: Redis unreachable as a report read; it may count a flush twice: %s", e)
                return rollups, pending
            if settled:
                return rollups, pending
        logger.warning("usage: flushes kept committing while a report read; it may count one flush twice")
        return await read(), self._pending_of(hashes, held)

    def _pending_of(self, hashes: list, held: set[str]) -> dict[UsageKey, UsageCounts]:
        """The snapshot's pending and claimed hashes plus this process's buffer, read after them, less the buffered
        requests Redis held at the snapshot (`held`: a record whose write ran in Redis but whose answer was lost sits
        in both until the buffer drains): a record Redis took in between is then missed (it is newer), never counted
        twice."""
        buffered = {request_id: record for request_id, record in self._buffer.items() if request_id not in held}
        return merge_counters(*map(_parse_hash, hashes), self._buffer_counters(buffered))

    async def _read_snapshot(self, with_hashes: bool) -> tuple[int, int, list, set[str]]:
        """(flushes, committing, and with_hashes: the pending and claimed hashes, and which requests of this
        process's buffer Redis holds already)."""
        keys = [self._keys + name for name in ("flushes", "committing", "pending", "claims")]
        buffered = list(self._buffer) if with_hashes else []
        args = [self._keys + "flushing:", time.time() - self.stale_commit_s, int(with_hashes), self._keys + "seen:"]
        flushes, committing, *rest = await self._snapshot(keys=keys, args=[*args, *buffered])
        if not with_hashes:
            return int(flushes), int(committing), [], set()
        held_flags, *hashes = rest
        held = {request_id for request_id, flag in zip(buffered, held_flags, strict=True) if int(flag)}
        return int(flushes), int(committing), hashes, held

    async def close(self) -> None:
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        await self.redis.aclose()
