"""Rotary position embedding (neox / Llama layout) with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kernels.fused import fused_ops


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class Rope:
    """One step's rotary inputs, made once and shared by every layer."""

    positions: torch.Tensor  # [T] int64
    table: torch.Tensor  # [max_position, D] fp32: cos | sin halves
    cos: torch.Tensor  # [T, 1, D/2]
    sin: torch.Tensor  # [T, 1, D/2]


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.cos_sin: torch.Tensor | None = None  # [max_position, D]: cos | sin halves, built on first use

    def _build(self, device: torch.device) -> torch.Tensor:
        inv_freq = inv_frequencies(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def table(self, device: torch.device) -> torch.Tensor:
        """[max_position, D] fp32 on `device`: cos | sin halves of each position."""
        if self.cos_sin is None or self.cos_sin.device != device:
            self.cos_sin = self._build(device)
        return self.cos_sin

    def forward(self, positions: torch.Tensor) -> Rope:
        """The step's Rope: cos, sin for each position, [T, 1, D/2] each (fp32), and the table they come from."""
        table = self.table(positions.device)
        cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
        return Rope(positions, table, cos, sin)


def rotate_heads(x: torch.Tensor, heads: int, head_dim: int, rope: Rope) -> torch.Tensor:
    """The first `heads` heads of each row of x [T, W] (W >= heads * head_dim), rotated: [T, heads, head_dim].
    On CPU float32 they are rotated in place in x, in one C++ pass; else into a new tensor by apply_rotary."""
    native = fused_ops(x) if x.stride(-1) == 1 else None  # the table is float32 always (see _build)
    if native is None:
        return apply_rotary(x[:, : heads * head_dim].view(x.shape[0], heads, head_dim), rope.cos, rope.sin)
    native.rotary_neox_cpu(x, rope.positions, rope.table, heads)
    return x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in the rotate-half layout (first half pairs with second half); any strides, so the q and
    k heads of one qkv projection rotate in one call. Four fused multiply-adds into one new [T, H, D] (no cat)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)  # [T, H, D]
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out.to(x.dtype)
