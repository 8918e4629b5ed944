"""LoRALinear: a base linear plus the batched LoRA delta of each token's adapter.

    y = base(x);  y[t, slice_s] += (x[t] @ A_i[s].T) @ B_i[s].T,  i = token_adapter_idx[t]   (-1: base only)

Every LoRALinear of a model shares one LoRAContext, which the model runner points at the step's LoraMeta;
the stacked weights are views into the AdapterCache's rows. A batch without adapters costs nothing extra.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora import LoraMeta


class LoRAContext:
    """The current step's LoraMeta for one model's LoRA layers (None: no adapter in this step)."""

    def __init__(self, backend_ops):
        self.ops = backend_ops
        self.meta: LoraMeta | None = None


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        output_slices: tuple[int, ...],
        context: LoRAContext,
    ):
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # [N, S * R, H_in]
        self.lora_b = lora_b  # [N, H_out, R]
        self.output_slices = output_slices
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, H_out]
        meta = self.context.meta
        if meta is None:
            return y
        self.context.ops.add_lora(y, x, self.lora_a, self.lora_b, meta, None, self.output_slices)
        return y
