"""vLLM's `/tokenize` and `/detokenize` (at the root, as vLLM serves them): a tenant's key, under its request limits
(a request a minute and a concurrent slot each: a chat's template renders for up to --chat-template-timeout), no
usage."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth import TenantDep
from gateway.routes.openai import admitted
from gateway.state import StateDep
from gateway.tokenization import DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["vllm"])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: StateDep, tenant: TenantDep):
    """A prompt's token ids (or a chat's, as the model's template renders it) and their count."""
    return await admitted(request, state, tenant, lambda _: state.tokenization.tokenize(body, tenant))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: StateDep, tenant: TenantDep):
    """The text of token ids."""
    return await admitted(request, state, tenant, lambda _: state.tokenization.detokenize(body, tenant))
