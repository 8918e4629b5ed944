"""Alembic environment: migrates the URL that `registry.db.upgrade` hands over (a synchronous driver), on
PostgreSQL under an advisory lock so that replicas starting at once migrate once."""

from alembic import context
from sqlalchemy import create_engine, pool

from registry.db import migration_lock
from registry.models import Base

config = context.config
url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection, migration_lock(connection):
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
