"""vLLM's `/tokenize` and `/detokenize` (at the root, as vLLM serves them): a tenant's key, no usage."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.auth import TenantDep
from gateway.state import StateDep
from gateway.tokenization import DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["vllm"])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep, tenant: TenantDep):
    """A prompt's token ids (or a chat's, as the model's template renders it) and their count."""
    return await state.tokenization.tokenize(body, tenant)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep, tenant: TenantDep):
    """The text of token ids."""
    return await state.tokenization.detokenize(body, tenant)
