"""`MemoryRateLimiter`: per-tenant limits held in this process, for a single gateway without Redis."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.limits.limiter import SLOT_TTL_S, RateLimiter
from gateway.limits.policy import LIMIT_NAMES, QUOTA_PERIODS, WINDOW_S, TenantLimits, limit_exceeded, minute_window
from gateway.limits.policy import quota_period as quota_period_of


class MemoryRateLimiter(RateLimiter):
    def __init__(self, slot_ttl_s: float = SLOT_TTL_S, clock: Callable[[], float] = time.time):
        self.slot_ttl_s = slot_ttl_s
        self.clock = clock
        self._counts: dict[tuple, int] = {}  # (tenant, "rpm" | "tpm" | "quota", window or period) -> count
        self._expires: dict[tuple, float] = {}
        self._slots: dict[str, dict[str, float]] = {}  # tenant -> request_id -> when the slot expires
        self._next_prune = 0.0

    async def admit(self, tenant: str, limits: TenantLimits, request_id: str) -> None:
        if limits.unlimited:
            return
        now = self.clock()
        self._prune(now)
        minute = minute_window(now)[0]
        slots = self._slots.setdefault(tenant, {})
        for held, expires in list(slots.items()):
            if expires <= now:
                del slots[held]
        used = {
            "token_quota": self._counts.get((tenant, "quota", quota_period_of(limits.quota_period, now)[0]), 0),
            "tokens_per_minute": self._counts.get((tenant, "tpm", minute), 0),
            "requests_per_minute": self._counts.get((tenant, "rpm", minute), 0),
            "max_concurrent_requests": len(slots),
        }
        for name in LIMIT_NAMES:
            limit = getattr(limits, name)
            if limit is not None and used[name] >= limit:
                raise limit_exceeded(name, tenant, limits, now)
        if limits.requests_per_minute is not None:
            self._add((tenant, "rpm", minute), 1, now + WINDOW_S)
        if limits.max_concurrent_requests is not None:
            slots[request_id] = now + self.slot_ttl_s

    async def release(self, tenant: str, request_id: str, tokens: int) -> None:
        self._slots.get(tenant, {}).pop(request_id, None)
        if tokens <= 0:
            return
        now = self.clock()
        minute, seconds_left = minute_window(now)
        self._add((tenant, "tpm", minute), tokens, now + seconds_left)
        for period in QUOTA_PERIODS:
            label, seconds_left = quota_period_of(period, now)
            self._add((tenant, "quota", label), tokens, now + seconds_left)

    def _add(self, key: tuple, amount: int, expires: float) -> None:
        self._counts[key] = self._counts.get(key, 0) + amount
        self._expires[key] = expires

    def _prune(self, now: float) -> None:
        if now < self._next_prune:
            return
        self._next_prune = now + WINDOW_S
        for key in [key for key, expires in self._expires.items() if expires <= now]:
            del self._counts[key], self._expires[key]
        for tenant in [tenant for tenant, slots in self._slots.items() if not slots]:
            del self._slots[tenant]
