"""RMSNorm, computed in fp32 as Llama does, with an optional fused residual add (one C++ pass on CPU, float32 and
bfloat16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused import fused_ops


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self._native(x)
        if native is not None:  # one kernel: round(x * rstd) * weight
            out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
            native.rms_norm_cpu(out, x, self.weight, self.eps)
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). On CPU (float32, bfloat16) both are written in place, into x and
        residual: the callers pass a layer's fresh output and the running residual, which nothing else reads."""
        native = self._native(x) if residual.dtype == x.dtype else None
        if native is None:
            residual = x + residual
            return self(residual), residual
        native.add_rms_norm_cpu(x, residual, self.weight, self.eps)
        return x, residual

    def _native(self, x: torch.Tensor):
        """The C++ ops where they take x ([T, H] rows, the weight of x's dtype), else None."""
        return fused_ops(x) if x.dim() == 2 and self.weight.dtype == x.dtype else None
