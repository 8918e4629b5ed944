"""Per-tenant limits in process and in a real Redis: requests and tokens per minute, concurrency, token quotas,
Retry-After, one limit shared by several gateways, and failing open or closed when Redis is down."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest

from gateway.limits import LimitExceeded, LimitsUnavailable, TenantLimits
from gateway.limits.memory_limiter import MemoryRateLimiter
from gateway.limits.redis_limiter import RedisRateLimiter
from registry.models import Tenant
from tests.services import RedisProcess


class Clock:
    def __init__(self, when: dt.datetime):
        self.now = when.timestamp()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def at(*args) -> Clock:
    return Clock(dt.datetime(*args, tzinfo=dt.UTC))


@pytest.fixture(params=["memory", "redis"])
def new_limiter(request):
    """Makes limiters of one kind; Redis limiters made by one test share that test's own key prefix."""
    if request.param == "memory":
        return MemoryRateLimiter
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_key_prefix")
    return lambda **options: RedisRateLimiter(url, key_prefix=prefix, **options)


def run_with(new_limiter, scenario, **options):
    async def main():
        limiter = new_limiter(**options)
        try:
            return await scenario(limiter)
        finally:
            await limiter.close()

    return asyncio.run(main())


async def refused(limiter, tenant, limits, request_id="refused") -> LimitExceeded:
    with pytest.raises(LimitExceeded) as caught:
        await limiter.admit(tenant, limits, request_id)
    return caught.value


def test_requests_per_minute(new_limiter):
    clock, limits = at(2026, 3, 10, 12, 0, 15), TenantLimits(requests_per_minute=3)

    async def scenario(limiter):
        for i in range(3):
            await limiter.admit("acme", limits, f"r{i}")
            await limiter.release("acme", f"r{i}", 10)
        error = await refused(limiter, "acme", limits)
        await limiter.admit("globex", limits, "other-tenant")  # another tenant has limits of its own
        clock.advance(45)  # the next minute
        await limiter.admit("acme", limits, "r3")
        return error

    error = run_with(new_limiter, scenario, clock=clock)
    assert (error.limit, error.retry_after) == ("requests_per_minute", 45)
    assert "acme" in error.message and "3" in error.message


def test_tokens_per_minute(new_limiter):
    clock, limits = at(2026, 3, 10, 12, 0, 50), TenantLimits(tokens_per_minute=100)

    async def scenario(limiter):
        await limiter.admit("acme", limits, "r0")
        await limiter.release("acme", "r0", 60)
        await limiter.admit("acme", limits, "r1")  # 60 of 100 used
        await limiter.release("acme", "r1", 50)
        error = await refused(limiter, "acme", limits)
        clock.advance(10)
        await limiter.admit("acme", limits, "r2")
        return error

    error = run_with(new_limiter, scenario, clock=clock)
    assert (error.limit, error.retry_after) == ("tokens_per_minute", 10)


def test_concurrent_requests_and_slots_of_dead_processes(new_limiter):
    clock, limits = at(2026, 3, 10, 12, 0, 0), TenantLimits(max_concurrent_requests=2)

    async def scenario(limiter):
        await limiter.admit("acme", limits, "r0")
        await limiter.admit("acme", limits, "r1")
        error = await refused(limiter, "acme", limits)
        await limiter.release("acme", "r0", 5)
        await limiter.admit("acme", limits, "r2")
        full_again = await refused(limiter, "acme", limits)
        clock.advance(31)  # r1 and r2 were never released (their process died): their slots expire
        await limiter.admit("acme", limits, "r3")
        await limiter.admit("acme", limits, "r4")
        return error, full_again

    error, full_again = run_with(new_limiter, scenario, clock=clock, slot_ttl_s=30)
    assert (error.limit, error.retry_after) == ("max_concurrent_requests", 1)
    assert full_again.limit == "max_concurrent_requests"


def test_daily_token_quota_resets_at_utc_midnight(new_limiter):
    clock, limits = at(2026, 3, 10, 23, 0, 0), TenantLimits(token_quota=1000, quota_period="day")

    async def scenario(limiter):
        await limiter.admit("acme", limits, "r0")
        await limiter.release("acme", "r0", 1000)
        error = await refused(limiter, "acme", limits)
        clock.advance(3600)
        await limiter.admit("acme", limits, "r1")
        return error

    error = run_with(new_limiter, scenario, clock=clock)
    assert (error.limit, error.retry_after) == ("token_quota", 3600)


