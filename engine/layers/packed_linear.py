"""PackedLinear: an nn.Linear whose weight is prepacked for oneDNN, for fp32 on x86 CPUs (and bf16 on those with
native bf16 matmuls).

Same math as `F.linear` (only the summation order differs), but oneDNN's blocked weight layout makes the
small-batch GEMMs of decode 1.3-2.5x faster on CPU (the LM head most of all). The runner swaps these in
after loading, as gpt-fast swaps in its quantized linears; CUDA and other half precision keep nn.Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.cpu_features import half_dtype_support

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [out, in]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # opaque oneDNN layout
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU, and bf16 where the CPU has native bf16 matmuls (elsewhere oneDNN would emulate them)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and half_dtype_support("bfloat16")[0])


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of `model` by a PackedLinear (the dense weights are released unless shared,
    like a tied LM head's); returns how many were packed, 0 when this torch build cannot."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    try:
        packed = [(name, PackedLinear(module)) for name, module in targets]
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN
        logger.warning("not packing linear weights for oneDNN: %s", e)
        return 0
    for name, module in packed:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
    return len(packed)
