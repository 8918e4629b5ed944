"""`/v1/completions`, `/v1/chat/completions`, `/v1/models`: the OpenAI-compatible surface."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth import TenantDep
from gateway.errors import APIError
from gateway.generation import ClientDisconnected
from gateway.openai_serving import Caller
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.state import StateDep

router = APIRouter(prefix="/v1", tags=["openai"])


def _caller(state, tenant: str | None, body) -> Caller:
    return Caller(tenant=tenant)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    try:
        return await state.serving.completions(body, request, _caller(state, tenant, body))
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep):
    try:
        return await state.serving.chat(body, request, _caller(state, tenant, body))
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None


@router.get("/models")
async def models(state: StateDep, tenant: TenantDep):
    """The base model and the adapters this caller may use (each adapter's latest version; `parent` = base)."""
    base = {
        "id": state.base_model,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "loraplex",
        "root": state.base_model,
        "parent": None,
        "max_model_len": state.engine.engine.max_model_len,
    }
    adapters = [
        {
            "id": a.name,
            "object": "model",
            "created": int(a.created_at.timestamp()),
            "owned_by": a.owner or "loraplex",
            "root": a.adapter_id,
            "parent": state.base_model,
            "version": a.version,
        }
        for a in await state.registry.list(tenant, latest_only=True)
    ]
    return {"object": "list", "data": [base, *adapters]}
