"""GatewayState: the one object a running server holds (settings, engine, registry, services), and the
FastAPI dependency that hands it to routes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from engine.interface import AsyncEngine
from gateway.accounting import Accounting
from gateway.adapter_service import AdapterService
from gateway.metrics import GatewayMetrics
from gateway.openai_serving import OpenAIServing
from gateway.responses_serving import ResponsesServing
from gateway.settings import ServeSettings
from gateway.tokenization import Tokenization
from gateway.usage import UsageFlusher
from registry.adapters import AdapterRegistry
from registry.database import RegistryDatabase


@dataclass
class GatewayState:
    settings: ServeSettings
    base_model: str  # the name clients use for the base
    model_dir: str
    engine: AsyncEngine
    database: RegistryDatabase  # every table's repository
    adapters: AdapterService
    serving: OpenAIServing
    responses: ResponsesServing  # /v1/responses, run as chat by `serving`
    tokenization: Tokenization  # /tokenize, /detokenize
    auth_enabled: bool
    accounting: Accounting
    usage_flusher: UsageFlusher
    metrics: GatewayMetrics
    started_at: float = field(default_factory=time.time)

    @property
    def registry(self) -> AdapterRegistry:
        return self.database.adapters


async def get_state(request: Request) -> GatewayState:
    # async: FastAPI runs a plain-def dependency on a worker thread, one thread hop per request for an attribute read
    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(get_state)]
