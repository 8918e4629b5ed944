"""AdapterStore: registered adapters' files in the registry database, addressed by content digest, so that an engine
replica on any machine — which has the database URL and nothing else of the gateway's — can fetch an adapter.

    await store.put(digest, directory)              # at registration, after the engine validated the directory
    path = await store.materialize(digest, cache)   # on a replica: cache/<sha256 hex>/, written once, atomically
    await store.delete_unreferenced(digest)         # after a delete, once no adapter row holds that digest

A digest names the weights, so every name@version with the same weights shares one copy.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from pathlib import Path

from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from registry.models import Adapter, AdapterFile

DIGEST_PATTERN = re.compile(r"sha256:([0-9a-f]{64})")
MAX_FILE_BYTES = 2 * 2**30
COMPLETE_MARKER = ".complete"  # written last into a materialized directory


class AdapterFilesMissing(KeyError):
    """The store holds no files under this digest."""

    def __str__(self) -> str:
        return self.args[0]


def digest_hex(digest: str) -> str:
    """The hex part of a "sha256:<64 hex>" digest; ValueError for anything else (so no path can escape a cache)."""
    match = DIGEST_PATTERN.fullmatch(digest or "")
    if match is None:
        raise ValueError(f"not a content digest: {digest!r} (expected sha256:<64 hex digits>)")
    return match.group(1)


def read_adapter_directory(directory: Path, max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, bytes]:
    """An adapter directory's top-level regular files (no subdirectories, no symlinks), name -> bytes: what the
    store keeps, and what a replica validates before it is kept. ValueError when one is too large or none is there."""
    files = {}
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.is_symlink():
            continue
        size = path.stat().st_size
        if size > max_file_bytes:
            raise ValueError(f"adapter file {path.name!r} is {size} bytes, over the store's {max_file_bytes}")
        files[path.name] = path.read_bytes()
    if not files:
        raise ValueError(f"adapter directory {str(directory)!r} holds no files")
    return files


def _write_directory(files: dict[str, bytes], target: Path) -> Path:
    """Writes into a temporary sibling, then renames it into place; another writer that won the race wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}-", dir=target.parent))
    try:
        for name, content in files.items():
            (staging / name).write_bytes(content)
        (staging / COMPLETE_MARKER).touch()
        try:
            staging.rename(target)
        except OSError:  # the target exists: complete if its writer finished, else ours replaces it
            if not (target / COMPLETE_MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class AdapterStore:
    def __init__(self, sessions: async_sessionmaker, max_file_bytes: int = MAX_FILE_BYTES):
        self.sessions, self.max_file_bytes = sessions, max_file_bytes

    async def has(self, digest: str) -> bool:
        digest_hex(digest)
        async with self.sessions() as session:
            return bool(await session.scalar(select(exists().where(AdapterFile.digest == digest))))

    async def put(self, digest: str, directory: Path) -> int:
        """Stores the directory's top-level files under `digest` unless they are there; returns the bytes stored."""
        digest_hex(digest)
        if await self.has(digest):
            return 0
        files = await asyncio.to_thread(read_adapter_directory, Path(directory), self.max_file_bytes)
        async with self.sessions() as session:
            session.add_all(
                AdapterFile(digest=digest, filename=name, content=content, size_bytes=len(content))
                for name, content in files.items()
            )
            try:
                await session.commit()
            except Exception:
                await session.rollback()
                if await self.has(digest):  # stored meanwhile by another gateway
                    return 0
                raise
        return sum(len(content) for content in files.values())

    async def materialize(self, digest: str, cache_root: Path) -> Path:
        """`cache_root/<hex>`: the adapter's directory, fetched from the database unless it is already there."""
        target = Path(cache_root) / digest_hex(digest)
        if (target / COMPLETE_MARKER).exists():
            return target
        async with self.sessions() as session:
            rows = (await session.execute(select(AdapterFile.filename, AdapterFile.content).where(
                AdapterFile.digest == digest))).all()  # fmt: skip
        if not rows:
            raise AdapterFilesMissing(f"the registry holds no adapter files for {digest}")
        return await asyncio.to_thread(_write_directory, dict(rows), target)

    async def delete_unreferenced(self, digest: str) -> bool:
        """Deletes the digest's files once no adapter row holds that digest; returns whether it did."""
        digest_hex(digest)
        async with self.sessions() as session:
            referenced = await session.scalar(select(func.count()).select_from(Adapter).where(Adapter.digest == digest))
            if referenced:
                return False
            deleted = await session.execute(delete(AdapterFile).where(AdapterFile.digest == digest))
            await session.commit()
        return deleted.rowcount > 0
