"""`RedisRateLimiter`: per-tenant limits in Redis, so they hold across every gateway process together.

Keys per tenant (hash tag `{t:<tenant>}`, so each script touches one Cluster slot), each with an expiry:
  {p}limits:{t:<tenant>}:rpm:<minute>     requests admitted in that minute
  {p}limits:{t:<tenant>}:tpm:<minute>     tokens charged in that minute
  {p}limits:{t:<tenant>}:quota:<period>   tokens charged in that UTC day (YYYY-MM-DD) or month (YYYY-MM)
  {p}limits:{t:<tenant>}:slots            zset request_id -> expiry: a slot of a process that died expires
Admission checks and takes in one Lua script, so concurrent gateways never admit past a limit together.
Times come from the gateway's clock (NTP-synchronised hosts agree well within a window).

Outage: with `fail_open` every request is admitted (one warning per outage); otherwise admit raises
LimitsUnavailable. `release` never raises; tokens served during an outage are not charged to the limits
(usage, for billing, is counted separately by gateway.usage).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.limits.limiter import SLOT_TTL_S, RateLimiter
from gateway.limits.policy import (
    LIMIT_NAMES,
    QUOTA_PERIODS,
    WINDOW_S,
    LimitsUnavailable,
    TenantLimits,
    limit_exceeded,
    minute_window,
    quota_period,
)

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError)
_PERIOD_MARGIN_S = 3600  # counters outlive their window a little, so clocks that differ slightly still agree

# KEYS: quota, tpm, rpm, slots (the order of LIMIT_NAMES). ARGV: the four limits (-1: none), now, request_id,
# slot ttl, rpm ttl. Returns the name of the limit reached, or "" after taking the slot and counting the request.
_ADMIT = """
local names = {'token_quota', 'tokens_per_minute', 'requests_per_minute'}
for i = 1, 3 do
  local limit = tonumber(ARGV[i])
  if limit >= 0 and tonumber(redis.call('GET', KEYS[i]) or '0') >= limit then return names[i] end
end
local now, max_concurrent = tonumber(ARGV[5]), tonumber(ARGV[4])
if max_concurrent >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) >= max_concurrent then return 'max_concurrent_requests' end
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[7]), ARGV[6])
  redis.call('EXPIRE', KEYS[4], math.ceil(tonumber(ARGV[7])))
end
if tonumber(ARGV[3]) >= 0 then
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ARGV[8])
end
return ''
"""
# KEYS: slots, then the token counters. ARGV: request_id, tokens, then one ttl per token counter.
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  for i = 2, #KEYS do
    redis.call('INCRBY', KEYS[i], tokens)
    redis.call('EXPIRE', KEYS[i], ARGV[i + 1])
  end
end
return 1
"""


class RedisRateLimiter(RateLimiter):
    def __init__(
        self,
        redis_url: str,
        key_prefix: str = "loraplex:",
        fail_open: bool = True,
        slot_ttl_s: float = SLOT_TTL_S,
        clock: Callable[[], float] = time.time,
    ):
        self.redis = aioredis.from_url(
            redis_url, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 1)
        )
        self.key_prefix = key_prefix
        self.fail_open = fail_open
        self.slot_ttl_s = slot_ttl_s
        self.clock = clock
        self._admit = self.redis.register_script(_ADMIT)
        self._release = self.redis.register_script(_RELEASE)
        self._in_outage = False

    def _key(self, tenant: str, name: str) -> str:
        return f"{self.key_prefix}limits:{{t:{tenant}}}:{name}"

    async def admit(self, tenant: str, limits: TenantLimits, request_id: str) -> None:
        if limits.unlimited:
            return
        now = self.clock()
        minute = minute_window(now)[0]
        keys = [
            self._key(tenant, "quota:" + quota_period(limits.quota_period, now)[0]),
            self._key(tenant, f"tpm:{minute}"),
            self._key(tenant, f"rpm:{minute}"),
            self._key(tenant, "slots"),
        ]
        bounds = [-1 if getattr(limits, name) is None else getattr(limits, name) for name in LIMIT_NAMES]
        try:
            reached = await self._admit(keys=keys, args=[*bounds, now, request_id, self.slot_ttl_s, 2 * WINDOW_S])
        except REDIS_ERRORS as e:
            self._redis_failed(e)
            if self.fail_open:
                return
            raise LimitsUnavailable(f"rate limits cannot be checked: Redis is unreachable ({e})") from e
        self._redis_ok()
        if reached:
            raise limit_exceeded(reached.decode(), tenant, limits, now)

    async def release(self, tenant: str, request_id: str, tokens: int) -> None:
        now = self.clock()
        minute, seconds_left = minute_window(now)
        keys = [self._key(tenant, "slots"), self._key(tenant, f"tpm:{minute}")]
        ttls = [math.ceil(seconds_left) + WINDOW_S]
        for period in QUOTA_PERIODS:
            label, seconds_left = quota_period(period, now)
            keys.append(self._key(tenant, "quota:" + label))
            ttls.append(math.ceil(seconds_left) + _PERIOD_MARGIN_S)
        try:
            await self._release(keys=keys, args=[request_id, max(0, int(tokens)), *ttls])
        except REDIS_ERRORS as e:
            self._redis_failed(e)
            return
        self._redis_ok()

    def _redis_failed(self, error: BaseException) -> None:
        if not self._in_outage:
            self._in_outage = True
            mode = "admitting every request (fail open)" if self.fail_open else "refusing requests (fail closed)"
            logger.warning("limits: Redis unreachable (%s); %s until it is back", error, mode)

    def _redis_ok(self) -> None:
        if self._in_outage:
            self._in_outage = False
            logger.info("limits: Redis is back; enforcing limits again")

    async def close(self) -> None:
        await self.redis.aclose()
