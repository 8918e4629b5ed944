"""LoRALinear: a base linear plus the batched LoRA delta of each token's adapter.

    y = base(x);  y[t, slice_s] += (x[t] @ A_i[s].T) @ B_i[s].T,  i = token_adapter_idx[t]   (-1: base only)

The stacked weights are views into the AdapterCache's rows (each adapter's scaling already folded into B); the
step's LoraMeta comes with each call. A step without adapters (lora None) costs nothing beyond the base.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora import LoraMeta, get_lora_ops


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        output_slices: tuple[int, ...],
        backend: str = "torch",
    ):
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # [N, S * R, H_in]
        self.lora_b = lora_b  # [N, H_out, R]
        self.output_slices = output_slices
        self.ops = get_lora_ops(backend)

    def forward(self, x: torch.Tensor, lora: LoraMeta | None = None) -> torch.Tensor:
        y = self.base(x)  # [T, H_out]
        if lora is not None:
            self.ops.add_lora(y, x, self.lora_a, self.lora_b, lora, self.output_slices)
        return y


def apply_linear(module: nn.Module, x: torch.Tensor, lora: LoraMeta | None) -> torch.Tensor:
    """module(x) for a LoRA-able projection: with the step's LoRA deltas once the runner has wrapped it in a
    LoRALinear, else the plain (nn.Linear or PackedLinear) base."""
    return module(x, lora) if isinstance(module, LoRALinear) else module(x)
