"""Greedy sampling fused for CPU (csrc/, built with the other C++ kernels by kernels/cpu_native.py): each row's argmax
and its finiteness in one pass over the logits (`greedy_tokens`), and the greedy tokens of an fp32 LM head screened
by its bf16 logits (`screened_greedy_tokens`) or its int8 ones (`screened_greedy_tokens_int8`), only the candidates
computed in fp32; `bf16_logits`: the bf16 screen's logits at a few rows, one pass over the head (AVX512-BF16);
`int8_logits`: the int8 screen's hidden rows quantized and their dot products at a few rows, likewise (VNNI or AVX2)."""

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


def bf16_logits_available() -> bool:
    """Whether the C++ kernels are built with `bf16_logits` (a CPU with AVX512-BF16)."""
    return cpu_native.load_with("bf16_logits_available") is not None


def bf16_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [B, H] bf16 @ weight.T ([V, H] bf16), both contiguous -> [B, V] bf16, fp32 sums: each head row read
    once for all B rows, for a decode step's few (needs `bf16_logits_available()`)."""
    return cpu_native.load().bf16_logits_cpu(hidden, weight)


def int8_logits_available() -> bool:
    """Whether the C++ kernels are built with `int8_logits` (a CPU with AVX512-VNNI, or AVX2)."""
    return cpu_native.load_with("int8_logits_available") is not None


def int8_logits(
    hidden: torch.Tensor, channels: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 screen's inputs at a decode step's few rows: hidden [B, H] fp32 (contiguous), restricted to
    `channels` ([Hq] int64; None: all H), each row quantized with one scale (x = s_h q_h + e_h), and q_h . q_v for
    every row of weight ([V, Hq] int8, contiguous), each head row read once. Returns (dots [B, V] int32,
    hidden_terms [B, 3] fp32: s_h, |e_h|, |x|), as `screened_greedy_tokens_int8` takes them (needs
    `int8_logits_available()`)."""
    return cpu_native.load().int8_logits_cpu(hidden, channels, weight)


def screened_greedy_tokens(
    approx: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_norms: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The argmax of each row of the fp32 logits hidden @ weight.T, from approx, the same logits computed in bf16:
    only tokens whose fp32 logit can still be the row's maximum (given bf16's error bound) are computed in fp32.
    approx [B, V] bf16 · hidden [B, H] fp32 · weight [V, H] fp32 (contiguous) · row_norms [V]: |weight[v]|;
    allowed [B, ceil(V / 32)] int32 or None: bit v % 32 of word v // 32 set where the row may take token v (the
    argmax is then over those; a row must allow one).
    Returns [B] int64: a token, -1 where the logits are not finite, UNDECIDED where approx is not; None without the
    C++ kernels."""
    native = cpu_native.load()
    return None if native is None else native.screened_greedy_cpu(approx, hidden, weight, row_norms, allowed)


def screened_greedy_tokens_int8(
    dots: torch.Tensor,
    exact: torch.Tensor | None,
    hidden: torch.Tensor,
    hidden_terms: torch.Tensor,
    weight: torch.Tensor,
    weight_terms: torch.Tensor,
    bf16_logits: bool = False,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The argmax of each row of the fp32 logits hidden @ weight.T, screened by int8: the hidden channels split into
    a few taken exactly (their part of the logits, `exact`) and the rest quantized, hidden = s_h q_h + e_h and
    weight[v] = s_v q_v + e_v there, `dots` = q_h . q_v; only tokens whose fp32 logit can still be the row's maximum,
    given the quantization errors' bound, are computed in fp32.
    dots [B, V] int32 · exact [B, V] fp32 or None · hidden [B, H] fp32 (all channels) · hidden_terms [B, 3]:
    (s_h, |e_h|, |h| on the quantized channels) · weight [V, H] fp32 or bf16 (contiguous) · weight_terms [4, V]:
    (s_v, |e_v|, |s_v q_v|, |weight[v]|).
    Returns ([B] int64 tokens: -1 where the logits are not finite, UNDECIDED where the screen is not; [B] int64: how
    many tokens of each row were computed in fp32); None without the C++ kernels.
    bf16_logits: a bf16 model's head (hidden and weight hold bf16 values): the argmax of its logits rounded to bf16,
    the first of the ties that rounding makes, as the argmax of the model's own bf16 logits. allowed: as for
    screened_greedy_tokens."""
    native = cpu_native.load()
    if native is None:
        return None
    return native.screened_greedy_int8_cpu(
        dots, exact, hidden, hidden_terms, weight, weight_terms, bf16_logits, allowed
    )