def test_monthly_token_quota_spans_days(new_limiter):
    clock, limits = at(2026, 2, 27, 12, 0, 0), TenantLimits(token_quota=500, quota_period="month")

    async def scenario(limiter):
        await limiter.admit("acme", limits, "r0")
        await limiter.release("acme", "r0", 300)
        clock.advance(24 * 3600)  # February 28: same month, the tokens still count
        await limiter.admit("acme", limits, "r1")
        await limiter.release("acme", "r1", 300)
        error = await refused(limiter, "acme", limits)
        clock.advance(12 * 3600)  # March 1
        await limiter.admit("acme", limits, "r2")
        return error

    error = run_with(new_limiter, scenario, clock=clock)
    assert (error.limit, error.retry_after) == ("token_quota", 12 * 3600)


def test_first_limit_reached_is_reported(new_limiter):
    clock = at(2026, 3, 10, 12, 0, 0)
    limits = TenantLimits(requests_per_minute=1, tokens_per_minute=10, token_quota=10)

    async def scenario(limiter):
        await limiter.admit("acme", limits, "r0")
        rpm = await refused(limiter, "acme", limits)
        await limiter.release("acme", "r0", 10)
        return rpm, await refused(limiter, "acme", limits)

    rpm, quota = run_with(new_limiter, scenario, clock=clock)
    assert rpm.limit == "requests_per_minute"
    assert quota.limit == "token_quota" and quota.retry_after == 12 * 3600


def test_two_gateways_on_one_redis_enforce_one_limit(redis_url, redis_key_prefix):
    clock = at(2026, 3, 10, 12, 0, 0)

    async def main():
        limiters = [RedisRateLimiter(redis_url, key_prefix=redis_key_prefix, clock=clock) for _ in range(2)]

        async def attempt(i: int, limits: TenantLimits, tenant: str) -> bool:
            try:
                await limiters[i % 2].admit(tenant, limits, f"{tenant}-{i}")
                return True
            except LimitExceeded:
                return False

        rpm = TenantLimits(requests_per_minute=7)
        by_rpm = await asyncio.gather(*(attempt(i, rpm, "acme") for i in range(20)))
        concurrent = TenantLimits(max_concurrent_requests=3)
        by_slots = await asyncio.gather(*(attempt(i, concurrent, "globex") for i in range(12)))
        held = [i for i, ok in enumerate(by_slots) if ok]
        await limiters[1].release("globex", f"globex-{held[0]}", 0)  # through the other gateway
        after_release = await attempt(100, concurrent, "globex")
        for limiter in limiters:
            await limiter.close()
        return by_rpm, by_slots, after_release

    by_rpm, by_slots, after_release = asyncio.run(main())
    assert sum(by_rpm) == 7
    assert sum(by_slots) == 3
    assert after_release


def test_unlimited_tenants_are_always_admitted(new_limiter):
    async def scenario(limiter):
        for i in range(50):
            await limiter.admit("free", TenantLimits(), f"r{i}")
            await limiter.release("free", f"r{i}", 10_000)

    run_with(new_limiter, scenario)


def test_redis_outage_fails_open_or_closed(caplog):
    limits = TenantLimits(requests_per_minute=2)

    async def main(redis: RedisProcess):
        open_limiter = RedisRateLimiter(redis.url, key_prefix="open:", fail_open=True)
        closed_limiter = RedisRateLimiter(redis.url, key_prefix="closed:", fail_open=False)
        redis.stop()
        for i in range(5):  # far past the limit: fail open admits them all
            await open_limiter.admit("acme", limits, f"r{i}")
            await open_limiter.release("acme", f"r{i}", 10)  # never raises
        with pytest.raises(LimitsUnavailable):
            await closed_limiter.admit("acme", limits, "c0")
        await closed_limiter.admit("acme", TenantLimits(), "unlimited")  # nothing to check: admitted
        await closed_limiter.release("acme", "c0", 10)
        redis.start()
        for limiter in (open_limiter, closed_limiter):
            await limiter.admit("acme", limits, "back-0")
            await limiter.admit("acme", limits, "back-1")
            with pytest.raises(LimitExceeded):
                await limiter.admit("acme", limits, "back-2")
            await limiter.close()

    with caplog.at_level(logging.WARNING), RedisProcess(persistent=False) as redis:
        asyncio.run(main(redis))
    outage_warnings = [r for r in caplog.records if "Redis unreachable" in r.message]
    assert len(outage_warnings) == 2  # once per limiter and outage, not once per request


def test_tenant_limits_from_a_tenant_row():
    row = Tenant(name="acme", requests_per_minute=60, tokens_per_minute=None, max_concurrent_requests=4)
    row.token_quota, row.quota_period = 10_000, "month"
    assert TenantLimits.of(row) == TenantLimits(60, None, 4, 10_000, "month")
    assert TenantLimits().unlimited and not TenantLimits(token_quota=0).unlimited
    with pytest.raises(ValueError, match="quota_period"):
        TenantLimits(quota_period="week")
