"""EngineConfig: every knob of the engine in one validated place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto": cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: 1 GiB on CPU, a fraction of free on CUDA
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory (after weights) for the KV pool
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use it)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "torch" | "triton" | "auto" (triton on CUDA)
    enable_lora: bool = False
    max_loras: int = 4  # device rows of stacked adapter weights: distinct adapters in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # host-memory LRU tier; None: 4 x max_loras
    allow_pickle_adapters: bool = False  # adapter_model.bin, loaded with weights_only=True
    lora_backend: str = "auto"  # "torch" | "triton" | "auto" (triton on CUDA)
    seed: int = 0
    cpu_threads: int | None = None  # CPU: torch threads; None: every core but one (left to the server, tokenizer)

    def __post_init__(self) -> None:
        if not (Path(self.model).is_dir() or (str(self.model).endswith(".gguf") and Path(self.model).is_file())):
            raise FileNotFoundError(f"model directory or GGUF file not found: {self.model}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device '{self.device}' requested but CUDA is not available")
        if self.cpu_threads is None:
            self.cpu_threads = max(1, (os.cpu_count() or 1) - 1)
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be positive, got {self.cpu_threads}")
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype '{self.dtype}'; choose one of {sorted(DTYPES)}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.lora_backend == "auto":
            self.lora_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence must fit one step"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
