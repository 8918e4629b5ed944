"""The fp32 linear for AVX2 and AVX-512 CPUs (csrc/linear_cpu.cpp, built with the other C++ kernels by
kernels/cpu_native.py): weights packed once into panels of 16 output columns, a register-blocked FMA kernel over them
(6 x 16 in ymm, or 14 rows x 2 panels in zmm where the compiler targets AVX-512F; the same sums either way, x read
where it lies). On AVX2 machines without AVX-512 it runs a decode step's GEMMs 1.1-1.25x faster than oneDNN's fp32
path, on an AMD Zen 4 1.15-1.6x (prefill about even, 1.04x slower on the Zen 4; the old 12 x 16 zmm tile), on an
Intel Xeon with AMX 1.15-1.4x at 21-64 rows (prefill 1.1x slower); `engine.cpu_features.panel_linear_wins` says where
it is used.

`panel_linear_ops()` gives torch.ops.loraplex where the kernel was built (an AVX2 + FMA compiler target, not turned
off by LORAPLEX_CPU_KERNELS=0), else None. Its ops:
  pack_linear_weight_cpu(weight [N, K] fp32) -> [N / 16, K, 16]   (N a multiple of 16)
  packed_linear_cpu(x [M, K] fp32, packed, bias [N]?) -> [M, N]
and in bf16 (csrc/linear_bf16_cpu.cpp, AVX512-BF16: VDPBF16PS over panels of 16 columns with k in pairs; sums in
fp32, rounded to bf16 once; `engine.cpu_features.bf16_panel_linear_wins` says where it is used):
  pack_linear_weight_bf16_cpu(weight [N, K] bf16) -> [N / 16, ceil(K / 2), 16, 2]
  packed_linear_cpu(x [M, K] bf16, that packed weight, bias [N] bf16?) -> [M, N] bf16
"""

from typing import Any

from .. import cpu_native

PANEL_WIDTH = 16  # output columns per packed panel: the weight's N must be a multiple


def panel_linear_ops() -> Any:
    return cpu_native.load_with("packed_linear_available")


def bf16_panel_linear_ops() -> Any:
    """torch.ops.loraplex where the bf16 panel kernel was built (a compiler target with AVX512-BF16), else None."""
    return cpu_native.load_with("packed_linear_bf16_available")
