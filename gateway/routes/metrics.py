"""`/metrics`: Prometheus exposition of the gateway's and the engine's metrics.

The metrics name tenants and private adapters, so they are not public: a scraper sends
`Authorization: Bearer <--metrics-key>` (a scrape-only credential) or the admin key. With neither key set,
only loopback clients (a Prometheus or an agent on the same host) are answered.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, Request, Response

from gateway.auth import bearer
from gateway.engine_metrics import snapshot
from gateway.errors import APIError
from gateway.settings import ServeSettings
from gateway.state import StateDep

router = APIRouter(tags=["metrics"])


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_scraper(settings: ServeSettings, token: str | None, client_host: str | None) -> None:
    """Raises a 401/403 unless this caller may read the metrics."""
    keys = [key for key in (settings.metrics_key, settings.admin_key) if key]
    if not keys:
        if _is_loopback(client_host):
            return
        raise APIError(
            403, "/metrics answers loopback clients only: set --metrics-key (or --admin-key) to scrape it remotely"
        )
    if token is None:
        raise APIError(401, "missing credential: send 'Authorization: Bearer <metrics key or admin key>'")
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise APIError(403, "this credential may not read /metrics")


@router.get("/metrics")
async def metrics(request: Request, state: StateDep) -> Response:
    check_scraper(state.settings, bearer(request), request.client.host if request.client else None)
    engine = await snapshot(state.engine)
    body, content_type = state.metrics.render(engine, request.headers.get("accept"))
    return Response(body, media_type=content_type)
