"""Per-tenant, per-adapter usage: counted once per request (in Redis or in process), flushed to the registry."""

from gateway.usage.flusher import UsageFlusher
from gateway.usage.record import UsageRecord
from gateway.usage.report import UsageReport, UsageRow, usage_report
from gateway.usage.store import UsageStore, make_usage_store
from registry.usage import UsageCounts, UsageKey

__all__ = [
    "UsageCounts",
    "UsageFlusher",
    "UsageKey",
    "UsageRecord",
    "UsageReport",
    "UsageRow",
    "UsageStore",
    "make_usage_store",
    "usage_report",
]
