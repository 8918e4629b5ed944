"""EngineRequest: the one object that crosses from an API (offline LLM, gateway) into the engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter_key: str | None = None  # the adapter's content digest: keys the prefix cache; None = base model
    tenant: str | None = None
    prompt: str | None = None  # the text the ids came from, when there was one
