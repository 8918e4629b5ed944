"""Batched multi-LoRA ops (shrink, expand) over stacked adapter weights, by backend name: torch (the reference),
cpu (C++ kernels, one call per op) and triton (CUDA)."""

import importlib
from types import ModuleType

from .meta import NO_ADAPTER, LoraMeta
from .torch_ops import add_lora

BACKENDS = ("torch", "triton", "cpu")

__all__ = ["BACKENDS", "NO_ADAPTER", "LoraMeta", "add_lora", "get_lora_ops"]


def get_lora_ops(name: str) -> ModuleType:
    """The backend module `name` ("torch" | "triton" | "cpu"), with shrink_out(x, lora_a, meta) (the buffer z
    between the two ops), lora_shrink(z, x, lora_a, meta), lora_expand(y, z, lora_b, meta, output_slices) and
    add_lora(...); Triton is imported only here, on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}_ops")
