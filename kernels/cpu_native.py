"""The C++ CPU kernels (paged_attention/csrc: the paged decode attention; lora/csrc: batched LoRA shrink and
expand; fused/csrc: RMSNorm, SiLU * up and rotary embedding, each fused; sampling/csrc: greedy argmax with the
finiteness check; linear/csrc: the fp32 linear on AVX2 CPUs; decode_stack/csrc: a decode step's layers), one
extension built once per machine on first use, its ops under torch.ops.loraplex.

torch.utils.cpp_extension compiles it with the machine's C++ compiler (-O3 -march=native) into torch's extension
cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); later processes load the cached build. Where it cannot
be built (no compiler or ninja), `load()` returns None once, with a log line, and callers keep the torch path.
LORAPLEX_CPU_KERNELS=0 turns them off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
SOURCES = sorted(Path(__file__).parent.glob("*/csrc/*.cpp"))
_lock = threading.Lock()
_state: dict[str, Any] = {}


def load() -> Any:
    """torch.ops.loraplex with the compiled ops (paged_decode_attention, lora_shrink_cpu, lora_expand_cpu, the
    fused layer ops and greedy_tokens_cpu), or None where they cannot be built (or are turned off)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build() -> Any:
    if os.environ.get("LORAPLEX_CPU_KERNELS", "1") == "0":
        logger.info("C++ CPU kernels off (LORAPLEX_CPU_KERNELS=0): attention and LoRA run on torch ops")
        return None
    start = time.perf_counter()
    try:
        import torch
        from torch.utils.cpp_extension import load as load_extension

        load_extension(
            name="loraplex_cpu_kernels",
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_include_paths=[str(Path(__file__).parent / "csrc")],  # cpu_vec.h, shared by the kernels
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.loraplex.* (no pybind11: a much shorter build)
            verbose=False,
        )
        module = torch.ops.loraplex
    except Exception as e:  # a compiler, ninja or header problem: any of them means "not here"
        logger.warning("C++ CPU kernels unavailable (%s): attention and LoRA run on torch ops", e)
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 2:
        logger.info("built the C++ CPU kernels in %.0f s (cached for later runs)", elapsed)
    return module
