"""`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/models` (and one by id): the OpenAI-compatible
surface."""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from gateway.auth import TenantDep
from gateway.errors import APIError, model_not_found
from gateway.generation import ClientDisconnected
from gateway.openai_serving import Caller
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_protocol import ResponsesRequest
from gateway.state import GatewayState, StateDep
from gateway.usage_report import usage_json
from registry.adapters import split_adapter_id
from registry.models import Adapter

router = APIRouter(prefix="/v1", tags=["openai"])


async def admitted(request: Request, state: GatewayState, tenant: str | None, handler: Callable[[Caller], Awaitable]):
    """Runs `handler` under the tenant's limits; the ticket is settled whatever happens (with no usage where the
    handler reported none: /tokenize's)."""
    ticket = await state.accounting.admit(tenant)
    try:
        response = await handler(Caller(tenant, ticket))
        if isinstance(response, StreamingResponse):  # a drain's cut ends it with an error event
            response.body_iterator = request.app.state.drain.guard_stream(response.body_iterator)
        return response
    except BaseException as e:
        await ticket.done("", None)  # failed before any generation reported (a no-op if one did)
        if isinstance(e, ClientDisconnected):
            raise APIError(499, "client disconnected") from None
        raise


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    return await admitted(request, state, tenant, lambda caller: state.serving.completions(body, request, caller))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    return await admitted(request, state, tenant, lambda caller: state.serving.chat(body, request, caller))


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request, state: StateDep, tenant: TenantDep):
    """OpenAI's Responses API, one chat turn in its layout (gateway/responses_protocol.py); nothing is stored."""
    return await admitted(request, state, tenant, lambda caller: state.responses.create(body, request, caller))


@router.get("/responses/{response_id}")
async def stored_response(response_id: str):
    """OpenAI's retrieve: this server keeps no responses, so every id is a 404 that says why."""
    message = f"no response {response_id!r}: this server stores no responses (each reply holds the whole response)"
    raise APIError(404, message, param="response_id", code="response_not_found")


@router.get("/usage")
async def usage(
    state: StateDep,
    tenant: TenantDep,
    start: Annotated[dt.date | None, Query(alias="from")] = None,
    end: Annotated[dt.date | None, Query(alias="to")] = None,
    adapter: str | None = None,
):
    """The calling tenant's own usage by adapter and day ("" is the base model)."""
    return await usage_json(state, tenant or "", adapter, start, end)


def _base_card(state: GatewayState) -> dict:
    return {
        "id": state.base_model,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "loraplex",
        "root": state.base_model,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
    }


def _adapter_card(state: GatewayState, adapter: Adapter, model: str) -> dict:
    return {
        "id": model,
        "object": "model",
        "created": int(adapter.created_at.timestamp()),
        "owned_by": adapter.owner or "loraplex",
        "root": adapter.adapter_id,
        "parent": state.base_model,
        "version": adapter.version,
    }


@router.get("/models")
async def models(state: StateDep, tenant: TenantDep):
    """The base model and the adapters this caller may use (each adapter's latest version; `parent` = base)."""
    adapters = [_adapter_card(state, a, a.name) for a in await state.registry.list(tenant, latest_only=True)]
    return {"object": "list", "data": [_base_card(state), *adapters]}


@router.get("/models/{model:path}")
async def model(model: str, state: StateDep, tenant: TenantDep):
    """One model of /v1/models by its id (OpenAI's retrieve), or an adapter's `name@version`; the same 404 as a
    generation's for one the caller may not use."""
    if model == state.base_model:
        return _base_card(state)
    adapter = await state.registry.get(*split_adapter_id(model), tenant)
    if adapter is None:
        raise model_not_found(model)
    return _adapter_card(state, adapter, model)
