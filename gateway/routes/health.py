"""`/health` (liveness), `/ready` (readiness) and `/version`.

`/health` says whether this process can still serve at all: the engine thread is alive. It touches nothing
outside the process, so a database or Redis outage never gets a healthy server restarted. `/ready` says whether
it should get traffic now: the engine loop runs, the registry database answers with its schema at the newest
migration, and Redis (when configured) answers. Each failing check is named in the 503.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

from gateway.errors import APIError
from gateway.state import GatewayState, StateDep
from registry import db

router = APIRouter(tags=["health"])
CHECK_TIMEOUT_S = 2.0


def package_version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:
        return "0+unknown"


@router.get("/health")
async def health(state: StateDep):
    if not state.engine.is_alive:
        raise APIError(503, "the engine thread has stopped")
    return {"status": "ok"}


async def _registry_problem(state: GatewayState) -> str | None:
    try:
        revision = await asyncio.wait_for(state.database.schema_revision(), CHECK_TIMEOUT_S)
    except Exception as e:
        return f"the registry database cannot be read ({type(e).__name__})"
    head = await asyncio.to_thread(db.head_revision)
    if revision != head:
        return f"the registry schema is at revision {revision}, not {head}: run `loraplex db upgrade`"
    return None


async def _redis_problem(state: GatewayState) -> str | None:
    if not state.settings.redis_url:
        return None
    import redis.asyncio as aioredis

    client = aioredis.from_url(state.settings.redis_url, socket_timeout=CHECK_TIMEOUT_S)
    try:
        await asyncio.wait_for(client.ping(), CHECK_TIMEOUT_S)
    except Exception as e:
        return f"Redis does not answer ({type(e).__name__})"
    finally:
        await client.aclose()
    return None


@router.get("/ready")
async def ready(state: StateDep):
    problems = [] if state.engine.is_alive else ["the engine thread has stopped"]
    problems += [p for p in await asyncio.gather(_registry_problem(state), _redis_problem(state)) if p]
    if problems:
        raise APIError(503, "not ready: " + "; ".join(problems), code="not_ready")
    return {"status": "ready"}


@router.get("/version")
async def version_info():
    return {"version": package_version()}
