"""Accounting: each `/v1` request's admission against its tenant's limits and, once it is over, its usage.

`admit` checks the limits (429 with Retry-After naming the limit; 503 when the limits store is down and set
to fail closed) and returns a Ticket. The Ticket's `done` runs exactly once per admitted request, whatever
its ending (finished, aborted, failed): it records the tokens served for (tenant, adapter, day) and frees
the request's limit slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.errors import APIError
from gateway.generation import Usage
from gateway.limits import LimitExceeded, LimitsUnavailable, RateLimiter, TenantLimits
from gateway.usage import UsageRecord, UsageStore
from registry.tenants import TenantRepository

logger = logging.getLogger(__name__)
LIMITS_CACHE_S = 2.0  # a tenant's limits are re-read from the registry at most this often


class Ticket:
    def __init__(self, accounting: Accounting, tenant: str | None, request_id: str, limited: bool, weight: float = 1.0):
        self.accounting, self.tenant, self.request_id, self.limited = accounting, tenant, request_id, limited
        self.weight = weight  # the tenant's share under fair scheduling
        self._done = False

    async def done(self, adapter: str, usage: Usage | None) -> None:
        """Records `usage` (None: nothing was served) and frees the limit slot; later calls do nothing."""
        if self._done:
            return
        self._done = True
        tokens = 0
        try:
            if usage is not None and (usage.completion_tokens or usage.prompt_tokens):
                tokens = usage.prompt_tokens + usage.completion_tokens
                record = UsageRecord(
                    self.tenant or "", adapter, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
                )
                await self.accounting.store.record(self.request_id, record)
        finally:
            if self.limited:
                await self.accounting.limiter.release(self.tenant, self.request_id, tokens)


class Accounting:
    def __init__(self, tenants: TenantRepository, store: UsageStore, limiter: RateLimiter):
        self.tenants, self.store, self.limiter = tenants, store, limiter
        self._limits: dict[str, tuple[float, TenantLimits]] = {}

    async def limits_of(self, tenant: str) -> TenantLimits:
        cached = self._limits.get(tenant)
        if cached is not None and time.monotonic() - cached[0] < LIMITS_CACHE_S:
            return cached[1]
        row = await self.tenants.get(tenant)
        limits = TenantLimits.of(row) if row is not None else TenantLimits()
        self._limits[tenant] = (time.monotonic(), limits)
        return limits

    def forget(self, tenant: str) -> None:
        """Drops cached limits (after an admin change)."""
        self._limits.pop(tenant, None)

    async def admit(self, tenant: str | None) -> Ticket:
        request_id = uuid.uuid4().hex
        if tenant is None:  # auth off: usage is still counted, nobody is limited
            return Ticket(self, None, request_id, limited=False)
        limits = await self.limits_of(tenant)
        if limits.unlimited:
            return Ticket(self, tenant, request_id, limited=False, weight=limits.weight)
        try:
            await self.limiter.admit(tenant, limits, request_id)
        except LimitExceeded as e:
            raise APIError(
                429, e.message, code=e.limit, param=e.limit, headers={"Retry-After": str(e.retry_after)}
            ) from None
        except LimitsUnavailable as e:
            raise APIError(503, f"rate limits cannot be checked right now: {e}", headers={"Retry-After": "1"}) from None
        return Ticket(self, tenant, request_id, limited=True, weight=limits.weight)

    async def close(self) -> None:
        await asyncio.gather(self.store.close(), self.limiter.close(), return_exceptions=True)
