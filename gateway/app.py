"""build_app: the FastAPI application, its routers and error handlers, and the lifespan that starts (and
cleanly stops) the registry, the engine and the services.

Start-up order: the model (a directory or a GGUF file) → database migrations →
the engine (weights loaded, KV pool allocated) → `--lora-modules` registered (validated, idempotent) → ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from tqdm import tqdm

from engine.interface import AsyncEngine, parse_lora_module
from gateway.accounting import Accounting
from gateway.adapter_roots import AdapterRoots
from gateway.adapter_service import AdapterService
from gateway.body_limit import BodyLimit
from gateway.chat_replies import parser_warnings
from gateway.chat_templates import ChatTemplates
from gateway.errors import install_error_handlers
from gateway.lifecycle import Drain, watch_engine
from gateway.limits import make_rate_limiter
from gateway.metrics import ErrorCounter, GatewayMetrics
from gateway.openai_serving import OpenAIServing
from gateway.redis_persistence import warn_unless_persistent
from gateway.request_limits import RequestLimits
from gateway.responses_serving import ResponsesServing
from gateway.routes import (
    admin_adapters,
    admin_replicas,
    admin_tenants,
    health,
    metrics,
    openai,
    tokenize,
    vllm_adapters,
)
from gateway.routes.health import package_version
from gateway.settings import ServeSettings
from gateway.state import GatewayState
from gateway.tokenization import Tokenization
from gateway.usage import UsageFlusher, make_usage_store
from registry import db
from registry.database import RegistryDatabase

logger = logging.getLogger(__name__)


def _model_and_modules(settings: ServeSettings) -> tuple[str, str, list[tuple[str, str]]]:
    """(model path, served name, lora modules)."""
    modules = [parse_lora_module(spec) for spec in settings.lora_modules]
    if settings.model is None:
        raise ValueError("no --model given (the `loraplex serve` command brings the embedded demo)")
    if not Path(settings.model).exists():
        raise FileNotFoundError(f"--model {settings.model!r}: no such model directory or GGUF file")
    return settings.model, settings.base_model_name, modules


EngineFactory = Callable[[ServeSettings, str], Awaitable[AsyncEngine]]  # (settings, model path) -> the engine


async def local_engine(settings: ServeSettings, model_dir: str) -> AsyncEngine:
    """The engine in this process (`loraplex serve`); gateway/cluster gives a RemoteEngine over Ray Serve instead."""
    logger.info("loading %s", model_dir)
    return await asyncio.to_thread(AsyncEngine.from_config, settings.engine_config(model_dir, enable_lora=True))


async def start(settings: ServeSettings, make_engine: EngineFactory = local_engine) -> GatewayState:
    model_dir, base_model, modules = await asyncio.to_thread(_model_and_modules, settings)
    await asyncio.to_thread(db.upgrade, settings.database_url)
    database = RegistryDatabase(settings.database_url)
    engine = await make_engine(settings, model_dir)
    adapters = AdapterService(
        database.adapters, engine, AdapterRoots(settings.adapter_root), base_model, store=database.store
    )
    for name, path in tqdm(modules, desc="registering adapters", unit="adapter", disable=not modules):
        adapter = await adapters.ensure_registered(name, path)
        tier = await adapters.warm(adapter) if settings.preload else "disk"
        logger.info("adapter '%s' ready (%s, %s)", adapter.adapter_id, adapter.path, tier)
    gateway_metrics = GatewayMetrics()
    limits = RequestLimits.of(settings, engine.max_model_len)
    templates = ChatTemplates(
        engine.tokenizer, settings.chat_template, limits.trust_request_chat_template, limits.chat_template_timeout
    )
    serving = OpenAIServing(engine, adapters, templates, gateway_metrics, limits)
    for warning in parser_warnings(engine.tokenizer.get_vocab(), settings.tool_call_parser, settings.reasoning_parser):
        logger.warning(warning)
    tokenization = Tokenization(engine.tokenizer, adapters, templates, engine.max_model_len)
    store = make_usage_store(settings.redis_url, key_prefix=settings.redis_key_prefix)
    limiter = make_rate_limiter(
        settings.redis_url, fail_open=settings.limits_fail_open, key_prefix=settings.redis_key_prefix
    )
    flusher = UsageFlusher(store, database.usage, interval_s=settings.usage_flush_interval)
    flusher.start()
    state = GatewayState(
        settings=settings,
        base_model=base_model,
        model_dir=model_dir,
        engine=engine,
        database=database,
        adapters=adapters,
        serving=serving,
        responses=ResponsesServing(serving),
        tokenization=tokenization,
        auth_enabled=settings.auth_enabled,
        accounting=Accounting(database.tenants, store, limiter),
        usage_flusher=flusher,
        metrics=gateway_metrics,
    )
    if not state.auth_enabled:
        logger.warning("authentication is OFF: /v1/* answers anyone (--no-disable-auth requires tenant keys)")
    logger.info(
        "usage and limits: %s", "Redis " + settings.redis_url.split("@")[-1] if settings.redis_url else "in process"
    )
    if settings.redis_url:
        await warn_unless_persistent(settings.redis_url)
    if not settings.admin_key:
        logger.info("the admin API is disabled (no --admin-key)")
    return state


async def stop(state: GatewayState) -> None:
    """After uvicorn has let running requests finish: the last usage flush, then the engine and database."""
    await state.usage_flusher.close()
    await state.accounting.close()
    await asyncio.to_thread(state.engine.shutdown)
    await state.database.close()
    logger.info("loraplex stopped")


def build_app(settings: ServeSettings, make_engine: EngineFactory = local_engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.gateway = await start(settings, make_engine)
        app.state.drain.attach(asyncio.get_running_loop())
        request_exit = getattr(app.state, "request_exit", None)  # set by gateway.server.Server
        watch = asyncio.create_task(
            watch_engine(app.state.gateway.engine, lambda: request_exit(1) if request_exit else None),
            name="engine-watch",
        )
        try:
            yield
        finally:
            watch.cancel()
            await stop(app.state.gateway)

    app = FastAPI(
        title="loraplex",
        version=package_version(),
        description="Multi-LoRA serving: an OpenAI-compatible API over one base model and many adapters.",
        lifespan=lifespan,
    )
    app.state.drain = Drain()
    install_error_handlers(app)
    app.add_middleware(ErrorCounter)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    for module in (openai, tokenize, vllm_adapters, admin_adapters, admin_replicas, admin_tenants, health, metrics):
        app.include_router(module.router)
    return app
