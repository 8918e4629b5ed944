"""Credentials: the admin key for `/admin/*` (and vLLM's adapter endpoints), tenant API keys for `/v1/*`.

Keys travel as `Authorization: Bearer <key>`. Tenant keys are stored only as sha256 hashes and looked up by
hash; the admin key is compared in constant time. A tenant key never opens an admin route.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import APIError
from gateway.state import StateDep

KEY_PREFIX = "lpx-"


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


async def require_admin(request: Request, state: StateDep) -> None:
    admin_key = state.settings.admin_key
    if not admin_key:
        raise APIError(403, "the admin API is disabled: start the server with --admin-key (or LORAPLEX_ADMIN_KEY)")
    token = bearer(request)
    if token is None:
        raise APIError(401, "missing admin credential: send 'Authorization: Bearer <admin key>'")
    if not hmac.compare_digest(token.encode(), admin_key.encode()):
        raise APIError(403, "this credential may not use the admin API")


async def current_tenant(request: Request, state: StateDep) -> str | None:
    """The calling tenant's name; None when auth is off (then only public adapters are visible)."""
    if not state.auth_enabled:
        return None
    token = bearer(request)
    if token is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    digest = hash_key(token)
    key = await state.database.api_keys.active(digest)
    if key is None or not hmac.compare_digest(key.key_hash, digest):
        raise APIError(401, "invalid API key", code="invalid_api_key")
    return key.tenant


AdminDep = Depends(require_admin)
TenantDep = Annotated[str | None, Depends(current_tenant)]
