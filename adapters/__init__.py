"""PEFT LoRA adapters: read, validate and hold them as fp32 (A, B, scaling) per (layer, module)."""

from adapters.base_spec import LORA_MODULES, BaseModelSpec
from adapters.lora_weights import LoRAWeights, load_lora
from adapters.peft_config import AdapterConfig, AdapterError, parse_adapter_config, read_adapter_config

__all__ = [
    "LORA_MODULES",
    "AdapterConfig",
    "AdapterError",
    "BaseModelSpec",
    "LoRAWeights",
    "load_lora",
    "parse_adapter_config",
    "read_adapter_config",
]
