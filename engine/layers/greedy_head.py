"""Screened greedy heads: greedy tokens of an fp32 LM head at a fraction of its cost, from a cheaper approximate head.

A decode step's LM head is its largest matmul ([B, H] x [H, V], V = 32-49K): 16% of a W1 run in fp32. When every
row of a step only wants its argmax (greedy, no logprobs, no penalties), the head runs in lower precision instead,
and kernels/sampling's screen computes in fp32 only the tokens that the approximation's error bound leaves in the
running: the tokens are those of the fp32 logits' argmax. `ScreenedGreedyHead` runs it in bf16 (oneDNN's prepacked
bf16 GEMM, twice fp32's speed with avx512_bf16 or AMX); `Int8ScreenedGreedyHead` in int8 (torch._int_mm, oneDNN's
VNNI GEMM: 3.8x fp32's speed on a Xeon without bf16), the hidden rows and the head rows each quantized with one
scale a row. The fp32 dense weight they recheck against is the head's own (tied: the embedding table, shared; else
kept beside the packed fp32 copy), and a bf16 copy (1.5x the head's fp32 bytes on an untied model) or an int8 copy
(1.25x) is added.
"""

from __future__ import annotations

import torch

from kernels.sampling import UNDECIDED, screened_greedy_tokens, screened_greedy_tokens_int8

INT8_MAX = 127  # symmetric int8: q in [-127, 127]


class ScreenedGreedyHead:
    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        self.row_norms = self.weight.norm(dim=1)  # [V]
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16), 64)

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); None when the bf16
        screen cannot decide (its logits overflowed) or the kernel is missing: the caller computes full logits."""
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self.packed_bf16, None, "none", [], "")
        token_ids = screened_greedy_tokens(approx, hidden.contiguous(), self.weight, self.row_norms)  # [B]
        if token_ids is None or bool((token_ids == UNDECIDED).any()):
            return None
        return token_ids


class Int8ScreenedGreedyHead:
    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        scale, quantized, error = _quantize_rows(self.weight)  # [V], [V, H], [V]
        self.quantized_t = quantized.to(torch.int8).t()  # [H, V]: a [V, H] int8 tensor, _int_mm's column-major B
        dequantized_norm = (quantized * scale[:, None]).norm(dim=1)  # [V]
        self.terms = torch.stack([scale, error, dequantized_norm, self.weight.norm(dim=1)]).contiguous()  # [4, V]

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); None when the screen
        cannot decide (the head holds a NaN or an infinity) or the kernel is missing: the caller computes full
        logits."""
        hidden = hidden.contiguous()
        scale, quantized, error = _quantize_rows(hidden)  # [B], [B, H], [B]
        dots = torch._int_mm(quantized.to(torch.int8), self.quantized_t)  # [B, V] int32, exact
        hidden_terms = torch.stack([scale, error], dim=1)  # [B, 2]
        token_ids = screened_greedy_tokens_int8(dots, hidden, hidden_terms, self.weight, self.terms)  # [B]
        if token_ids is None or bool((token_ids == UNDECIDED).any()):
            return None
        return token_ids


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] fp32 -> (scale [N], q [N, H] fp32 holding integers in [-127, 127], |x - scale q| [N]): one symmetric
    scale a row, x's largest magnitude on 127."""
    scale = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX  # [N]
    quantized = torch.round(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)  # [N, H]
    error = (x - quantized * scale[:, None]).norm(dim=1)  # [N]
    return scale, quantized, error
