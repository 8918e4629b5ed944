"""PackedLinear: an nn.Linear whose weight is prepacked for a CPU GEMM, for fp32 on x86 CPUs (and bf16 on those with
native bf16 matmuls).

Same math as `F.linear` (only the summation order differs), but a blocked weight layout makes the small-batch GEMMs
of decode 1.3-2.5x faster on CPU (the LM head most of all). Two layouts: oneDNN's (opaque, its own kernels), and for
fp32 where `engine.cpu_features.panel_linear_wins` (AVX2 CPUs without AVX-512, AMD Zen 4, Intel's AVX-512 CPUs),
kernels/linear's panels of 16 columns, whose kernel runs decode shapes another 1.1-1.4x faster than oneDNN's there;
and for bf16 where `engine.cpu_features.bf16_panel_linear_wins` (AMD Zen 4), the same panels with k in pairs for
VDPBF16PS, which stream a decode step's weights at 1-8 rows in ~0.6 of oneDNN's time. The runner swaps these in
after loading, as gpt-fast swaps in its quantized linears; CUDA and other half precision keep nn.Linear.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.cpu_features import bf16_panel_linear_wins, half_dtype_support, panel_linear_wins
from kernels.linear import PANEL_WIDTH, bf16_panel_linear_ops, panel_linear_ops

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, panel_ops: Any = None):
        """panel_ops: kernels/linear's ops to pack into panels of 16 columns (fp32 or bf16, out_features a multiple
        of 16); None: oneDNN's layout."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [out, in]
        self.panel_ops = panel_ops
        if panel_ops is not None and weight.dtype == torch.bfloat16:
            self.packed_weight = panel_ops.pack_linear_weight_bf16_cpu(weight)  # [out / 16, ceil(in / 2), 16, 2]
        elif panel_ops is not None:
            self.packed_weight = panel_ops.pack_linear_weight_cpu(weight)  # [out / 16, in, 16]
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # opaque oneDNN layout
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel_ops is not None:
            rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, self.in_features).contiguous()
            y = self.panel_ops.packed_linear_cpu(rows, self.packed_weight, self.bias)  # [M, out]
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        layout = "panels" if self.panel_ops is not None else "onednn"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"layout={layout}"
        )


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU, and bf16 where the CPU has native bf16 matmuls (elsewhere oneDNN would emulate them)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and half_dtype_support("bfloat16")[0])


def panel_ops_for(linear: nn.Linear) -> Any:
    """kernels/linear's ops where they beat oneDNN for this linear, else None (`panel_ops_for_weight`)."""
    return panel_ops_for_weight(linear.out_features, linear.weight.dtype)


def panel_ops_for_weight(out_features: int, dtype: torch.dtype) -> Any:
    """kernels/linear's ops where they beat oneDNN for a weight of out_features rows of this dtype (fp32 on a CPU
    where `panel_linear_wins`, bf16 where `bf16_panel_linear_wins`; the kernel built, out_features a multiple of 16),
    else None."""
    if out_features % PANEL_WIDTH:
        return None
    if dtype == torch.float32 and panel_linear_wins():
        return panel_linear_ops()
    if dtype == torch.bfloat16 and bf16_panel_linear_wins():
        return bf16_panel_linear_ops()
    return None


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of `model` by a PackedLinear (the dense weights are released unless shared,
    like a tied LM head's); returns how many were packed, 0 when this torch build cannot."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    try:
        packed = [(name, PackedLinear(module, panel_ops_for(module))) for name, module in targets]
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN
        logger.warning("not packing linear weights: %s", e)
        return 0
    for name, module in packed:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
    in_panels = sum(module.panel_ops is not None for _, module in packed)
    if packed:
        logger.info(
            "packed %d linear layers: %d in panels for kernels/linear's kernel, %d for oneDNN",
            len(packed),
            in_panels,
            len(packed) - in_panels,
        )
    return len(packed)
