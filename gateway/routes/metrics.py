"""`/metrics`: Prometheus exposition of the gateway's and the engine's metrics (no auth, like vLLM's)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.engine_metrics import snapshot
from gateway.state import StateDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(request: Request, state: StateDep) -> Response:
    engine = await snapshot(state.engine)
    body, content_type = state.metrics.render(engine, request.headers.get("accept"))
    return Response(body, media_type=content_type)
