"""Screened greedy heads: greedy tokens of an fp32 LM head at a fraction of its cost, from a cheaper approximate head.

A decode step's LM head is its largest matmul ([B, H] x [H, V], V = 32-49K): 16% of a W1 run in fp32. When every
row of a step only wants its argmax (greedy, no logprobs, no penalties), the head runs in lower precision instead,
and kernels/sampling's screen computes in fp32 only the tokens that the approximation's error bound leaves in the
running: the tokens are those of the fp32 logits' argmax. `ScreenedGreedyHead` runs it in bf16 (oneDNN's prepacked
bf16 GEMM, twice fp32's speed with avx512_bf16 or AMX); `Int8ScreenedGreedyHead` in int8 (torch._int_mm, oneDNN's
VNNI GEMM: 3.8x fp32's speed on a Xeon without bf16), the hidden rows and the head rows each quantized with one
scale a row. The fp32 dense weight they recheck against is the head's own (tied: the embedding table, shared; else
kept beside the packed fp32 copy), and a bf16 copy (1.5x the head's fp32 bytes on an untied model) or an int8 copy
(1.25x) is added. At a decode step's few rows (GEMV_ROWS) the bf16 head is one pass of kernels/sampling's GEMV over
a plain bf16 copy (another half of the fp32 bytes, where the CPU has AVX512-BF16): with one stream it took 0.90 of
the time per token of W1 with oneDNN's GEMM there, 0.95 of the demo's SmolLM2 (2-core Zen 4, same tokens).
"""

from __future__ import annotations

import logging

import torch

from kernels.sampling import (
    UNDECIDED,
    bf16_logits,
    bf16_logits_available,
    screened_greedy_tokens,
    screened_greedy_tokens_int8,
)

logger = logging.getLogger(__name__)

INT8_MAX = 127  # symmetric int8: q in [-127, 127]
CALIBRATION_ROWS = 8  # the int8 head's first call with this many rows picks its layout (fewer: the full head)
EXACT_CHANNEL_SHARES = (0.0, 1 / 64, 1 / 32, 1 / 16)  # of the hidden size, taken exactly, tried at calibration
CALIBRATION_VOCAB_STRIDE = 8  # calibration tries the layouts on every 8th head row
QUANTIZE_ROWS = 4096  # head rows quantized at a time
# Hidden rows up to which the bf16 screen takes kernels/sampling's one-pass GEMV over a plain bf16 copy of the head
# rather than oneDNN's prepacked GEMM: on a 2-core AMD Zen 4, W1's head (32000 x 512), weight cold, paired calls,
# ours / oneDNN's time 0.66-0.88 at 1-3 rows, 0.88-1.05 at 4, 1.02-1.07 at 6, 1.21-1.29 at 16.
GEMV_ROWS = 3


class ScreenedGreedyHead:
    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        self.row_norms = self.weight.norm(dim=1)  # [V]
        weight_bf16 = self.weight.to(torch.bfloat16)  # [V, H]
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, 64)
        # [V, H] bf16 for the GEMV at GEMV_ROWS rows or fewer, where this CPU has it (the head's bf16 bytes again)
        self.plain_bf16 = weight_bf16 if bf16_logits_available() else None

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); None when the bf16
        screen cannot decide (its logits overflowed) or the kernel is missing: the caller computes full logits."""
        approx = self.approx_logits(hidden.to(torch.bfloat16).contiguous())
        token_ids = screened_greedy_tokens(approx, hidden.contiguous(), self.weight, self.row_norms)  # [B]
        if token_ids is None or bool((token_ids == UNDECIDED).any()):
            return None
        return token_ids

    def approx_logits(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] bf16 -> [B, V] bf16 logits, fp32 sums."""
        if self.plain_bf16 is not None and hidden_bf16.shape[0] <= GEMV_ROWS:
            return bf16_logits(hidden_bf16, self.plain_bf16)
        return torch.ops.mkldnn._linear_pointwise(hidden_bf16, self.packed_bf16, None, "none", [], "")


