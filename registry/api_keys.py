"""ApiKeyRepository: the `api_keys` table, tenants' API keys stored as hashes: add, find by hash, list, revoke.

The repository never sees a key, only its hash and its first characters (hashing is the caller's: gateway/auth.py).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from registry.models import ApiKey, utcnow


class ApiKeyRepository:
    def __init__(self, sessions: async_sessionmaker):
        self.sessions = sessions

    async def add(self, tenant: str, prefix: str, key_hash: str) -> ApiKey:
        key = ApiKey(tenant=tenant, prefix=prefix, key_hash=key_hash)
        async with self.sessions() as session:
            session.add(key)
            await session.commit()
        return key

    async def active(self, key_hash: str) -> ApiKey | None:
        """The key with this hash, unless it was revoked."""
        query = select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        async with self.sessions() as session:
            return (await session.scalars(query)).first()

    async def list(self, tenant: str) -> list[ApiKey]:
        """`tenant`'s keys, revoked ones included, oldest first."""
        query = select(ApiKey).where(ApiKey.tenant == tenant).order_by(ApiKey.id)
        async with self.sessions() as session:
            return list((await session.scalars(query)).all())

    async def revoke(self, tenant: str, key_id: int) -> ApiKey | None:
        """Revokes `tenant`'s key `key_id` (a revoked key keeps its first revocation time); None when `tenant` has
        no such key."""
        async with self.sessions() as session:
            key = await session.get(ApiKey, key_id)
            if key is None or key.tenant != tenant:
                return None
            if key.revoked_at is None:
                key.revoked_at = utcnow()
                await session.commit()
        return key
