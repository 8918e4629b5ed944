"""A decoder layer's small ops fused for CPU float32 and bfloat16 (csrc/fused_cpu.cpp, built with the other C++
kernels by kernels/cpu_native.py): RMSNorm with its residual add, SiLU(gate) * up, and rotary embedding in place.
Each is one pass over its rows where torch runs a chain of elementwise kernels and temporaries.

`fused_ops(x)` gives torch.ops.loraplex where they apply to `x` (float32 or bfloat16 on CPU, built, not turned off by
LORAPLEX_CPU_KERNELS=0), else None: the caller keeps its torch ops, which are the reference the tests compare with.
In bfloat16 they compute in fp32 and round where the torch ops round (after the residual add, the normalized row
before its weight, silu(gate) before the product), so both give the same bf16 values but for a rare last-bit
difference where their fp32 sums are ordered differently.
"""

from typing import Any

import torch

from .. import cpu_native


def fused_ops(x: torch.Tensor) -> Any:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    return cpu_native.load()
