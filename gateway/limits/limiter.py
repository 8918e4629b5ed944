"""The `RateLimiter` interface: admit a tenant's request against its limits, release it with the tokens served."""

from __future__ import annotations

from abc import ABC, abstractmethod

from gateway.limits.policy import TenantLimits

SLOT_TTL_S = 900.0  # a concurrency slot not released by then (its process died) no longer counts


class RateLimiter(ABC):
    @abstractmethod
    async def admit(self, tenant: str, limits: TenantLimits, request_id: str) -> None:
        """Takes a concurrency slot and counts the request toward its requests per minute, or raises
        LimitExceeded (nothing taken) or, failing closed without Redis, LimitsUnavailable.
        Every admitted request must be released exactly once."""

    @abstractmethod
    async def release(self, tenant: str, request_id: str, tokens: int) -> None:
        """Frees the request's slot and charges its prompt + completion `tokens` to tokens per minute and the
        quota. Never raises."""

    async def close(self) -> None:
        return None


def make_rate_limiter(redis_url: str | None, fail_open: bool = True, key_prefix: str = "loraplex:") -> RateLimiter:
    """Redis when a URL is given (limits then hold across gateway processes), in process otherwise."""
    if redis_url:
        from gateway.limits.redis_limiter import RedisRateLimiter

        return RedisRateLimiter(redis_url, key_prefix=key_prefix, fail_open=fail_open)
    from gateway.limits.memory_limiter import MemoryRateLimiter

    return MemoryRateLimiter()
