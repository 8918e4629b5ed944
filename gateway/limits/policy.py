"""Per-tenant limits and their outcomes: `TenantLimits`, `LimitExceeded` (429 + Retry-After) and
`LimitsUnavailable` (503), plus the clock arithmetic both limiters share (one-minute windows, UTC quota periods).

Windows are fixed: the requests and tokens of a tenant are counted per wall-clock minute (epoch seconds // 60),
and tokens against the quota per UTC day or calendar month.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

WINDOW_S = 60
QUOTA_PERIODS = ("day", "month")
# Checked in this order; the first one reached is reported.
LIMIT_NAMES = ("token_quota", "tokens_per_minute", "requests_per_minute", "max_concurrent_requests")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits, None = unlimited; `token_quota` counts prompt + completion tokens per `quota_period`."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    token_quota: int | None = None
    quota_period: str = "day"
    weight: float = 1.0  # not a limit: the tenant's share under the fair scheduling policy

    def __post_init__(self):
        if self.quota_period not in QUOTA_PERIODS:
            raise ValueError(f"quota_period must be one of {QUOTA_PERIODS}, got {self.quota_period!r}")

    @classmethod
    def of(cls, tenant) -> TenantLimits:
        """From a registry `Tenant` row (or anything with the same attributes)."""
        return cls(
            tenant.requests_per_minute,
            tenant.tokens_per_minute,
            tenant.max_concurrent_requests,
            tenant.token_quota,
            tenant.quota_period or "day",
            getattr(tenant, "weight", None) or 1.0,
        )

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMIT_NAMES)


class LimitExceeded(Exception):
    """A tenant reached `limit` (one of LIMIT_NAMES); it may try again in `retry_after` seconds (HTTP 429)."""

    def __init__(self, limit: str, retry_after: int, message: str):
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after
        self.message = message


class LimitsUnavailable(Exception):
    """The limits cannot be checked (Redis unreachable) and the limiter fails closed (HTTP 503)."""


def minute_window(now: float) -> tuple[int, float]:
    """(index of the one-minute window holding `now`, seconds until it ends)."""
    return int(now // WINDOW_S), WINDOW_S - now % WINDOW_S


def quota_period(period: str, now: float) -> tuple[str, float]:
    """(label of the UTC day or month holding `now`, seconds until it ends)."""
    at = dt.datetime.fromtimestamp(now, dt.UTC)
    if period == "day":
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        end, label = start + dt.timedelta(days=1), start.strftime("%Y-%m-%d")
    else:
        start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end, label = (start + dt.timedelta(days=32)).replace(day=1), start.strftime("%Y-%m")
    return label, (end - at).total_seconds()


def limit_exceeded(limit: str, tenant: str, limits: TenantLimits, now: float) -> LimitExceeded:
    if limit == "token_quota":
        seconds_left = quota_period(limits.quota_period, now)[1]
        what = f"token quota per {limits.quota_period}"
    elif limit == "max_concurrent_requests":
        seconds_left, what = 1, "concurrent requests"
    else:
        seconds_left, what = minute_window(now)[1], limit.replace("_", " ")
    retry_after = max(1, math.ceil(seconds_left))
    message = f"tenant {tenant!r} reached its limit of {getattr(limits, limit)} {what}; retry after {retry_after} s"
    return LimitExceeded(limit, retry_after, message)
