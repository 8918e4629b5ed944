"""RegistryDatabase: the registry as a running gateway holds it: one connection pool and one repository per table
(adapters, their files, tenants, API keys, usage rollups), a liveness check, the schema's revision, and closing.

Every SQL statement the gateway causes is in these repositories; the gateway passes them around, never sessions.
"""

from __future__ import annotations

from sqlalchemy import URL, text

from registry import db
from registry.adapter_store import AdapterStore
from registry.adapters import AdapterRegistry
from registry.api_keys import ApiKeyRepository
from registry.change_marker import change_marker
from registry.tenants import TenantRepository
from registry.usage import UsageRollups


class RegistryDatabase:
    def __init__(self, url: str | URL):
        self.engine = db.create_engine(url)
        sessions = db.sessionmaker(self.engine)
        self.marker = change_marker(url)
        self.adapters = AdapterRegistry(sessions, self.marker)
        self.store = AdapterStore(sessions)  # the adapters' files, by content digest
        self.tenants = TenantRepository(sessions)
        self.api_keys = ApiKeyRepository(sessions)
        self.usage = UsageRollups(sessions)

    async def ping(self) -> None:
        """Raises when the database cannot be reached."""
        async with self.engine.connect() as connection:
            await connection.execute(text("SELECT 1"))

    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (None: never migrated); raises when it cannot be read."""
        async with self.engine.connect() as connection:
            return (await connection.execute(text("SELECT version_num FROM alembic_version"))).scalar()

    async def close(self) -> None:
        if self.marker is not None:
            self.marker.close()
        await self.engine.dispose()