class Int8ScreenedGreedyHead:
    """The head screened by int8 logits. Trained models' final hidden states carry a few outlier channels (SmolLM2's
    largest sits ~40x above the rest): one int8 scale a row would spend its range on them and screen out almost no
    token. So the first call with CALIBRATION_ROWS rows or more picks how many of the largest channels to take
    exactly in fp32 (a small GEMM beside the int8 one) by trying EXACT_CHANNEL_SHARES of them on those rows, and keeps
    the layout with the least estimated cost; where none costs under half the fp32 head's, the screen turns itself
    off (the full head, logged). Exact whatever the rows: a later outlier costs candidates, never a wrong token."""

    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        self.layout: Int8HeadLayout | None = None
        self.off = False  # calibrated, and the screen would not pay here

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); None when the screen
        is not calibrated yet or off, cannot decide (the head holds a NaN or an infinity), or the kernel is missing:
        the caller computes full logits."""
        if self.layout is None and not self.off and hidden.shape[0] >= CALIBRATION_ROWS:
            self.layout = self._calibrate(hidden.contiguous())
        if self.layout is None:
            return None
        screened = self.layout.screen(hidden)
        if screened is None or bool((screened[0] == UNDECIDED).any()):
            return None
        return screened[0]

    def _calibrate(self, hidden: torch.Tensor) -> Int8HeadLayout | None:
        """The layout of least estimated cost on these rows, tried on every CALIBRATION_VOCAB_STRIDE-th head row (a
        few hundred ms for all of them on the full head), in units of one fp32 dot product of a hidden row and a head
        row: the int8 GEMM (~1/4 of fp32's), the exact channels' fp32 GEMM, and twice each candidate (a scattered
        dot). Then builds the chosen one for the whole head."""
        if not bool(torch.isfinite(hidden).all()):
            return None  # no token to learn from: wait for finite rows
        sample = self.weight[::CALIBRATION_VOCAB_STRIDE].contiguous()  # [V / stride, H]
        vocab, dim = sample.shape
        largest = hidden.abs().amax(dim=0).argsort(descending=True)  # [H] channels, largest magnitude first
        best, best_cost, tried = None, float("inf"), []
        for share in EXACT_CHANNEL_SHARES:
            channels = largest[: round(dim * share)].sort().values
            screened = Int8HeadLayout(sample, channels).screen(hidden)
            if screened is None:
                return None
            candidates = screened[1].double().mean().item()
            cost = vocab * (dim - channels.numel()) / (4 * dim) + vocab * channels.numel() / dim + 2 * candidates
            tried.append(f"{channels.numel()}: {candidates:.0f}")
            if cost < best_cost:
                best, best_cost = channels, cost
        self.off = best_cost >= vocab / 2
        logger.info(
            "int8 screened head: candidates a row of %d sampled tokens by channels taken exactly (%s): %s",
            vocab,
            ", ".join(tried),
            "off, the full fp32 head pays better" if self.off else f"{best.numel()} channels exact",
        )
        return None if self.off else Int8HeadLayout(self.weight, best)


class Int8HeadLayout:
    """The head split by hidden channel: `exact_channels` kept in fp32 ([m, V], transposed for a GEMM), the others
    quantized with one int8 scale a vocabulary row ([H - m, V] int8, the column-major B of torch._int_mm)."""

    def __init__(self, weight: torch.Tensor, exact_channels: torch.Tensor):
        """weight [V, H] fp32; exact_channels [m] int64, ascending."""
        kept = torch.ones(weight.shape[1], dtype=torch.bool)
        kept[exact_channels] = False
        self.weight, self.exact_channels = weight, exact_channels
        self.quantized_channels = kept.nonzero().flatten()  # [H - m]
        vocab = weight.shape[0]
        quantized = torch.empty(vocab, self.quantized_channels.numel(), dtype=torch.int8)  # [V, H - m]
        self.terms = torch.empty(4, vocab)  # [4, V]: s_v, |e_v|, |s_v q_v|, |w_v|
        for start in range(0, vocab, QUANTIZE_ROWS):  # in blocks: a large head's fp32 temporaries stay small
            rows = slice(start, start + QUANTIZE_ROWS)
            block = weight[rows]  # [R, H]
            part = block.index_select(1, self.quantized_channels) if exact_channels.numel() else block  # [R, H - m]
            scale, block_quantized, error = _quantize_rows(part)  # [R], [R, H - m], [R]
            quantized[rows] = block_quantized.to(torch.int8)
            dequantized_norm = (block_quantized * scale[:, None]).norm(dim=1)  # [R]
            self.terms[:, rows] = torch.stack([scale, error, dequantized_norm, block.norm(dim=1)])
        self.quantized_t = quantized.t()  # [H - m, V]: a [V, H - m] int8 tensor
        self.exact_t = weight.index_select(1, exact_channels).t().contiguous()  # [m, V]

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [B, H] fp32 -> ([B] tokens, [B] candidates a row) from kernels/sampling's int8 screen."""
        hidden = hidden.contiguous()
        split = self.exact_channels.numel() > 0
        part = hidden.index_select(1, self.quantized_channels) if split else hidden  # [B, H - m]
        scale, quantized, error = _quantize_rows(part)  # [B], [B, H - m], [B]
        dots = torch._int_mm(quantized.to(torch.int8), self.quantized_t)  # [B, V] int32, exact
        exact = hidden.index_select(1, self.exact_channels) @ self.exact_t if split else None  # [B, V]
        hidden_terms = torch.stack([scale, error, part.norm(dim=1)], dim=1)  # [B, 3]
        return screened_greedy_tokens_int8(dots, exact, hidden, hidden_terms, self.weight, self.terms)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] fp32 -> (scale [N], q [N, H] fp32 holding integers in [-127, 127], |x - scale q| [N]): one symmetric
    scale a row, x's largest magnitude on 127."""
    scale = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX  # [N]
    quantized = torch.round(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)  # [N, H]
    error = (x - quantized * scale[:, None]).norm(dim=1)  # [N]
    return scale, quantized, error
