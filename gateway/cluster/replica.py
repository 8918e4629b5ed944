"""EngineReplica: one engine (the base model loaded once, its adapter tiers, its KV cache) as a Ray Serve replica.

The ingress reaches it only through a Ray Serve handle (gateway/cluster/remote_engine.py). Adapters are Ray Serve
multiplexed models keyed by the registry's `name@version`: Ray routes a request to a replica that already holds its
adapter when one can take it, and this replica's multiplexed loader brings an adapter in by content digest — the
files come from the registry database into a local cache directory (`adapter_cache_dir/<sha256 hex>`), then the
engine reads them into host memory and a device row. Ray's LRU eviction (at `max_cpu_loras` adapters) is the
engine's `remove_adapter`: the device row is freed when the requests still using it end.

A replica serves every adapter whatever the routing: a request whose adapter is not resident here loads it here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve

from engine.interface import AdapterError, AdapterInfo, AsyncEngine, EngineRequest, LoRARequest, RequestOutput, Tier
from gateway.cluster.ready_batches import ready_batches
from gateway.cluster.replica_stats import ReplicaStats
from gateway.settings import ServeSettings
from registry.adapter_store import COMPLETE_MARKER, AdapterFilesMissing, digest_hex
from registry.database import RegistryDatabase

logger = logging.getLogger(__name__)


def default_adapter_cache_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "loraplex" / "adapters"


class ResidentAdapter:
    """An adapter this replica holds: its local copy (content-addressed) and the engine's tiers. Ray's multiplexing
    LRU owns these objects and calls `__del__` on the one it evicts."""

    def __init__(self, replica: EngineReplica, lora: LoRARequest):
        self.replica, self.lora = replica, lora
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.current_thread()
        self.released = False

    @property
    def digest(self) -> str | None:
        return self.lora.digest

    def __del__(self) -> None:
        # Ray calls this on a worker thread when its LRU evicts the adapter; the garbage collector may call it
        # again later (then it does nothing)
        if self.released:
            return
        self.released = True
        if self._loop.is_closed():
            return
        future = asyncio.run_coroutine_threadsafe(self.replica.release(self), self._loop)
        if threading.current_thread() is not self._loop_thread:  # never block the loop the release runs on
            try:
                future.result(timeout=30)
            except Exception:  # the loop is gone or the engine stopped: nothing is left to free
                logger.debug("releasing adapter '%s' failed", self.lora.adapter_id, exc_info=True)


class EngineReplica:
    """The deployment class (options are set by gateway/cluster/serve_app.py). Every public coroutine here is
    called through a Ray Serve handle."""

    def __init__(self, settings: ServeSettings, model_dir: str):
        if settings.cpu_threads is None:  # the replica's share of the machine, not the whole machine
            settings = settings.model_copy(update={"cpu_threads": max(1, int(settings.replica_num_cpus))})
        self.settings = settings
        config = settings.engine_config(model_dir, enable_lora=True)
        self.engine = AsyncEngine.from_config(config)
        self.database = RegistryDatabase(settings.database_url)
        self.cache_dir = Path(settings.adapter_cache_dir or default_adapter_cache_dir())
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.residents: dict[str, ResidentAdapter] = {}
        self.requests_by_adapter: Counter[str] = Counter()  # requests this replica ran, by adapter id ("" = base)
        self.files_fetched = 0  # adapters materialized from the registry database
        self._expected: dict[str, str | None] = {}  # adapter id -> the digest the caller about to load it wants
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()

        # Ray's per-replica LRU of adapters follows the engine's host tier (max_cpu_loras, resolved by the config);
        # Ray keeps its LRU on the decorated function, so it gets one of its own (a bound method takes no attribute)
        async def load_resident(adapter_id: str) -> ResidentAdapter:
            return await self._load_resident_by_id(adapter_id)

        self._resident = serve.multiplexed(max_num_models_per_replica=config.max_cpu_loras)(load_resident)
        logger.info("engine replica %s ready (model %s, pid %d)", self.replica_id, model_dir, os.getpid())

    # ---- description -----------------------------------------------------------------------------------
    async def describe(self) -> dict:
        """What the ingress needs to encode prompts: the tokenizer (pickled by Ray) and the context length."""
        return {"tokenizer": self.engine.tokenizer, "max_model_len": self.engine.max_model_len}

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.engine.is_alive:
            raise RuntimeError("the engine thread has stopped")

    # ---- requests ---------------------------------------------------------------------------------------
    async def validate(self, request: EngineRequest) -> None:
        await self.engine.validate(request)

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        """The request's deltas, in lists of those ready at once (gateway/cluster/ready_batches.py). A cancelled call
        (the client went away) aborts the request in the engine."""
        lora = request.lora
        if lora is not None:
            request = dataclasses.replace(request, lora=await self._local(lora))
        self.requests_by_adapter[lora.adapter_id if lora else ""] += 1
        async for batch in ready_batches(self.engine.generate(request)):
            yield batch

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    # ---- adapters -----------------------------------------------------------------------------------------
    async def _load_resident_by_id(self, adapter_id: str) -> ResidentAdapter:
        """Ray's multiplexed loader: the adapter's files from the registry (by the digest the caller asked for),
        then host memory and a device row."""
        digest = self._expected.get(adapter_id)
        if digest is None:
            raise ValueError(f"adapter '{adapter_id}' was asked for without its content digest")
        resident = ResidentAdapter(self, await self._materialized(adapter_id, digest))
        await self.engine.load_adapter(resident.lora)
        self.residents[adapter_id] = resident
        return resident

    async def _materialized(self, adapter_id: str, digest: str) -> LoRARequest:
        """The adapter's directory in this replica's cache, fetched from the registry database the first time."""
        fetching = not (self.cache_dir / digest_hex(digest) / COMPLETE_MARKER).exists()
        try:
            directory = await self.database.store.materialize(digest, self.cache_dir)
        except AdapterFilesMissing:  # registered before the registry kept files (or its files were deleted)
            raise AdapterError(
                f"adapter '{adapter_id}': the registry holds no files for {digest[:19]}; register it again"
            ) from None
        if fetching:
            self.files_fetched += 1
            logger.info("adapter '%s' (%s) fetched from the registry into %s", adapter_id, digest[:19], directory)
        return LoRARequest(adapter_id, str(directory), digest)

    async def _local(self, lora: LoRARequest) -> LoRARequest:
        """The LoRARequest this replica runs for the caller's: its resident copy, loaded (or refreshed: the same
        name@version registered again with other weights) as needed."""
        if lora.digest is None:
            raise ValueError(f"adapter '{lora.adapter_id}' was sent to a replica without its content digest")
        self._expected[lora.adapter_id] = lora.digest
        resident = await self._resident(lora.adapter_id)
        if resident.digest != lora.digest or resident.released:
            await self.engine.remove_adapter(resident.lora)
            resident.lora = await self._materialized(lora.adapter_id, lora.digest)
            resident.released = False
            await self.engine.load_adapter(resident.lora)
            self.residents[lora.adapter_id] = resident
        return resident.lora

    async def release(self, resident: ResidentAdapter) -> None:
        """Ray evicted the adapter (or an admin removed it): the engine forgets it."""
        if self.residents.get(resident.lora.adapter_id) is resident:
            del self.residents[resident.lora.adapter_id]
        await self.engine.remove_adapter(resident.lora)
        logger.info("adapter '%s' released from replica %s", resident.lora.adapter_id, self.replica_id)

    async def add_adapter_files(self, adapter_id: str, files: dict[str, bytes]) -> AdapterInfo:
        """Validates an adapter sent as its files (registration, from the ingress's disk) with the engine's own
        checks, in a scratch directory; nothing of it is kept (replicas fetch registered adapters by digest)."""
        staging = Path(tempfile.mkdtemp(prefix=".validating-", dir=self.cache_dir))
        try:
            for name, content in files.items():
                if Path(name).name != name or name.startswith("."):
                    raise AdapterError(f"adapter file name {name!r} is not a plain file name")
                (staging / name).write_bytes(content)
            staged = LoRARequest(adapter_id, str(staging))
            info = await self.engine.add_adapter(staged)
            await self.engine.remove_adapter(staged)
            return info
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def load_adapter(self, lora: LoRARequest) -> Tier:
        """An admin's `load`: this replica (the one Ray routed the adapter to) makes it resident."""
        return await self.engine.load_adapter(await self._local(lora))

    async def remove_adapter(self, adapter_id: str) -> bool:
        """Broadcast on delete / unload / re-register: forgets the adapter; returns whether requests still run on
        it here (its device row is freed when they end)."""
        resident = self.residents.pop(adapter_id, None)
        if resident is None:
            return False
        resident.released = True  # the multiplexing LRU may still list it: the next use reloads
        return await self.engine.remove_adapter(resident.lora)

    async def tier(self, adapter_id: str) -> Tier:
        resident = self.residents.get(adapter_id)
        return "disk" if resident is None else await self.engine.tier(resident.lora)

    # ---- state -----------------------------------------------------------------------------------------------
    async def stats(self) -> ReplicaStats:
        return ReplicaStats(
            replica_id=self.replica_id,
            actor_name=self.actor_name,
            pid=os.getpid(),
            resident_adapters=tuple(sorted(self.residents)),
            requests_by_adapter=dict(self.requests_by_adapter),
            adapter_files_fetched=self.files_fetched,
            engine=await self.engine.stats(),
        )

    async def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica
        await asyncio.to_thread(self.engine.shutdown)
        await self.database.close()
