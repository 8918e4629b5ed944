"""EngineRequest: the one object that crosses from an API (offline LLM, gateway) into the engine."""

from __future__ import annotations

from dataclasses import dataclass

from adapters.ref import LoRARequest
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora: LoRARequest | None = None  # None: the base model alone
    adapter_digest: str | None = None  # keys the prefix cache; the engine sets it to the adapter's content digest
    tenant: str | None = None
    tenant_weight: float = 1.0  # the tenant's share under the fair scheduling policy
    prompt: str | None = None  # the text the ids came from, when there was one
