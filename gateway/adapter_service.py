"""AdapterService: the gateway's adapter plane, joining the registry (what exists) and the engine's adapter
tiers (what is loaded), the latter only through AsyncEngine's adapter verbs.

Registering validates the adapter with the engine's own checks before a row is written; resolving turns a
request's `model` / `lora_request` into the `LoRARequest` the engine runs (`name@version` + path); deleting
removes the row at once and frees the device row when the requests still using it finish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.interface import AdapterError, AdapterInfo, AsyncEngine, LoRARequest, Tier
from gateway.adapter_roots import AdapterRoots
from gateway.errors import APIError, model_not_found
from registry.adapter_store import AdapterStore
from registry.adapters import ALL_TENANTS, AdapterExists, AdapterRegistry, check_name, split_adapter_id
from registry.models import Adapter

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelChoice:
    """What a request runs on: the base alone (adapter None) or one registered adapter."""

    model: str  # the name echoed back in responses
    adapter: Adapter | None

    @property
    def lora(self) -> LoRARequest | None:
        return None if self.adapter is None else lora_request(self.adapter)

    @property
    def adapter_path(self) -> str | None:
        """Where the adapter's files are (its own chat template may be among them); None for the base."""
        return None if self.adapter is None else self.adapter.path

    @property
    def adapter_name(self) -> str:
        """The usage key: the adapter's name, "" for the base model."""
        return "" if self.adapter is None else self.adapter.name


def lora_request(adapter: Adapter) -> LoRARequest:
    return LoRARequest(adapter.adapter_id, adapter.path, adapter.digest)


class AdapterService:
    def __init__(
        self,
        registry: AdapterRegistry,
        engine: AsyncEngine,
        roots: AdapterRoots,
        base_model: str,
        store: AdapterStore | None = None,
    ):
        self.registry, self.engine, self.roots, self.base_model = registry, engine, roots, base_model
        self.store = store  # the adapters' files by digest, for replicas elsewhere (None: paths only)

    # ---- registering ----------------------------------------------------------------------------------
    async def validate(self, adapter_id: str, path: Path) -> AdapterInfo:
        """The engine's full checks (base shapes, rank, modules, formats), off the event loop; 422 naming the
        problem. A valid adapter stays in host memory: warm for its first request."""
        try:
            return await self.engine.add_adapter(LoRARequest(adapter_id, str(path)))
        except AdapterError as e:
            raise APIError(422, str(e), param="path", code="invalid_adapter") from None

    async def register(
        self,
        name: str,
        path: str,
        version: str | None = None,
        description: str | None = None,
        owner: str | None = None,
    ) -> Adapter:
        for value, what in ((name, "name"), (version, "version")):
            if value is not None:
                try:
                    check_name(value, what)
                except ValueError as e:
                    raise APIError(422, str(e), param=what) from None
        if name == self.base_model:
            raise APIError(422, f"'{name}' is the base model's name", param="name")
        resolved = self.roots.resolve(path)
        if version is not None and await self.registry.get(name, version, ALL_TENANTS) is not None:
            raise APIError(409, f"adapter '{name}@{version}' is already registered", param="version", code="conflict")
        version = version or await self.registry.next_version(name)
        # a name@version new to the registry: whatever this process still holds under it is stale
        await self._evict(LoRARequest(f"{name}@{version}", str(resolved)))
        info = await self.validate(f"{name}@{version}", resolved)
        await self._store_files(info.digest, resolved)
        row = Adapter(
            name=name,
            version=version,
            path=str(resolved),
            base_model=info.base_model_name or self.base_model,
            rank=info.rank,
            alpha=info.alpha,
            target_modules=list(info.target_modules),
            digest=info.digest,
            size_bytes=sum(f.stat().st_size for f in resolved.iterdir() if f.is_file()),
            owner=owner,
            description=description,
        )
        try:
            row = await self.registry.add(row)
        except AdapterExists as e:
            raise APIError(409, str(e), param="version", code="conflict") from None
        logger.info("registered adapter '%s' (rank %d, %s) from %s", row.adapter_id, row.rank, row.digest[:19], path)
        return row

    async def ensure_registered(self, name: str, path: str) -> Adapter:
        """`--lora-modules` at startup: idempotent; a changed directory (other path or other weights) becomes a
        new version."""
        self.roots.allow(path)
        resolved = self.roots.resolve(path)
        latest = await self.registry.get(name, None, ALL_TENANTS)
        if latest is not None and latest.path == str(resolved):
            info = await self.validate(latest.adapter_id, resolved)
            if info.digest == latest.digest:
                await self._store_files(info.digest, resolved)  # registered before the store existed
                return latest
            await self.evict(latest)
        return await self.register(name, path)

    async def _store_files(self, digest: str, directory: Path) -> None:
        if self.store is not None:
            try:
                stored = await self.store.put(digest, directory)
            except ValueError as e:
                raise APIError(422, str(e), param="path", code="invalid_adapter") from None
            if stored:
                logger.info("stored %d bytes of adapter files under %s", stored, digest[:19])

    # ---- serving --------------------------------------------------------------------------------------
    async def choose(self, model: str, lora_name: str | None, tenant: str | None) -> ModelChoice:
        """`model` = an adapter (name or name@version), or the base (+ `lora_request.lora_name`)."""
        if model == self.base_model:
            if lora_name is None:
                return ModelChoice(model, None)
            adapter = await self._visible(lora_name, tenant, param="lora_request.lora_name")
            return ModelChoice(model, adapter)
        if lora_name is not None:
            raise APIError(400, "lora_request needs `model` to be the base model's name", param="lora_request")
        return ModelChoice(model, await self._visible(model, tenant, param="model"))

    async def _visible(self, model: str, tenant: str | None, param: str) -> Adapter:
        name, version = split_adapter_id(model)
        adapter = await self.registry.get(name, version, tenant)
        if adapter is None:
            error = model_not_found(model)
            error.param = param
            raise error
        cached = await self.engine.digest(lora_request(adapter))
        if cached is not None and cached != adapter.digest:
            # name@version was deleted and registered again with other weights (perhaps through another
            # replica): what this process holds is stale, so it is read again
            logger.info("adapter '%s' changed in the registry; reloading it", adapter.adapter_id)
            await self.evict(adapter)
        return adapter

    # ---- the cache tiers --------------------------------------------------------------------------------
    async def evict(self, adapter: Adapter) -> bool:
        """Drops the adapter from host memory and its device row (at once, or when the requests using it
        finish); returns whether it is still pinned by running requests."""
        return await self._evict(lora_request(adapter))

    async def _evict(self, lora: LoRARequest) -> bool:
        return await self.engine.remove_adapter(lora)

    async def delete(self, name: str, version: str | None, tenant: str | None = ALL_TENANTS) -> list[Adapter]:
        rows = await self.registry.delete(name, version, tenant)
        for row in rows:
            if self.store is not None:
                await self.store.delete_unreferenced(row.digest)
            pinned = await self.evict(row)
            logger.info("deleted adapter '%s'%s", row.adapter_id, " (freed when its requests finish)" if pinned else "")
        return rows

    async def warm(self, adapter: Adapter) -> Tier:
        """Loads into host memory, then onto a device row when one is free; returns the tier reached."""
        try:
            return await self.engine.load_adapter(lora_request(adapter))
        except AdapterError as e:
            raise APIError(422, str(e), param="path", code="invalid_adapter") from None

    async def tier(self, adapter: Adapter) -> Tier:
        return await self.engine.tier(lora_request(adapter))
