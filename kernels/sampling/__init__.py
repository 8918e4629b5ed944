"""Greedy sampling fused for CPU (csrc/greedy_cpu.cpp, built with the other C++ kernels by kernels/cpu_native.py):
each row's argmax and its finiteness in one pass over the logits."""

from __future__ import annotations

import torch

from .. import cpu_native


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [B, V] -> [B] int64: each row's first maximal index, -1 where the row holds a NaN or an infinity; in
    C++ on CPU float32 (rows contiguous). None where the op does not apply: the caller takes torch's ops."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1:
        return None
    native = cpu_native.load()
    return None if native is None else native.greedy_tokens_cpu(logits)
