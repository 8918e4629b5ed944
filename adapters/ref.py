"""LoRARequest: how a request names its adapter (vLLM's offline convention: a name and a PEFT directory), and
the `NAME=PATH` / JSON spec that the command-line flags give one in."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    adapter_id: str  # a registry name@version, or any name the caller picks offline
    path: str  # the PEFT directory (adapter_config.json + adapter_model.safetensors)
    digest: str | None = None  # the content the caller expects (the registry's); None offline. Not part of the key

    @property
    def key(self) -> tuple[str, str]:
        """What the adapter cache keys on: the same adapter_id with another path is another adapter."""
        return self.adapter_id, self.path


def parse_lora_module(spec: str, flag: str = "--lora-modules") -> tuple[str, str]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}` -> (name, path)."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            data = json.loads(spec)
            return str(data["name"]), str(data["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{flag}: bad JSON entry {spec!r} (needs name and path): {e}") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{flag} expects NAME=PATH or JSON, got {spec!r}")
    return name, path
