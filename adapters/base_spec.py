"""BaseModelSpec: the facts of the loaded base model that every adapter is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENTS = {m: "self_attn" for m in LORA_MODULES[:4]} | {m: "mlp" for m in LORA_MODULES[4:]}


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # LoRA-able module -> (in_features, out_features)
    base_model_name: str | None = None

    @classmethod
    def from_dims(
        cls,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None,
        num_layers: int,
        base_model_name: str | None = None,
    ) -> BaseModelSpec:
        """The Llama family's projections; head_dim None means hidden_size // num_heads."""
        head_dim = head_dim or hidden_size // num_heads
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {
            "q_proj": (hidden_size, q_size),
            "k_proj": (hidden_size, kv_size),
            "v_proj": (hidden_size, kv_size),
            "o_proj": (q_size, hidden_size),
            "gate_proj": (hidden_size, intermediate_size),
            "up_proj": (hidden_size, intermediate_size),
            "down_proj": (intermediate_size, hidden_size),
        }
        return cls(num_layers=num_layers, module_shapes=shapes, base_model_name=base_model_name)

    @classmethod
    def from_hf_config(cls, config: Any, base_model_name: str | None = None) -> BaseModelSpec:
        """From a transformers config (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, ...)."""
        num_heads = config.num_attention_heads
        return cls.from_dims(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None),
            num_layers=config.num_hidden_layers,
            base_model_name=base_model_name or getattr(config, "_name_or_path", None) or None,
        )
