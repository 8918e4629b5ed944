"""EngineConfig: every knob of the engine in one validated place, declared once.

A field made with `option(...)` is one a user may set: `loraplex serve` and `loraplex generate` make a flag of it, and
serve a `LORAPLEX_*` variable (gateway/engine_settings.py), with this default and help. The other fields (the model,
enable_lora) are set by the caller."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.cpu_features import half_dtype_support
from engine.cpu_threads import usable_cores
from engine.fairness import POLICIES

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": triton on CUDA; on CPU, cpu (the C++ kernels of kernels/cpu_native.py) for float32 and bfloat16 where
# they build, else torch
BACKENDS = ("auto", "torch", "triton", "cpu")
# The default step budgets. On CUDA a prefill step's host time (meta, launches) is much the same for 2048 tokens as
# for 8192, so fewer, larger steps keep the GPU busier; on two CPU cores a 2048-token step is already ~1 s of work.
CPU_BATCHED_TOKENS, CUDA_BATCHED_TOKENS = 2048, 8192


def option(default, help: str, choices: tuple[str, ...] = (), size: bool = False):
    """A field a user may set. `choices`: its only values; `size`: a number of bytes, also given as e.g. 2GiB."""
    return field(default=default, metadata={"help": help, "choices": choices, "size": size})


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = option(
        "auto",
        "weights and activations (auto: float32 on CPU, bfloat16 on CUDA; bfloat16 on a CPU without avx512_bf16 "
        "or AMX is ~20x slower)",
        ("auto", *DTYPES),
    )
    device: str = option("auto", "auto | cpu | cuda[:N] (auto: cuda when available)")
    block_size: int = option(16, "tokens per KV-cache block (a power of two)")
    kv_cache_memory: int | None = option(
        None, "KV pool size, e.g. 2GiB (default: 1GiB on CPU, --gpu-memory-utilization on CUDA)", size=True
    )
    gpu_memory_utilization: float = option(0.85, "CUDA: fraction of free memory (after weights) for the KV pool")
    num_kv_blocks: int | None = option(None, "KV-cache blocks, overriding the memory budget (default: from it)")
    max_num_seqs: int = option(128, "most sequences in one step")
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens in one step (default: 2048 on CPU; on CUDA 8192, vLLM's server default on H100-class GPUs: "
        "fewer, larger prefill steps, each launching the same kernels)",
    )
    max_model_len: int | None = option(None, "context length limit (default: the model's)")
    enable_prefix_caching: bool = option(True, "reuse the KV of shared prompt prefixes (keyed by adapter digest)")
    attention_backend: str = option(
        "auto",
        "paged attention kernels (auto: triton on CUDA, on CPU cpu = C++ decode attention if it builds)",
        BACKENDS,
    )
    enable_lora: bool = False
    max_loras: int = option(4, "adapters resident on the device at once (rows of stacked weights)")
    max_lora_rank: int = option(16, "highest adapter rank accepted")
    max_cpu_loras: int | None = option(None, "adapters kept in host memory (default 4 x max-loras)")
    allow_pickle_adapters: bool = option(False, "accept adapter_model.bin (loaded with weights_only)")
    lora_backend: str = option(
        "auto", "batched-LoRA kernels (auto: triton on CUDA, on CPU cpu = C++ shrink/expand if they build)", BACKENDS
    )
    seed: int = option(0, "engine seed for unseeded sampling")
    scheduling_policy: str = option(
        "fcfs", "admission order: fcfs, or fair across tenants (virtual token counters)", POLICIES
    )
    cpu_threads: int | None = option(
        None, "CPU: most torch threads (default: every usable core; cpu_threads_adapt gives way to other processes)"
    )
    screened_greedy: bool = option(
        True,
        "CPU fp32 with native bf16 matmuls (else int8 dot products, VNNI): greedy steps run the LM head in bf16 "
        "(int8) and recompute in fp32 only the tokens that can still be the maximum (the same tokens, ~1/2 (~1/3) of "
        "the head's cost)",
    )
    decode_stack: bool = option(
        True,
        "CPU: a decode-only step runs the decoder layers in one C++ call (the same kernels and results as the "
        "layer-by-layer forward, without its per-op Python cost, the GIL released)",
    )
    enforce_eager: bool = option(
        False,
        "CUDA: run decode steps eagerly, as prefill steps run, instead of replaying them as CUDA graphs (recorded at "
        "start for batches of up to max-num-seqs, up to 512)",
    )
    stream_interval: int = option(
        1,
        "steps whose tokens a stream gets in one delta after its first (as vLLM's --stream-interval): fewer, larger "
        "SSE chunks cost the server's event loop less CPU at many streams; a request may ask for more",
    )
    cpu_threads_adapt: bool = option(
        True, "CPU: shrink the thread team to the cores other processes leave free (checked each second)"
    )

    def __post_init__(self) -> None:
        if not (Path(self.model).is_dir() or (str(self.model).endswith(".gguf") and Path(self.model).is_file())):
            raise FileNotFoundError(f"model directory or GGUF file not found: {self.model}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device '{self.device}' requested but CUDA is not available")
        if self.max_num_batched_tokens is None:
            default = CUDA_BATCHED_TOKENS if self.device.startswith("cuda") else CPU_BATCHED_TOKENS
            self.max_num_batched_tokens = max(default, self.max_num_seqs)
        if self.cpu_threads is None:
            self.cpu_threads = usable_cores()
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be positive, got {self.cpu_threads}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype '{self.dtype}'; choose one of {sorted(DTYPES)}")
        self.dtype = self._resolve_dtype()
        for name in ("attention_backend", "lora_backend"):
            if getattr(self, name) == "auto":
                setattr(self, name, "triton" if self.device.startswith("cuda") else self._cpu_backend())
            if getattr(self, name) == "cpu" and self.device != "cpu":
                raise ValueError(f"{name} 'cpu' runs on the CPU, not on {self.device}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 4 * self.max_loras
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence must fit one step"
            )

    def _cpu_backend(self) -> str:
        """cpu where the C++ kernels build (once per machine) and the dtype is float32 or bfloat16 (computed in fp32
        either way), else torch."""
        if self.dtype not in ("float32", "bfloat16"):
            return "torch"
        from kernels import cpu_native

        return "cpu" if cpu_native.load() is not None else "torch"

    def _resolve_dtype(self) -> str:
        """`auto` on CPU is float32, the oracle's precision, logged with whether bfloat16 would be fast here; an
        explicit half dtype on a CPU without native matmuls for it is honoured, with a warning saying why."""
        if self.device != "cpu":
            return "bfloat16" if self.dtype == "auto" else self.dtype
        if self.dtype == "auto":
            fast, reason = half_dtype_support("bfloat16")
            if fast:
                logger.info("dtype auto: float32 on CPU; %s, so --dtype bfloat16 would be faster here", reason)
            else:
                logger.info("dtype auto: float32 on CPU: %s", reason)
            return "float32"
        if self.dtype in ("bfloat16", "float16"):
            fast, reason = half_dtype_support(self.dtype)
            if not fast:
                logger.warning("dtype %s requested on CPU, but %s; --dtype float32 is faster here", self.dtype, reason)
        return self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
