"""TenantRepository: the `tenants` table, a tenant and its limits: create, read, list, change, delete.

Deleting a tenant also deletes what belongs to it, in the same transaction: its API keys and its private adapters
(usage history stays in the rollups).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from registry.models import Adapter, ApiKey, Tenant


class TenantExists(Exception):
    """A tenant of that name exists already."""


class TenantRepository:
    def __init__(self, sessions: async_sessionmaker):
        self.sessions = sessions

    async def get(self, name: str) -> Tenant | None:
        async with self.sessions() as session:
            return await session.get(Tenant, name)

    async def add(self, tenant: Tenant) -> Tenant:
        """Inserts a new tenant; raises TenantExists when the name is taken."""
        async with self.sessions() as session:
            if await session.get(Tenant, tenant.name) is not None:
                raise TenantExists(f"tenant '{tenant.name}' already exists")
            session.add(tenant)
            try:
                await session.commit()
            except IntegrityError as e:  # created by someone else since the check
                raise TenantExists(f"tenant '{tenant.name}' already exists") from e
        return tenant

    async def list(self) -> list[Tenant]:
        """Every tenant, by name."""
        async with self.sessions() as session:
            return list((await session.scalars(select(Tenant).order_by(Tenant.name))).all())

    async def update(self, name: str, changes: Mapping[str, object]) -> Tenant | None:
        """Sets the columns in `changes` (None clears a limit); None when there is no such tenant."""
        async with self.sessions() as session:
            tenant = await session.get(Tenant, name)
            if tenant is None:
                return None
            for column, value in changes.items():
                setattr(tenant, column, value)
            await session.commit()
        return tenant

    async def delete(self, name: str) -> None:
        """Deletes the tenant with its API keys and its private adapters, in one transaction."""
        async with self.sessions() as session:
            await session.execute(delete(ApiKey).where(ApiKey.tenant == name))
            await session.execute(delete(Adapter).where(Adapter.owner == name))
            await session.execute(delete(Tenant).where(Tenant.name == name))
            await session.commit()
