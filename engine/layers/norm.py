"""RMSNorm, computed in fp32 as Llama does, with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one kernel: (x * rstd) * weight
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        residual = x + residual
        return self(residual), residual
