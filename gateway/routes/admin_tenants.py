"""`/admin/tenants` and their API keys, and `/admin/usage`: the operator's side of tenants.

A key is returned once, at creation, and stored only as its sha256; listings show its prefix. Deleting a
tenant deletes its keys and its private adapters (usage history stays in the rollups).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from pydantic import ConfigDict, Field

from gateway.auth import AdminDep, hash_key, new_api_key
from gateway.errors import APIError
from gateway.request_model import RequestModel
from gateway.state import GatewayState, StateDep
from gateway.usage_report import usage_json
from registry.adapters import ALL_TENANTS, NAME_PATTERN
from registry.models import BIGINT_MAX, INTEGER_MAX, ApiKey, Tenant
from registry.tenants import TenantExists

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])
Limit = Annotated[int | None, Field(ge=1, le=INTEGER_MAX)]  # as the tenants table holds it
Quota = Annotated[int | None, Field(ge=1, le=BIGINT_MAX)]


class TenantLimitsBody(RequestModel):
    model_config = ConfigDict(extra="forbid")

    description: str | None = None
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    max_concurrent_requests: Limit = None
    token_quota: Quota = None
    quota_period: Literal["day", "month"] = "day"
    weight: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0  # share under fair scheduling


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
        "weight": tenant.weight,
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


def _no_tenant(name: str) -> APIError:
    return APIError(404, f"tenant '{name}' does not exist", param="name", code="tenant_not_found")


async def _tenant(state: GatewayState, name: str) -> Tenant:
    tenant = await state.database.tenants.get(name)
    if tenant is None:
        raise _no_tenant(name)
    return tenant


@router.post("/tenants", status_code=201)
async def create_tenant(body: CreateTenant, state: StateDep):
    if not NAME_PATTERN.fullmatch(body.name):
        raise APIError(422, f"invalid tenant name {body.name!r}: letters, digits and . _ - + :", param="name")
    try:
        tenant = await state.database.tenants.add(Tenant(**body.model_dump()))
    except TenantExists as e:
        raise APIError(409, str(e), param="name", code="conflict") from None
    return tenant_json(tenant)


@router.get("/tenants")
async def list_tenants(state: StateDep):
    tenants = await state.database.tenants.list()
    return {"object": "list", "data": [tenant_json(t) for t in tenants]}


@router.get("/tenants/{name}")
async def get_tenant(name: str, state: StateDep):
    return tenant_json(await _tenant(state, name))


@router.patch("/tenants/{name}")
async def update_tenant(name: str, body: TenantLimitsBody, state: StateDep):
    """Sets the fields given (null clears a limit)."""
    tenant = await state.database.tenants.update(name, body.model_dump(exclude_unset=True))
    if tenant is None:
        raise _no_tenant(name)
    state.accounting.forget(name)
    return tenant_json(tenant)


@router.delete("/tenants/{name}")
async def delete_tenant(name: str, state: StateDep):
    await _tenant(state, name)
    owned = [a for a in await state.registry.list(ALL_TENANTS) if a.owner == name]
    for adapter in {a.name for a in owned}:
        await state.adapters.delete(adapter, None)
    await state.database.tenants.delete(name)
    state.accounting.forget(name)
    return {"deleted": name, "adapters_deleted": sorted(a.adapter_id for a in owned)}


@router.post("/tenants/{name}/keys", status_code=201)
async def create_key(name: str, state: StateDep):
    """The key is in this response only; it is stored as a hash."""
    await _tenant(state, name)
    key = new_api_key()
    row = await state.database.api_keys.add(name, prefix=key[:12], key_hash=hash_key(key))
    return {**key_json(row), "key": key}


@router.get("/tenants/{name}/keys")
async def list_keys(name: str, state: StateDep):
    await _tenant(state, name)
    keys = await state.database.api_keys.list(name)
    return {"object": "list", "data": [key_json(k) for k in keys]}


@router.delete("/tenants/{name}/keys/{key_id}")
async def revoke_key(name: str, key_id: Annotated[int, Path(ge=1, le=INTEGER_MAX)], state: StateDep):
    key = await state.database.api_keys.revoke(name, key_id)
    if key is None:
        raise APIError(404, f"tenant '{name}' has no key {key_id}", param="key_id")
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
