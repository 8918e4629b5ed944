"""RemoteEngine: the AsyncEngine surface the gateway uses, served by the EngineReplica deployment through a Ray Serve
handle. The gateway cannot tell it from a local engine.

Routing: a request with an adapter carries the adapter's registry key (`name@version`) as Ray Serve's multiplexed
model id, so Ray prefers a replica that holds it, then the one holding the fewest adapters; a base-model request goes
to the least-loaded replica. Adapter administration (remove, unload, tier, stats) is broadcast to every replica.

Faults: when the replica running a request dies before the request streamed anything, the request runs again on
another replica (up to `attempts` times); once it has streamed, the caller gets `ReplicaLost` (an EngineStopped: the
gateway ends the stream with an error event, and usage counts what was delivered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError

from engine.interface import (
    AdapterError,
    AdapterInfo,
    EngineRequest,
    EngineSnapshot,
    EngineStopped,
    LoRARequest,
    RequestOutput,
    Tier,
)
from gateway.cluster.replica_stats import ReplicaStats
from registry.adapter_store import read_adapter_directory

logger = logging.getLogger(__name__)
REPLICA_LOST = (RayActorError, WorkerCrashedError, ReplicaUnavailableError)
TIER_ORDER: tuple[Tier, ...] = ("device", "host", "loading", "failed", "disk")


class ReplicaLost(EngineStopped):
    """The replica running a request died after the request had streamed output."""


def unwrapped(error: BaseException) -> BaseException:
    """The replica's own exception (ValueError, AdapterError, ...) out of Ray's wrapper."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


def read_adapter_files(path: str) -> dict[str, bytes]:
    """A PEFT directory's files as the registry's store will keep them, to send to a replica for validation."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {path!r} does not exist")
    try:
        return read_adapter_directory(directory)
    except ValueError as e:
        raise AdapterError(str(e)) from None


def merged_snapshot(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """The cluster's engine numbers: counts summed over replicas, adapter ids merged."""
    first = snapshots[0]
    numbers = [f.name for f in dataclasses.fields(EngineSnapshot) if isinstance(getattr(first, f.name), int | float)]
    summed = {name: sum(getattr(s, name) for s in snapshots) for name in numbers}
    service: dict[str, float] = {}
    for s in snapshots:
        for tenant, tokens in s.tenant_service.items():
            service[tenant] = service.get(tenant, 0.0) + tokens
    return EngineSnapshot(
        **summed,
        adapters_on_device=tuple(sorted({a for s in snapshots for a in s.adapters_on_device})),
        adapters_on_host=tuple(sorted({a for s in snapshots for a in s.adapters_on_host})),
        tenant_service=service,
    )


class RemoteEngine:
    def __init__(self, handle, tokenizer, max_model_len: int, route_by_adapter: bool = True, attempts: int = 3):
        self._handle, self.tokenizer, self.max_model_len = handle, tokenizer, max_model_len
        self.route_by_adapter, self.attempts = route_by_adapter, attempts

    @classmethod
    async def connect(cls, handle, route_by_adapter: bool = True) -> RemoteEngine:
        description = await cls._call(handle.describe)
        return cls(handle, description["tokenizer"], description["max_model_len"], route_by_adapter)

    @property
    def is_alive(self) -> bool:
        return True  # Ray Serve restarts a replica that dies; the ingress itself keeps serving

    def shutdown(self) -> None:
        pass  # the replicas are Ray Serve's: `serve shutdown` (or the launcher) stops them

    # ---- calls -------------------------------------------------------------------------------------------
    @staticmethod
    async def _call(method, *args, attempts: int = 3):
        """One replica's answer; retried on another replica when the one chosen died."""
        for attempt in range(attempts):
            try:
                return await method.remote(*args)
            except REPLICA_LOST:
                if attempt == attempts - 1:
                    raise
                logger.warning("a replica died during a call; retrying on another")
            except RayTaskError as e:
                raise unwrapped(e) from None

    async def _broadcast(self, method: str, *args) -> list:
        """Every live replica's answer (a replica that dies meanwhile is skipped)."""
        results = await self._handle.broadcast(method, *args).results_async(return_exceptions=True)
        answers = []
        for result in results:
            if isinstance(result, REPLICA_LOST):
                continue
            if isinstance(result, BaseException):
                raise unwrapped(result)
            answers.append(result)
        return answers

    def _routed(self, lora: LoRARequest | None, **options):
        if lora is not None and self.route_by_adapter:
            options["multiplexed_model_id"] = lora.adapter_id
        return self._handle.options(**options) if options else self._handle

    # ---- requests ----------------------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        for attempt in range(self.attempts):
            stream = self._routed(request.lora, stream=True).generate.remote(request)
            streamed = finished = False
            try:
                async for batch in stream:  # the deltas ready at once on the replica
                    for out in batch:
                        streamed, finished = True, out.finished
                        yield out
                return
            except REPLICA_LOST as e:
                if streamed:
                    raise ReplicaLost(f"the replica running this request stopped: {type(e).__name__}") from None
                if attempt == self.attempts - 1:
                    raise ReplicaLost(f"no replica could run this request: {type(e).__name__}") from None
                logger.warning("request %s: its replica died before it streamed; retrying", request.request_id)
            except RayTaskError as e:
                raise unwrapped(e) from None
            except (RequestCancelledError, TaskCancelledError):
                raise asyncio.CancelledError from None
            finally:
                if not finished:
                    stream.cancel()  # the replica aborts the request (a client that went away)

    async def abort(self, request_id: str) -> None:
        await self._broadcast("abort", request_id)

    async def validate(self, request: EngineRequest) -> None:
        await self._call(self._handle.validate, request, attempts=self.attempts)

    # ---- adapters -----------------------------------------------------------------------------------------------
    async def add_adapter(self, lora: LoRARequest) -> AdapterInfo:
        """Validation at registration: the files go to one replica, which runs the engine's own checks."""
        files = await asyncio.to_thread(read_adapter_files, lora.path)
        info = await self._call(self._handle.add_adapter_files, lora.adapter_id, files, attempts=self.attempts)
        return info

    async def load_adapter(self, lora: LoRARequest) -> Tier:
        return await self._call(self._routed(lora).load_adapter, lora, attempts=self.attempts)

    async def remove_adapter(self, lora: LoRARequest) -> bool:
        return any(await self._broadcast("remove_adapter", lora.adapter_id))

    async def unload_adapter(self, lora: LoRARequest) -> bool:
        return await self.remove_adapter(lora)

    async def tier(self, lora: LoRARequest) -> Tier:
        """The best tier any replica holds the adapter in."""
        tiers = await self._broadcast("tier", lora.adapter_id)
        return min(tiers, key=TIER_ORDER.index, default="disk")

    async def digest(self, lora: LoRARequest) -> str | None:
        return None  # replicas keep adapters under their content digest: a changed adapter is another copy

    # ---- state ----------------------------------------------------------------------------------------------
    async def replica_stats(self) -> list[ReplicaStats]:
        return sorted(await self._broadcast("stats"), key=lambda s: s.replica_id)

    async def stats(self) -> EngineSnapshot:
        return merged_snapshot([s.engine for s in await self.replica_stats()])


def engine_handle(app_name: str):
    """The engine deployment's handle, from inside the application (the ingress replica)."""
    return serve.get_deployment_handle("EngineReplica", app_name=app_name)
