"""Database URLs, engines and Alembic upgrades for the registry.

Users give plain URLs (`sqlite:///registry.db`, `postgresql://user@host/db`); the gateway talks to the
database through SQLAlchemy's asyncio layer (aiosqlite, psycopg 3) and Alembic migrates it through the
matching synchronous driver.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg"}
_SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}


def _with_driver(url: str | URL, drivers: dict[str, str]) -> URL:
    url = make_url(url)
    backend = url.get_backend_name()
    if backend not in drivers:
        raise ValueError(
            f"unsupported database URL {url.render_as_string(hide_password=True)!r}: use sqlite or postgresql"
        )
    return url.set(drivername=drivers[backend])


def async_url(url: str | URL) -> URL:
    return _with_driver(url, _ASYNC_DRIVERS)


def sync_url(url: str | URL) -> URL:
    return _with_driver(url, _SYNC_DRIVERS)


def create_engine(url: str | URL) -> AsyncEngine:
    url = async_url(url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return create_async_engine(url, pool_pre_ping=url.get_backend_name() != "sqlite")


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Applies the Alembic migrations up to `revision` (idempotent; safe for several processes at once on
    PostgreSQL, where Alembic takes a transactional DDL lock)."""
    from alembic import command
    from alembic.config import Config

    url = sync_url(url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["url"] = url
    command.upgrade(config, revision)
    logger.info("registry database %s is at revision %s", url.render_as_string(hide_password=True), revision)
