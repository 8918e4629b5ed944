"""A decoder layer's small ops fused for CPU float32 (csrc/fused_cpu.cpp, built with the other C++ kernels by
kernels/cpu_native.py): RMSNorm with its residual add, SiLU(gate) * up, and rotary embedding in place. Each is one
pass over its rows where torch runs a chain of elementwise kernels and temporaries.

`fused_ops(x)` gives torch.ops.loraplex where they apply to `x` (float32 on CPU, built, not turned off by
LORAPLEX_CPU_KERNELS=0), else None: the caller keeps its torch ops, which are the reference the tests compare with.
"""

from typing import Any

import torch

from .. import cpu_native


def fused_ops(x: torch.Tensor) -> Any:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_native.load()
