"""A Llama-family model's decoder layers for one decode step as one C++ call (csrc/decode_stack_cpu.cpp, built with
the other C++ kernels by kernels/cpu_native.py): the same kernels as the layer-by-layer forward (fused norms,
the prepacked linears, batched LoRA, rotary, K/V store, paged decode attention), strung together in C++.

`decode_layers_op()` gives the op where it was built, else None; its arguments are described in the C++ file.
"""

from typing import Any

from .. import cpu_native


def decode_layers_op() -> Any:
    native = cpu_native.load()
    return None if native is None else native.decode_layers_cpu
