"""What the CPU can do fast, read once: which half-precision dtypes have native matmul instructions.

On a CPU without avx512_bf16 / AMX, a bf16 matmul is emulated in fp32 lanes with conversions and runs about 20x
slower per FLOP than fp32 (torch and vLLM alike); fp16 likewise without avx512_fp16 / AMX-FP16. `dtype=auto`
picks from this and the engine logs why; an explicit half dtype on such a CPU gets a warning.
"""

from __future__ import annotations

import functools
from pathlib import Path

# dtype -> CPU flags (any one suffices) that give it native matmuls
FAST_HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (Linux); empty elsewhere or when unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def half_dtype_support(dtype: str, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(fast, reason): whether `dtype` ('bfloat16' or 'float16') has native matmuls here, and the flags that say so."""
    flags = cpu_flags() if flags is None else flags
    wanted = FAST_HALF_FLAGS[dtype]
    found = [flag for flag in wanted if flag in flags]
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    if not flags:
        return False, "the CPU's flags could not be read"
    return False, f"the CPU has none of {', '.join(wanted)} ({dtype} matmuls run ~20x slower per FLOP than float32)"


def avx2_without_avx512(flags: frozenset[str] | None = None) -> bool:
    """Whether this is an AVX2 + FMA CPU without AVX-512: where oneDNN's fp32 GEMM leaves about a third of the FMA
    peak at decode shapes and kernels/linear's panel kernel runs them 1.1-1.2x faster (PackedLinear picks it)."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags and "avx512f" not in flags
