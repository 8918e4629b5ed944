"""Greedy sampling fused for CPU (csrc/, built with the other C++ kernels by kernels/cpu_native.py): each row's argmax
and its finiteness in one pass over the logits (`greedy_tokens`), and the greedy tokens of an fp32 LM head screened
by its bf16 logits, only the candidates computed in fp32 (`screened_greedy_tokens`)."""

from __future__ import annotations

import torch

from .. import cpu_native

UNDECIDED = -2  # screened_greedy_tokens: the bf16 screen held NaN or Inf; compute the row's full logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [B, V] -> [B] int64: each row's first maximal index, -1 where the row holds a NaN or an infinity; in
    C++ on CPU float32 (rows contiguous). None where the op does not apply: the caller takes torch's ops."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1:
        return None
    native = cpu_native.load()
    return None if native is None else native.greedy_tokens_cpu(logits)


def screened_greedy_tokens(
    approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, row_norms: torch.Tensor
) -> torch.Tensor | None:
    """The argmax of each row of the fp32 logits hidden @ weight.T, from approx, the same logits computed in bf16:
    only tokens whose fp32 logit can still be the row's maximum (given bf16's error bound) are computed in fp32.
    approx [B, V] bf16 · hidden [B, H] fp32 · weight [V, H] fp32 (contiguous) · row_norms [V]: |weight[v]|.
    Returns [B] int64: a token, -1 where the logits are not finite, UNDECIDED where approx is not; None without the
    C++ kernels."""
    native = cpu_native.load()
    return None if native is None else native.screened_greedy_cpu(approx, hidden, weight, row_norms)
