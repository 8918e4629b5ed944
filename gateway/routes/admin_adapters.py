"""`/admin/adapters`: register (validated first), list, get, delete, load (warm) and unload (cold) adapters.

Every route needs the admin key. Rows come back as JSON with the adapter's current cache tier.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import ConfigDict

from gateway.auth import AdminDep
from gateway.errors import APIError
from gateway.request_model import RequestModel
from gateway.state import GatewayState, StateDep
from registry.adapters import ALL_TENANTS
from registry.models import Adapter

router = APIRouter(prefix="/admin/adapters", tags=["admin"], dependencies=[AdminDep])


class RegisterAdapter(RequestModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    version: str | None = None
    description: str | None = None
    owner: str | None = None  # a tenant's name; None: public
    preload: bool = False  # load it now (host memory, then a device row) so its first request does not wait


def adapter_json(adapter: Adapter, tier: str | None = None) -> dict:
    data = {
        "id": adapter.adapter_id,
        "name": adapter.name,
        "version": adapter.version,
        "path": adapter.path,
        "base_model": adapter.base_model,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "target_modules": adapter.target_modules,
        "digest": adapter.digest,
        "size_bytes": adapter.size_bytes,
        "status": adapter.status,
        "owner": adapter.owner,
        "description": adapter.description,
        "created_at": adapter.created_at.isoformat() if adapter.created_at else None,
        "updated_at": adapter.updated_at.isoformat() if adapter.updated_at else None,
    }
    if tier is not None:
        data["tier"] = tier
    return data


async def _get(state: GatewayState, name: str, version: str | None) -> Adapter:
    adapter = await state.registry.get(name, version, ALL_TENANTS)
    if adapter is None:
        label = f"{name}@{version}" if version else name
        raise APIError(404, f"adapter '{label}' is not registered", param="name", code="adapter_not_found")
    return adapter


@router.post("", status_code=201)
async def register(body: RegisterAdapter, state: StateDep):
    if body.owner is not None and await state.database.tenants.get(body.owner) is None:
        raise APIError(422, f"owner tenant '{body.owner}' does not exist", param="owner")
    adapter = await state.adapters.register(body.name, body.path, body.version, body.description, body.owner)
    tier = await state.adapters.warm(adapter) if body.preload else await state.adapters.tier(adapter)
    return adapter_json(adapter, tier)


@router.get("")
async def list_adapters(state: StateDep, name: str | None = None, owner: str | None = None):
    rows = await state.registry.list(ALL_TENANTS, name=name)
    if owner is not None:
        rows = [r for r in rows if r.owner == (None if owner == "public" else owner)]
    return {"object": "list", "data": [adapter_json(r) for r in rows]}


@router.get("/{name}")
async def get_adapter(name: str, state: StateDep, version: str | None = None):
    adapter = await _get(state, name, version)
    versions = await state.registry.list(ALL_TENANTS, name=name)
    return {
        **adapter_json(adapter, await state.adapters.tier(adapter)),
        "versions": [adapter_json(v) for v in versions],
    }


@router.delete("/{name}")
async def delete_adapter(name: str, state: StateDep, version: str | None = None):
    """Deletes every version (or `?version=`): unservable at once; requests already running finish, then the
    device row is freed."""
    await _get(state, name, version)
    rows = await state.adapters.delete(name, version)
    return {"deleted": [r.adapter_id for r in rows]}


@router.post("/{name}/load")
async def load_adapter(name: str, state: StateDep, version: str | None = None):
    adapter = await _get(state, name, version)
    return {"id": adapter.adapter_id, "tier": await state.adapters.warm(adapter)}


@router.post("/{name}/unload")
async def unload_adapter(name: str, state: StateDep, version: str | None = None):
    adapter = await _get(state, name, version)
    pinned = await state.adapters.evict(adapter)
    return {"id": adapter.adapter_id, "tier": await state.adapters.tier(adapter), "draining": pinned}
