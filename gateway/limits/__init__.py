"""Per-tenant limits: requests and tokens per minute, concurrent requests, token quota per day or month."""

from gateway.limits.limiter import RateLimiter, make_rate_limiter
from gateway.limits.policy import LimitExceeded, LimitsUnavailable, TenantLimits

__all__ = ["LimitExceeded", "LimitsUnavailable", "RateLimiter", "TenantLimits", "make_rate_limiter"]
