"""`/admin/tenants` and their API keys, and `/admin/usage`: the operator's side of tenants.

A key is returned once, at creation, and stored only as its sha256; listings show its prefix. Deleting a
tenant deletes its keys and its private adapters (usage history stays in the rollups).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select

from gateway.auth import AdminDep, hash_key, new_api_key
from gateway.errors import APIError
from gateway.state import GatewayState, StateDep
from gateway.usage_report import usage_json
from registry.adapters import ALL_TENANTS, NAME_PATTERN
from registry.models import Adapter, ApiKey, Tenant, utcnow

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])
Limit = Annotated[int | None, Field(ge=1)]


class TenantLimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str | None = None
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    max_concurrent_requests: Limit = None
    token_quota: Limit = None
    quota_period: Literal["day", "month"] = "day"


class CreateTenant(TenantLimitsBody):
    name: str


def tenant_json(tenant: Tenant) -> dict:
    return {
        "name": tenant.name,
        "description": tenant.description,
        "requests_per_minute": tenant.requests_per_minute,
        "tokens_per_minute": tenant.tokens_per_minute,
        "max_concurrent_requests": tenant.max_concurrent_requests,
        "token_quota": tenant.token_quota,
        "quota_period": tenant.quota_period,
        "created_at": tenant.created_at.isoformat() if tenant.created_at else None,
    }


def key_json(key: ApiKey) -> dict:
    return {
        "id": key.id,
        "tenant": key.tenant,
        "prefix": key.prefix,
        "created_at": key.created_at.isoformat() if key.created_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }


async def _tenant(state: GatewayState, name: str) -> Tenant:
    async with state.sessions() as session:
        tenant = await session.get(Tenant, name)
    if tenant is None:
        raise APIError(404, f"tenant '{name}' does not exist", param="name", code="tenant_not_found")
    return tenant


@router.post("/tenants", status_code=201)
async def create_tenant(body: CreateTenant, state: StateDep):
    if not NAME_PATTERN.fullmatch(body.name):
        raise APIError(422, f"invalid tenant name {body.name!r}: letters, digits and . _ - + :", param="name")
    async with state.sessions() as session:
        if await session.get(Tenant, body.name) is not None:
            raise APIError(409, f"tenant '{body.name}' already exists", param="name", code="conflict")
        tenant = Tenant(**body.model_dump())
        session.add(tenant)
        await session.commit()
    return tenant_json(tenant)


@router.get("/tenants")
async def list_tenants(state: StateDep):
    async with state.sessions() as session:
        tenants = (await session.scalars(select(Tenant).order_by(Tenant.name))).all()
    return {"object": "list", "data": [tenant_json(t) for t in tenants]}


@router.get("/tenants/{name}")
async def get_tenant(name: str, state: StateDep):
    return tenant_json(await _tenant(state, name))


@router.patch("/tenants/{name}")
async def update_tenant(name: str, body: TenantLimitsBody, state: StateDep):
    """Sets the fields given (null clears a limit)."""
    await _tenant(state, name)
    async with state.sessions() as session:
        tenant = await session.get(Tenant, name)
        for field, value in body.model_dump(exclude_unset=True).items():
            setattr(tenant, field, value)
        await session.commit()
    state.accounting.forget(name)
    return tenant_json(tenant)


@router.delete("/tenants/{name}")
async def delete_tenant(name: str, state: StateDep):
    await _tenant(state, name)
    owned = [a for a in await state.registry.list(ALL_TENANTS) if a.owner == name]
    for adapter in {a.name for a in owned}:
        await state.adapters.delete(adapter, None)
    async with state.sessions() as session:
        await session.execute(delete(ApiKey).where(ApiKey.tenant == name))
        await session.execute(delete(Adapter).where(Adapter.owner == name))
        await session.execute(delete(Tenant).where(Tenant.name == name))
        await session.commit()
    state.accounting.forget(name)
    return {"deleted": name, "adapters_deleted": sorted(a.adapter_id for a in owned)}


@router.post("/tenants/{name}/keys", status_code=201)
async def create_key(name: str, state: StateDep):
    """The key is in this response only; it is stored as a hash."""
    await _tenant(state, name)
    key = new_api_key()
    async with state.sessions() as session:
        row = ApiKey(tenant=name, prefix=key[:12], key_hash=hash_key(key))
        session.add(row)
        await session.commit()
    return {**key_json(row), "key": key}


@router.get("/tenants/{name}/keys")
async def list_keys(name: str, state: StateDep):
    await _tenant(state, name)
    async with state.sessions() as session:
        keys = (await session.scalars(select(ApiKey).where(ApiKey.tenant == name).order_by(ApiKey.id))).all()
    return {"object": "list", "data": [key_json(k) for k in keys]}


@router.delete("/tenants/{name}/keys/{key_id}")
async def revoke_key(name: str, key_id: int, state: StateDep):
    async with state.sessions() as session:
        key = await session.get(ApiKey, key_id)
        if key is None or key.tenant != name:
            raise APIError(404, f"tenant '{name}' has no key {key_id}", param="key_id")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            await session.commit()
    return key_json(key)


@router.get("/usage")
async def usage(
    state: StateDep,
    tenant: str | None = None,
    adapter: str | None = None,
    start: Annotated[dt.date | None, Query(alias="from")] = None,
    end: Annotated[dt.date | None, Query(alias="to")] = None,
):
    """Usage by (tenant, adapter, day); "" is no tenant (auth off) or the base model."""
    return await usage_json(state, tenant, adapter, start, end)
