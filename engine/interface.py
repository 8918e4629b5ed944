"""The engine's one door: `AsyncEngine` and the plain-data types that cross it. Code outside engine/ (the gateway,
and later a Ray Serve replica's caller) imports from this module alone.

    engine = AsyncEngine.from_config(EngineConfig(model=...))
    async for delta in engine.generate(EngineRequest(...)): ...      # RequestOutput deltas
    await engine.abort(request_id) / validate(request) / stats()     # EngineSnapshot
    await engine.add_adapter(lora) / remove_adapter / load_adapter / unload_adapter / pin_adapter / unpin_adapter
"""

from engine.async_engine import AsyncEngine, EngineStopped
from engine.interface_types import (
    AdapterError,
    AdapterInfo,
    CompletionOutput,
    EngineConfig,
    EngineRequest,
    EngineSnapshot,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    SequenceFailed,
    StructuredOutputError,
    StructuredOutputsParams,
    Tier,
    TokenLogprob,
    parse_lora_module,
)

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineRequest",
    "EngineSnapshot",
    "EngineStopped",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "SequenceFailed",
    "StructuredOutputError",
    "StructuredOutputsParams",
    "Tier",
    "TokenLogprob",
    "parse_lora_module",
]
