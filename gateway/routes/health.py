"""`/health` (ready to serve) and `/version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

from gateway.errors import APIError
from gateway.state import StateDep

router = APIRouter(tags=["health"])


def package_version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:
        return "0+unknown"


@router.get("/health")
async def health(state: StateDep):
    if not state.engine.is_alive:
        raise APIError(503, "the engine thread has stopped")
    try:
        await state.database.ping()
    except Exception as e:
        raise APIError(503, f"the registry database is unreachable: {type(e).__name__}") from None
    return {"status": "ok"}


@router.get("/version")
async def version_info():
    return {"version": package_version()}
