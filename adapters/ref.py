"""LoRARequest: how a request names its adapter (vLLM's offline convention: a name and a PEFT directory)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    adapter_id: str  # a registry name@version, or any name the caller picks offline
    path: str  # the PEFT directory (adapter_config.json + adapter_model.safetensors)

    @property
    def key(self) -> tuple[str, str]:
        """What the adapter cache keys on: the same adapter_id with another path is another adapter."""
        return self.adapter_id, self.path
