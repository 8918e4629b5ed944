"""The registry's adapter file store on SQLite and a real PostgreSQL: files round-trip byte for byte by content
digest, are stored once, materialize atomically into a cache (concurrently too, and without the database once
there), unknown and malformed digests are refused, and files go when no adapter row holds their digest. Through
the gateway: registering stores the files, deleting the last holder removes them."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx
import pytest

from registry import db
from registry.adapter_store import COMPLETE_MARKER, AdapterFilesMissing, digest_hex
from registry.database import RegistryDatabase
from registry.models import Adapter
from tests.gateway_server import ADMIN_KEY, ServerThread, build_tiny, settings_for

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def migrated(registry_url):
    db.upgrade(registry_url)
    return registry_url


def adapter_dir(tmp_path, seed: bytes):
    directory = tmp_path / seed.decode()
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(seed * 5000 + bytes(range(256)))
    (directory / "nested").mkdir()  # not part of a PEFT directory's top level
    (directory / "nested" / "ignored.bin").write_bytes(b"x")
    return directory, f"sha256:{hashlib.sha256(seed).hexdigest()}"


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != COMPLETE_MARKER}


def run(coro):
    return asyncio.run(coro)


def test_files_round_trip_once_and_materialize_atomically(migrated, tmp_path):
    source, digest = adapter_dir(tmp_path, b"one")
    cache = tmp_path / "cache"

    async def scenario():
        database = RegistryDatabase(migrated)
        try:
            store = database.store
            assert not await store.has(digest)
            stored = await store.put(digest, source)
            assert stored == sum(len(c) for c in files_of(source).values())
            assert await store.put(digest, source) == 0  # stored once
            assert await store.has(digest)
            # two replicas of one machine at once: both get the complete directory
            first, second = await asyncio.gather(store.materialize(digest, cache), store.materialize(digest, cache))
            assert first == second == cache / digest_hex(digest)
            assert files_of(first) == files_of(source) and not (first / "nested").exists()
            with pytest.raises(AdapterFilesMissing, match="no adapter files"):
                await store.materialize(f"sha256:{'0' * 64}", cache)
            for bad in ("../../etc", "sha256:zz", "sha256:" + "a" * 63, f"md5:{'a' * 64}"):
                with pytest.raises(ValueError, match="not a content digest"):
                    await store.materialize(bad, cache)
        finally:
            await database.close()
        # once there, it needs no database
        closed = RegistryDatabase("sqlite:////nonexistent/dir/registry.db")
        assert await closed.store.materialize(digest, cache) == first

    run(scenario())


def test_a_half_written_copy_is_replaced(migrated, tmp_path):
    source, digest = adapter_dir(tmp_path, b"two")
    cache = tmp_path / "cache"
    torn = cache / digest_hex(digest)
    torn.mkdir(parents=True)
    (torn / "adapter_config.json").write_text("{")  # a writer died before finishing

    async def scenario():
        database = RegistryDatabase(migrated)
        try:
            await database.store.put(digest, source)
            path = await database.store.materialize(digest, cache)
        finally:
            await database.close()
        assert files_of(path) == files_of(source)

    run(scenario())


def test_files_go_once_no_adapter_row_holds_their_digest(migrated, tmp_path):
    source, digest = adapter_dir(tmp_path, b"three")

    async def scenario():
        database = RegistryDatabase(migrated)
        try:
            store, registry = database.store, database.adapters
            await store.put(digest, source)
            row = dict(path=str(source), base_model="b", rank=8, alpha=16.0, target_modules=["q_proj"], digest=digest)
            await registry.add(Adapter(name="kept", version="1", size_bytes=1, **row))
            assert not await store.delete_unreferenced(digest)  # still held
            assert await store.has(digest)
            await registry.delete("kept", None, "*")
            assert await store.delete_unreferenced(digest)
            assert not await store.has(digest)
        finally:
            await database.close()

    run(scenario())


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer, registry_url):
    root, _, adapters = build_tiny(tmp_path_factory.mktemp("store"), tokenizer, {"stored": 8, "twin": 8})
    settings = settings_for(root, {}, database_url=registry_url, adapter_root=[str(root / "adapters")])
    with ServerThread(settings) as running:
        running.adapters = adapters
        yield running


def test_registering_stores_the_files_and_deleting_removes_them(server, tmp_path):
    source = server.adapters["stored"]
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as http:
        row = http.post("/admin/adapters", json={"name": "stored", "path": source}).json()
        again = http.post("/admin/adapters", json={"name": "stored-again", "path": source}).json()
        assert again["digest"] == row["digest"]  # the same weights: one copy in the store

        copy = run(with_store(server, lambda store: store.materialize(row["digest"], tmp_path / "cache")))
        assert files_of(copy) == files_of(Path(source))
        assert http.delete("/admin/adapters/stored").status_code == 200
        assert run(with_store(server, lambda store: store.has(row["digest"])))  # stored-again still holds it
        assert http.delete("/admin/adapters/stored-again").status_code == 200
        assert not run(with_store(server, lambda store: store.has(row["digest"])))


async def with_store(server, call):
    database = RegistryDatabase(server.state.settings.database_url)
    try:
        return await call(database.store)
    finally:
        await database.close()
