"""The plain data of the engine's door: every type that crosses between a caller (the gateway) and `AsyncEngine`.

Callers outside engine/ import these through engine/interface.py. Everything here is a dataclass of
ints, strings, lists and dicts (or an exception), so the same surface can be served across a process boundary:
requests in (`EngineRequest` with its `SamplingParams`, their `StructuredOutputsParams`, and `LoRARequest`),
outputs back (`RequestOutput` of `CompletionOutput`s), what an adapter is (`AdapterInfo`), the engine's state
(`EngineSnapshot`), and the errors a request or an adapter can fail with (`ValueError` for a bad request, and its
`StructuredOutputError` for a grammar that does not compile; `AdapterError` for a bad adapter; `SequenceFailed` for
a request that broke its own step while the others went on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from adapters.lora_weights import LoRAWeights
from adapters.peft_config import AdapterError
from adapters.ref import LoRARequest, parse_lora_module
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput, SequenceFailed, TokenLogprob
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams, StructuredOutputError, StructuredOutputsParams

Tier = Literal["device", "host", "loading", "failed", "disk"]  # where an adapter is now, fastest first


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What reading and validating an adapter found (the registry stores most of it)."""

    adapter_id: str  # LoRARequest.adapter_id: the registry's name@version
    path: str
    digest: str  # "sha256:<hex>" of the weights: the adapter's content identity
    rank: int  # the largest rank over its modules
    alpha: float  # PEFT's lora_alpha
    target_modules: tuple[str, ...]  # sorted, e.g. ("q_proj", "v_proj")
    base_model_name: str | None  # the adapter config's base_model_name_or_path
    num_bytes: int  # of its weights in host memory

    @classmethod
    def of(cls, weights: LoRAWeights) -> AdapterInfo:
        return cls(
            adapter_id=weights.name,
            path=weights.path,
            digest=weights.digest,
            rank=weights.rank,
            alpha=weights.alpha,
            target_modules=tuple(sorted(weights.target_modules)),
            base_model_name=weights.base_model_name,
            num_bytes=weights.num_bytes,
        )


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine between two steps, read on the engine thread (so its numbers agree with each other)."""

    num_requests: int  # unfinished requests, waiting or running
    seqs_running: int
    seqs_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # blocks held by no sequence (prefix-cached ones included)
    adapters_on_device: tuple[str, ...]  # adapter ids on device rows, least recently used first
    adapters_on_host: tuple[str, ...]  # adapter ids in host memory, least recently used first
    adapter_rows_pinned: int  # device rows pinned by running requests or by `pin_adapter`
    max_loras: int  # device rows (0 without LoRA)
    max_cpu_loras: int  # host-memory slots
    adapter_loads: int  # disk -> host memory
    adapter_load_seconds: float
    adapter_load_failures: int
    adapter_activations: int  # host memory -> a device row
    adapter_device_evictions: int
    adapter_host_evictions: int
    steps: int
    preemptions: int
    prompt_tokens_computed: int  # prompt tokens run through the model (prefix-cache hits excluded)
    generated_tokens: int
    tenant_service: dict[str, float] = field(default_factory=dict)  # weighted tokens computed per tenant ("" = none)
    cpu_threads: int = 0  # CPU: the engine's thread team now (sized to the free cores); 0 on CUDA

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free


__all__ = [
    "AdapterError",
    "AdapterInfo",
    "CompletionOutput",
    "EngineConfig",
    "EngineRequest",
    "EngineSnapshot",
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
