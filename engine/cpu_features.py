"""What the CPU can do fast, read once: which half-precision dtypes have native matmul instructions, whether it has
int8 dot products (VNNI), and whether kernels/linear's panel kernel beats oneDNN's fp32 GEMM here.

On a CPU without avx512_bf16 / AMX, a bf16 matmul is emulated in fp32 lanes with conversions and runs about 20x
slower per FLOP than fp32 (torch and vLLM alike); fp16 likewise without avx512_fp16 / AMX-FP16. `dtype=auto`
picks from this and the engine logs why; an explicit half dtype on such a CPU gets a warning.
"""

from __future__ import annotations

import functools
from pathlib import Path

# dtype -> CPU flags (any one suffices) that give it native matmuls
FAST_HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
# CPU flags (any one suffices) of int8 dot-product instructions, which oneDNN's int8 GEMM (torch._int_mm) runs on
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def _first_processor() -> dict[str, str]:
    """The fields of /proc/cpuinfo's first processor (Linux; its CPUs are alike here): key -> value; empty elsewhere or
    when unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (Linux); empty elsewhere or when unreadable."""
    return frozenset(_first_processor().get("flags", "").split())


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


def has_int8_dot(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has int8 dot products (VNNI or AMX-INT8): an int8 GEMM then runs ~4x fp32's rate per core."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in INT8_DOT_FLAGS)


def cpu_identity() -> tuple[str, int | None]:
    """(vendor_id, cpu family) of /proc/cpuinfo's first processor: ("AuthenticAMD", 25) on a Zen 3 or Zen 4;
    ("", None) where unreadable."""
    fields = _first_processor()
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else None


ZEN_FAMILY = 25  # AMD family 19h: Zen 3 (no AVX-512) and Zen 4 (AVX-512 on 256-bit units)


def panel_linear_wins(flags: frozenset[str] | None = None, identity: tuple[str, int | None] | None = None) -> bool:
    """Whether kernels/linear's panel kernel runs fp32 linears faster than oneDNN here (PackedLinear then picks it): on
    AVX2 + FMA CPUs without AVX-512 (Zen 3 and older, pre-Skylake-SP Intel), where oneDNN's fp32 GEMM leaves about a
    third of the FMA peak at decode shapes (decode steps' GEMMs 1.1-1.25x faster); on AMD Zen 4, whose 512-bit FMAs run
    on 256-bit units, with the kernel's 12 x 16 zmm tile of before (W1 decode steps 1.37x faster at 1 sequence, 1.16x at
    21, 1.03x at 64; prefill 1.04x slower); and since 2026-12-01 on Intel's AVX-512 CPUs, with the 14 x 32 zmm tile (two
    panels a tile) reading x in place: on a Xeon with AMX (family 6 model 167, 2 MB L2 per core) W1's 32 body GEMMs in
    0.70 of oneDNN's time at 21 rows, 0.86 at 64, 1.06x at 256 and 1.11x at 2048 (the 12 x 16 tile had lost from 32 rows
    on, and 25-35% at prefill's); on the model 207 Xeon (2026-12-02) 0.62 at 21 rows, 0.85 at 64 but 1.11-1.25x at 2048,
    so W1's prefill-heavy offline run took ~1.07x as long as with oneDNN. AMD Zen 5 (family 26, AVX-512 on 512-bit
    units) keeps oneDNN: there the 12 x 16 tile took a W1 layer's four GEMMs 0.94x oneDNN's time at 1 row but 1.26x at
    21, 1.30x at 64 and 1.34x at 2048 (2026-11-27, family 26 model 2); the 14 x 32 tile was not measured there."""
    flags = cpu_flags() if flags is None else flags
    if not {"avx2", "fma"} <= flags:
        return False
    if "avx512f" not in flags:
        return True
    vendor, family = cpu_identity() if identity is None else identity
    return vendor == "GenuineIntel" or (vendor, family) == ("AuthenticAMD", ZEN_FAMILY)


def bf16_panel_linear_wins(flags: frozenset[str] | None = None, identity: tuple[str, int | None] | None = None) -> bool:
    """Whether kernels/linear's bf16 panel kernel runs bf16 linears faster than oneDNN here (PackedLinear then picks
    it): on AMD Zen 4 (avx512_bf16, no AMX), where oneDNN streams a decode step's bf16 weights at 12-15 GB/s at 1-8
    rows (W1's 32 body GEMMs, 47 MB, cold: 3.1-3.8 ms) and the panels at 21-23 (2.05-2.18 ms, 0.57-0.66 of oneDNN's
    time), 0.77-0.80 at 16-32 rows, 0.91 at 64, 1.04-1.10 at 256-2048; in the engine, bf16 W1 at one stream 0.68 of
    the time, even at 64, the demo's SmolLM2 0.70 at one stream and 0.93 at 32 (2026-11-28, family 25 model 17). CPUs
    with AMX keep oneDNN (its AMX tiles), and so do the others with avx512_bf16 until measured (Zen 5 kept oneDNN for
    fp32)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512_bf16" not in flags or "amx_bf16" in flags:
        return False
    return (cpu_identity() if identity is None else identity) == ("AuthenticAMD", ZEN_FAMILY)
