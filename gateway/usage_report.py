"""Usage reports as JSON: registry rollups plus the counters not flushed yet, filtered, with totals."""

from __future__ import annotations

import datetime as dt

from gateway.errors import APIError
from gateway.state import GatewayState
from gateway.usage import usage_report


async def usage_json(
    state: GatewayState,
    tenant: str | None,
    adapter: str | None,
    start: dt.date | None,
    end: dt.date | None,
) -> dict:
    if start is not None and end is not None and start > end:
        raise APIError(400, f"'from' ({start}) is after 'to' ({end})", param="from")
    report = await usage_report(state.database.usage, tenant, adapter, start, end, store=state.accounting.store)
    return {
        "object": "list",
        "data": [
            {
                "tenant": row.tenant,
                "adapter": row.adapter,
                "day": row.day.isoformat(),
                "requests": row.requests,
                "prompt_tokens": row.prompt_tokens,
                "completion_tokens": row.completion_tokens,
                "cached_tokens": row.cached_tokens,
                "total_tokens": row.prompt_tokens + row.completion_tokens,
            }
            for row in report.rows
        ],
        "totals": {**report.totals.as_dict(), "total_tokens": report.totals.total_tokens},
    }
