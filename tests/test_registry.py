"""The registry on SQLite and on a real PostgreSQL: migrations, name@version uniqueness, latest version,
tenant visibility, deletion; the tenant and API-key repositories; and the gateway holding no SQL of its own."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import multiprocessing
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import event, inspect

from registry import db
from registry.adapters import ALL_TENANTS, AdapterExists, AdapterRegistry, check_name, split_adapter_id
from registry.change_marker import change_marker
from registry.database import RegistryDatabase
from registry.models import Adapter, Tenant
from registry.tenants import TenantExists


def row(name: str, version: str, owner: str | None = None) -> Adapter:
    return Adapter(
        name=name,
        version=version,
        path=f"/adapters/{name}/{version}",
        base_model="base",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj", "v_proj"],
        digest=f"sha256:{name}{version}",
        size_bytes=1234,
        owner=owner,
    )


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def migrated(registry_url):
    db.upgrade(registry_url)
    db.upgrade(registry_url)  # idempotent
    return registry_url


async def _with_registry(url, fn):
    engine = db.create_engine(url)
    try:
        return await fn(AdapterRegistry(db.sessionmaker(engine)), db.sessionmaker(engine))
    finally:
        await engine.dispose()


def test_migrations_create_every_table(migrated):
    from sqlalchemy import create_engine

    engine = create_engine(db.sync_url(migrated))
    with engine.connect() as connection:
        tables = set(inspect(connection).get_table_names())
    engine.dispose()
    assert {"adapters", "tenants", "api_keys", "usage_rollups", "alembic_version"} <= tables


def test_versions_latest_visibility_and_delete(migrated):
    async def scenario(registry: AdapterRegistry, sessions):
        async with sessions() as session:
            session.add_all([Tenant(name="acme"), Tenant(name="globex")])
            await session.commit()
        await registry.add(row("sql", "1"))
        await registry.add(row("sql", "2"))
        await registry.add(row("secret", "1", owner="acme"))
        with pytest.raises(AdapterExists):
            await registry.add(row("sql", "2"))
        assert await registry.next_version("sql") == "3"
        assert await registry.next_version("new") == "1"
        assert (await registry.get("sql", None, None)).version == "2"  # latest
        assert (await registry.get("sql", "1", None)).version == "1"
        # visibility: public for all, private for its owner and the admin only
        assert await registry.get("secret", None, None) is None
        assert await registry.get("secret", None, "globex") is None
        assert (await registry.get("secret", None, "acme")).owner == "acme"
        assert [a.name for a in await registry.list("acme", latest_only=True)] == ["secret", "sql"]
        assert [a.adapter_id for a in await registry.list("globex")] == ["sql@1", "sql@2"]
        assert await registry.delete("secret", None, "globex") == []  # cannot delete what it cannot see
        deleted = await registry.delete("sql", "1", ALL_TENANTS)
        assert [a.adapter_id for a in deleted] == ["sql@1"]
        assert [a.adapter_id for a in await registry.list(ALL_TENANTS)] == ["secret@1", "sql@2"]
        await registry.add(row("sql", "1"))  # a deleted name@version may be registered again
        assert len(await registry.delete("sql", None, ALL_TENANTS)) == 2
        assert await registry.get("sql", None, ALL_TENANTS) is None

    run(_with_registry(migrated, scenario))


def _upgrade_together(url: str, barrier) -> None:
    barrier.wait(timeout=60)
    db.upgrade(url)


def test_replicas_upgrading_a_fresh_postgresql_at_once_migrate_it_once():
    """Two processes start on an empty database at the same moment: both succeed (the advisory lock makes the second
    wait, then find the schema at head), and the schema is at head once."""
    from sqlalchemy import create_engine, text

    from tests.services import create_database, drop_database, ensure_postgres

    url = create_database(ensure_postgres())
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    replicas = [spawn.Process(target=_upgrade_together, args=(url, barrier)) for _ in range(2)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.join(timeout=120)
        assert [replica.exitcode for replica in replicas] == [0, 0]
        engine = create_engine(db.sync_url(url))
        with engine.connect() as connection:
            versions = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            tables = set(inspect(connection).get_table_names())
        engine.dispose()
        assert versions == [db.head_revision()]
        assert {"adapters", "tenants", "api_keys", "usage_rollups"} <= tables
    finally:
        for replica in replicas:
            replica.kill()
        drop_database(url)


@pytest.mark.parametrize("name", ["", "a b", "x/y", "-lead", "a@b", "é", "n" * 129])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="invalid adapter name"):
        check_name(name)


def test_adapter_id_splits_at_the_last_at():
    assert split_adapter_id("sql@2") == ("sql", "2")
    assert split_adapter_id("sql") == ("sql", None)
    assert split_adapter_id("@x") == ("@x", None)


def test_tenants_and_api_keys(migrated):
    async def scenario():
        database = RegistryDatabase(migrated)
        try:
            await database.ping()
            tenants, keys = database.tenants, database.api_keys
            await tenants.add(Tenant(name="initech", requests_per_minute=5))
            with pytest.raises(TenantExists):
                await tenants.add(Tenant(name="initech"))
            changed = await tenants.update("initech", {"requests_per_minute": None, "token_quota": 100})
            assert (changed.requests_per_minute, changed.token_quota) == (None, 100)
            assert await tenants.update("nobody", {"token_quota": 1}) is None
            assert "initech" in [t.name for t in await tenants.list()]
            first = await keys.add("initech", prefix="lpx-aaaa", key_hash="a" * 64)
            second = await keys.add("initech", prefix="lpx-bbbb", key_hash="b" * 64)
            assert (await keys.active("a" * 64)).tenant == "initech"
            assert await keys.revoke("someone-else", first.id) is None  # not that tenant's key
            revoked = await keys.revoke("initech", first.id)
            assert revoked.revoked_at is not None
            again = await keys.revoke("initech", first.id)  # keeps its first revocation time (SQLite drops the zone)
            assert again.revoked_at.replace(tzinfo=None) == revoked.revoked_at.replace(tzinfo=None)
            assert await keys.active("a" * 64) is None
            assert [k.id for k in await keys.list("initech")] == [first.id, second.id]
            await database.adapters.add(row("initech-private", "1", owner="initech"))
            await tenants.delete("initech")  # with its keys and private adapters
            assert await tenants.get("initech") is None and await keys.list("initech") == []
            assert await keys.active("b" * 64) is None
            assert await database.adapters.get("initech-private", None, ALL_TENANTS) is None
        finally:
            await database.close()

    run(scenario())


def test_the_gateway_holds_no_sql():
    """Every query is a registry repository's: no module under gateway/ imports SQLAlchemy or opens a session."""
    gateway = Path(__file__).resolve().parent.parent / "gateway"
    offenders = []
    for path in sorted(gateway.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(name.split(".")[0] == "sqlalchemy" for name in names):
                offenders.append(f"{path.relative_to(gateway.parent)}:{node.lineno} imports sqlalchemy")
            if isinstance(node, ast.Attribute) and node.attr in ("sessions", "sessionmaker", "execute", "scalars"):
                offenders.append(f"{path.relative_to(gateway.parent)}:{node.lineno} uses .{node.attr}")
    assert not offenders, offenders


@contextlib.asynccontextmanager
async def _two_gateways(url: str):
    """Two gateways' registries on one migrated SQLite file, and the statements the first one sends."""
    here, replica = RegistryDatabase(url), RegistryDatabase(url)
    statements = []
    event.listen(here.engine.sync_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    try:
        yield here, replica, statements
    finally:
        await here.close()
        await replica.close()


def test_a_sqlite_registry_keeps_resolved_adapters_until_any_connection_commits(tmp_path):
    """Two gateways on one SQLite file: lookups are answered without SQL while nothing changed, and a delete or a
    re-register by the other one is seen by the very next lookup."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)

    async def scenario():
        async with _two_gateways(url) as (here, replica, statements):
            await replica.tenants.add(Tenant(name="acme"))
            await replica.adapters.add(row("sql", "1"))
            await replica.adapters.add(row("mine", "1", owner="acme"))
            assert (await here.adapters.get("sql", None, None)).digest == "sha256:sql1"
            assert (await here.adapters.get("mine", "1", "acme")).owner == "acme"
            queried = len(statements)
            for _ in range(3):
                assert (await here.adapters.get("sql", None, None)).digest == "sha256:sql1"
                assert (await here.adapters.get("mine", "1", "acme")).owner == "acme"
            assert len(statements) == queried  # answered from what was resolved
            assert await here.adapters.get("mine", "1", None) is None  # another caller's view is its own lookup

            await replica.adapters.delete("sql", None, ALL_TENANTS)
            assert await here.adapters.get("sql", None, None) is None
            swapped = row("sql", "1")
            swapped.digest = "sha256:new-weights"
            await replica.adapters.add(swapped)
            assert (await here.adapters.get("sql", "1", None)).digest == "sha256:new-weights"
            await here.adapters.delete("mine", None, ALL_TENANTS)  # this process's own writes count too
            assert await here.adapters.get("mine", "1", "acme") is None

    run(scenario())


def test_a_burst_of_lookups_of_one_adapter_makes_one_query(migrated):
    """64 requests naming one adapter at once: one query answers them all (on PostgreSQL too, which keeps nothing
    between lookups), each caller's tenant view apart, and a caller that goes away does not fail the others."""

    async def scenario():
        database = RegistryDatabase(migrated)
        selects = []
        event.listen(
            database.engine.sync_engine,
            "before_cursor_execute",
            lambda *args: selects.append(args[2]) if args[2].lstrip().startswith("SELECT") else None,
        )
        try:
            await database.tenants.add(Tenant(name="acme-burst"))
            await database.adapters.add(row("burst", "1"))
            await database.adapters.add(row("burst", "2", owner="acme-burst"))
            selects.clear()
            impatient = asyncio.ensure_future(database.adapters.get("burst", None, None))
            await asyncio.sleep(0)  # its lookup has started
            found = await asyncio.gather(
                *(database.adapters.get("burst", None, None) for _ in range(63)),
                *(database.adapters.get("burst", None, "acme-burst") for _ in range(8)),
            )
            impatient.cancel()
            assert {a.version for a in found[:63]} == {"1"} and {a.version for a in found[63:]} == {"2"}
            assert len(selects) == 2  # one per tenant view
        finally:
            await database.adapters.delete("burst", None, ALL_TENANTS)
            await database.close()

    run(scenario())


def test_a_lookup_started_before_a_commit_answers_no_one_who_came_after_it(tmp_path):
    """On SQLite, a lookup is shared only while the change marker reads the same: a request that arrives after
    another connection committed queries again."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)

    async def scenario():
        async with _two_gateways(url) as (here, replica, statements):
            await replica.adapters.add(row("moving", "1"))
            earlier = asyncio.ensure_future(here.adapters.get("moving", None, None))
            await asyncio.sleep(0)  # its lookup is in flight under the marker of that moment
            with sqlite3.connect(tmp_path / "registry.db") as other:  # a commit by another process, at once
                other.execute("DELETE FROM adapters WHERE name = 'moving'")
            assert await here.adapters.get("moving", None, None) is None
            await earlier
            assert len(statements) == 2

    run(scenario())


def test_only_a_sqlite_file_has_a_change_marker():
    assert change_marker("sqlite:///registry.db") is not None
    for url in ("postgresql://loraplex@127.0.0.1/registry", "sqlite://", "sqlite:///:memory:"):
        assert change_marker(url) is None, url
