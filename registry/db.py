"""Database URLs, engines and Alembic upgrades for the registry.

Users give plain URLs (`sqlite:///registry.db`, `postgresql://user@host/db`); the gateway talks to the
database through SQLAlchemy's asyncio layer (aiosqlite, psycopg 3) and Alembic migrates it through the
matching synchronous driver.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import URL, Connection, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg"}
_SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}
MIGRATION_LOCK_KEY = 0x6C6F7261706C6578  # pg_advisory_lock key ("loraplex"): one migrating process at a time


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


def _alembic_config():
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    """The newest migration's revision id."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


@contextmanager
def migration_lock(connection: Connection) -> Iterator[None]:
    """On PostgreSQL, holds a session advisory lock on `connection` (the one that migrates) while migrating, so
    replicas starting at once migrate one after another: the later ones find the schema at head and do nothing.
    Nothing on SQLite (one host; its writes are serialized by the file lock)."""
    if connection.dialect.name != "postgresql":
        yield
        return
    connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    connection.commit()  # the lock is the session's; Alembic then runs its own transaction
    try:
        yield
    finally:
        connection.rollback()  # a failed migration leaves an aborted transaction behind
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
        connection.commit()


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Applies the Alembic migrations up to `revision`: idempotent, and safe for several processes at once on
    PostgreSQL (migrations/env.py migrates under `migration_lock`)."""
    from alembic import command

    url = sync_url(url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    config = _alembic_config()
    config.attributes["url"] = url
    command.upgrade(config, revision)
    logger.info("registry database %s is at revision %s", url.render_as_string(hide_password=True), revision)
