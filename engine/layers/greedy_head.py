"""Screened greedy heads: greedy tokens of an LM head at a fraction of its cost, from a cheaper approximate head.

A decode step's LM head is its largest matmul ([B, H] x [H, V], V = 32-49K): 16% of a W1 run in fp32. When every row
of a step only wants its argmax (greedy, no logprobs, no penalties), the head runs in lower precision instead, and
kernels/sampling's screen computes in fp32 only the tokens that the approximation's error bound leaves in the
running: the tokens are those of the fp32 logits' argmax. `ScreenedGreedyHead` runs it in bf16 (oneDNN's prepacked
bf16 GEMM, twice fp32's speed with avx512_bf16 or AMX); `Int8ScreenedGreedyHead` in int8 (torch._int_mm, oneDNN's
VNNI GEMM: 3.8x fp32's speed on a Xeon without bf16), the hidden rows and the head rows each quantized with one
scale a row. The fp32 dense weight they recheck against is the head's own (tied: the embedding table, shared; else
kept beside the packed fp32 copy), and a bf16 copy (1.5x the head's fp32 bytes on an untied model) or an int8 copy
(1.25x) is added. At a decode step's few rows the head is a stream of its weight, and the int8 screen reads half of
bf16's bytes: where the CPU has AVX512-VNNI, the int8 screen quantizes the rows and takes their dot products in one
pass of kernels/sampling's `int8_logits` (up to INT8_GEMV_ROWS), and the bf16 head takes its steps of 1-3 rows
(GEMV_ROWS) in int8 too (its `few_rows`, another int8 copy, calibrated at start by the runner). With one stream that
took 0.92 of the time per token of W1 with the bf16 GEMV there, 0.98 of the demo's SmolLM2 (2-core Zen 4, same
tokens). Where the int8 screen would not pay (its calibration turns it off) the bf16 head's few rows take
kernels/sampling's bf16 GEMV over a plain bf16 copy made then (AVX512-BF16), 0.90 of oneDNN's time per token of W1
at one stream. A CPU with AVX2 and neither bf16 nor VNNI (AMD Zen 3 and older) gets the int8 head for steps of up to
AVX2_MAX_ROWS rows (the GEMV's AVX2 path; the full fp32 head above). Where kernels/linear's bf16 panels beat oneDNN
(`engine.cpu_features.bf16_panel_linear_wins`: AMD Zen 4) the bf16 screen takes them at every row count instead of
oneDNN's GEMM and the bf16 GEMV: W1's head cold, 0.58-0.68 of oneDNN's time at 1-8 rows, 0.81 at 16-32, 0.91 at 64;
a SmolLM2-sized one 0.70-0.73, 0.88-0.94 and 1.04. A bf16 model's head takes the int8 screen at steps of up to
GEMV_ROWS rows (`Int8ScreenedGreedyHead.for_bf16_model`, over its bf16 rows and an int8 copy): the token is the first
maximum of its logits rounded to bf16, as the argmax of the model's own bf16 logits picks; on that Zen 4 W1 in bf16
took 0.78-0.92 of the time per token at one stream and 0.82-0.86 at 3, the demo's SmolLM2 0.96-0.98 and 0.93-1.01.
"""

from __future__ import annotations

import logging

import torch

from engine.layers.packed_linear import panel_ops_for_weight
from engine.structured_outputs import TokenMask
from kernels.sampling import (
    UNDECIDED,
    bf16_logits,
    bf16_logits_available,
    int8_logits,
    int8_logits_available,
    screened_greedy_tokens,
    screened_greedy_tokens_int8,
)

logger = logging.getLogger(__name__)

INT8_MAX = 127  # symmetric int8: q in [-127, 127]
CALIBRATION_ROWS = 8  # finite hidden rows the int8 head gathers over calls to pick its layout (full head till then)
EXACT_CHANNEL_SHARES = (0.0, 1 / 64, 1 / 32, 1 / 16)  # of the hidden size, taken exactly, tried at calibration
CALIBRATION_VOCAB_STRIDE = 8  # calibration tries the layouts on every 8th head row
# The int8 screen stays on where its estimated cost (in fp32 dot products of a hidden row and a head row) is below
# this share of the vocabulary: half the fp32 head's, and 0.8 of the bf16 head's for a bf16 model's head.
FP32_HEAD_PAYS_BELOW = 0.5
BF16_HEAD_PAYS_BELOW = 0.4
QUANTIZE_ROWS = 4096  # head rows quantized at a time
# Hidden rows up to which the bf16 screen takes kernels/sampling's one-pass GEMV over a plain bf16 copy of the head
# rather than oneDNN's prepacked GEMM: on a 2-core AMD Zen 4, W1's head (32000 x 512), weight cold, paired calls,
# ours / oneDNN's time 0.66-0.88 at 1-3 rows, 0.88-1.05 at 4, 1.02-1.07 at 6, 1.21-1.29 at 16.
GEMV_ROWS = 3
# Hidden rows up to which the int8 screen quantizes them and takes their dot products in one pass of kernels/sampling's
# `int8_logits` (AVX512-VNNI) rather than a dozen torch ops and torch._int_mm: on that Zen 4, the head's weight cold,
# the whole screen took 0.70 / 0.76 / 1.04 / 1.84 / 2.52 ms at 1 / 4 / 8 / 16 / 24 rows against 1.29 / 1.81 / 2.13 /
# 2.59 / 2.98 for W1's head, 1.29 / 1.53 / 2.60 / 4.63 / 6.44 against 2.32 / 4.51 / 4.91 / 5.87 / 6.86 for a SmolLM2
# sized one with 9 channels exact; in the engine at 8 streams 0.89 (W1) and 0.93 (the demo) of the time per token.
INT8_GEMV_ROWS = 16
# Without VNNI (AVX2) only the GEMV pays, and only up to these rows: kernels built for x86-64-v3 on that Zen 4, the
# int8 head's time per token in the engine against the full fp32 head's at 1 / 4 / 8 / 16 streams: W1 0.73 / - /
# 0.95 / 1.05, the demo's SmolLM2 0.89 / 0.91 / 1.01 / 1.05.
AVX2_MAX_ROWS = 8


class ScreenedGreedyHead:
    """The head screened by bf16 logits; at a decode step's few rows (GEMV_ROWS) by int8 ones instead where the CPU
    has the int8 GEMV (`few_rows`, an Int8ScreenedGreedyHead: half the bf16 bytes to read) and its calibration keeps
    it on, else by the bf16 GEMV over a plain bf16 copy made on first use. Until the int8 head has calibrated (the
    runner gives it its rows at start) those steps take oneDNN's bf16 GEMM. Where kernels/linear's bf16 panels win,
    they take every bf16 screen instead of oneDNN's GEMM and the bf16 GEMV. Not above GEMV_ROWS: on that Zen 4 the
    int8 screen's time per token in the engine was 0.88 and 0.94 of bf16's for W1 at 4 and 8 streams, but 1.00 and
    1.05 for the demo's SmolLM2 (its exact channels' GEMM and candidates)."""

    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        self.row_norms = self.weight.norm(dim=1)  # [V]
        self.panels = panel_ops_for_weight(self.weight.shape[0], torch.bfloat16)  # kernels/linear's, where it wins
        if self.panels is not None:  # [V / 16, ceil(H / 2), 16, 2]
            self.packed_bf16 = self.panels.pack_linear_weight_bf16_cpu(self.weight.to(torch.bfloat16))
        else:  # oneDNN's opaque layout
            self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16), 64)
        self.few_rows = Int8ScreenedGreedyHead(self.weight) if int8_logits_available() else None
        # kernels/sampling's bf16_logits up to GEMV_ROWS rows, where the panels do not take every row count
        self.bf16_gemv = self.panels is None and bf16_logits_available()
        self.plain_bf16: torch.Tensor | None = None  # [V, H] bf16 for the bf16 GEMV, made on its first use

    @property
    def int8_few_rows(self) -> bool:
        """Whether steps of up to GEMV_ROWS rows go to the int8 screen (or will, once it has calibrated)."""
        return self.few_rows is not None and not self.few_rows.off

    def tokens(self, hidden: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); mask: tokens refused
        to some rows (a grammar's), which the screen's kernel never takes as candidates: the argmax of the allowed
        tokens' fp32 logits. None when the bf16 screen cannot decide (its logits overflowed), a row refuses every
        token, or the kernel is missing: the caller computes full logits."""
        if mask is not None and mask.refuses_everything():
            return None  # no token allowed: the full logits' path fails the row
        if hidden.shape[0] <= GEMV_ROWS and self.int8_few_rows:
            token_ids = self.few_rows.tokens(hidden, mask)  # None until calibrated, or where int8 cannot decide
            if token_ids is not None:
                return token_ids
        approx = self.approx_logits(hidden.to(torch.bfloat16).contiguous())  # [B, V]
        allowed = allowed_words(mask, hidden.shape[0])  # [B, W] or None
        token_ids = screened_greedy_tokens(approx, hidden.contiguous(), self.weight, self.row_norms, allowed)  # [B]
        if token_ids is None or bool((token_ids == UNDECIDED).any()):
            return None
        return token_ids

    def gather(self, hidden: torch.Tensor) -> None:
        """hidden [n, H] fp32: rows for the int8 screen's calibration (Int8ScreenedGreedyHead.gather)."""
        if self.few_rows is not None:
            self.few_rows.gather(hidden)

    def approx_logits(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] bf16 -> [B, V] bf16 logits, fp32 sums."""
        if self.panels is not None:
            return self.panels.packed_linear_cpu(hidden_bf16, self.packed_bf16, None)
        if hidden_bf16.shape[0] <= GEMV_ROWS and self.bf16_gemv and not self.int8_few_rows:
            if self.plain_bf16 is None:
                self.plain_bf16 = self.weight.to(torch.bfloat16)  # [V, H]
            return bf16_logits(hidden_bf16, self.plain_bf16)
        return torch.ops.mkldnn._linear_pointwise(hidden_bf16, self.packed_bf16, None, "none", [], "")


class Int8ScreenedGreedyHead:
    """The head screened by int8 logits. Trained models' final hidden states carry a few outlier channels (SmolLM2's
    largest sits ~40x above the rest): one int8 scale a row would spend its range on them and screen out almost no
    token. So once it has seen CALIBRATION_ROWS finite hidden rows (the first large batch, or the first steps of one
    stream; the full head till then), it picks how many of the largest channels to take exactly in fp32 (a small GEMM
    beside the int8 one) by trying EXACT_CHANNEL_SHARES of them on those rows, and keeps the layout with the least
    estimated cost; where none costs under half the fp32 head's, the screen turns itself off (the full head, logged).
    Exact whatever the rows: a later outlier costs candidates, never a wrong token."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None, bf16_logits: bool = False):
        """weight: the LM head's [V, H] fp32 weight (bf16 for a bf16 model), before it is packed; max_rows: the most
        hidden rows a call screens (more: None, the full head), where only the one-pass GEMV pays (a CPU without
        VNNI). bf16_logits: the head of a bf16 model (`for_bf16_model`), its tokens the argmax of its logits rounded
        to bf16."""
        self.weight = weight.detach().contiguous()  # [V, H] (the same storage as a tied embedding's)
        self.max_rows = max_rows
        self.bf16_logits = bf16_logits
        self.layout: Int8HeadLayout | None = None
        self.off = False  # calibrated, and the screen would not pay here
        self.gathered: list[torch.Tensor] = []  # finite hidden rows of calls before calibration, [n, H] each

    @classmethod
    def for_bf16_model(cls, weight: torch.Tensor) -> Int8ScreenedGreedyHead:
        """The screen of a bf16 model's head [V, H] bf16, at steps of up to GEMV_ROWS rows (above, the model's own
        bf16 GEMM pays as well): the candidates' dot products read the head's own bf16 rows (an untied head's dense
        weight stays beside its packed copy), and an int8 copy (half its bytes) is added. Its tokens are those of the
        model's bf16 logits, the first of the ties that bf16's rounding makes, except where a candidate's fp32 sum,
        taken in another order than the GEMM's, lies within float rounding of a bf16 rounding boundary
        (kernels/sampling/csrc/screened_greedy_cpu.cpp)."""
        return cls(weight, max_rows=GEMV_ROWS, bf16_logits=True)

    def tokens(self, hidden: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor | None:
        """hidden [B, H] fp32 (bf16 for a bf16 model's head) -> [B] int64 greedy tokens (-1: the row's logits are not
        finite), among the tokens the mask allows where one is given (the kernel never takes a refused one as a
        candidate); None when the screen is not calibrated yet or off, cannot decide (the head holds a NaN or an
        infinity), a row refuses every token, or the kernel is missing: the caller computes full logits."""
        if self.max_rows is not None and hidden.shape[0] > self.max_rows:
            return None
        if mask is not None and mask.refuses_everything():
            return None
        hidden = hidden.float()  # [B, H]; a bf16 model's rows exactly
        self.gather(hidden)
        if self.layout is None:
            return None
        screened = self.layout.screen(hidden, self.bf16_logits, allowed_words(mask, hidden.shape[0]))
        if screened is None or bool((screened[0] == UNDECIDED).any()):
            return None
        return screened[0]

    def gather(self, hidden: torch.Tensor) -> None:
        """hidden [n, H] fp32: keeps its finite rows; once CALIBRATION_ROWS are kept (the runner's prompt at start,
        one large batch, or a few steps of one stream), calibrates on them. Nothing once calibrated (or off)."""
        if self.layout is not None or self.off:
            return
        hidden = hidden.float()
        finite = hidden[torch.isfinite(hidden).all(dim=1)]  # [n, H], a copy
        if finite.shape[0]:
            self.gathered.append(finite)
        if sum(rows.shape[0] for rows in self.gathered) >= CALIBRATION_ROWS:
            rows, self.gathered = torch.cat(self.gathered), []
            self.layout = self._calibrate(rows)

    def _calibrate(self, hidden: torch.Tensor) -> Int8HeadLayout | None:
        """The layout of least estimated cost on these rows, tried on every CALIBRATION_VOCAB_STRIDE-th head row (a
        few hundred ms for all of them on the full head), in units of one fp32 dot product of a hidden row and a head
        row: the int8 GEMM (~1/4 of fp32's), the exact channels' fp32 GEMM, and twice each candidate (a scattered
        dot). Then builds the chosen one for the whole head. Off where that costs half the fp32 head's or more (0.4 of
        it, 0.8 of the bf16 head's ~1/2, for a bf16 model's head)."""
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
        self.off = best_cost >= vocab * (BF16_HEAD_PAYS_BELOW if self.bf16_logits else FP32_HEAD_PAYS_BELOW)
        logger.info(
            "int8 screened head: candidates a row of %d sampled tokens by channels taken exactly (%s): %s",
            vocab,
            ", ".join(tried),
            f"off, the full {'bf16' if self.bf16_logits else 'fp32'} head pays better"
            if self.off
            else f"{best.numel()} channels exact",
        )
        return None if self.off else Int8HeadLayout(self.weight, best)


class Int8HeadLayout:
    """The head split by hidden channel: `exact_channels` kept in fp32 ([m, V], transposed for a GEMM), the others
    quantized with one int8 scale a vocabulary row ([H - m, V] int8, the column-major B of torch._int_mm)."""

    def __init__(self, weight: torch.Tensor, exact_channels: torch.Tensor):
        """weight [V, H] fp32 or bf16 (a bf16 model's head: its terms and exact channels taken in fp32);
        exact_channels [m] int64, ascending."""
        kept = torch.ones(weight.shape[1], dtype=torch.bool)
        kept[exact_channels] = False
        self.weight, self.exact_channels = weight, exact_channels
        self.quantized_channels = kept.nonzero().flatten()  # [H - m]
        vocab = weight.shape[0]
        quantized = torch.empty(vocab, self.quantized_channels.numel(), dtype=torch.int8)  # [V, H - m]
        self.terms = torch.empty(4, vocab)  # [4, V]: s_v, |e_v|, |s_v q_v|, |w_v|
        for start in range(0, vocab, QUANTIZE_ROWS):  # in blocks: a large head's fp32 temporaries stay small
            rows = slice(start, start + QUANTIZE_ROWS)
            block = weight[rows].float()  # [R, H]
            part = block.index_select(1, self.quantized_channels) if exact_channels.numel() else block  # [R, H - m]
            scale, block_quantized, error = _quantize_rows(part)  # [R], [R, H - m], [R]
            quantized[rows] = block_quantized.to(torch.int8)
            dequantized_norm = (block_quantized * scale[:, None]).norm(dim=1)  # [R]
            self.terms[:, rows] = torch.stack([scale, error, dequantized_norm, block.norm(dim=1)])
        self.quantized_t = quantized.t()  # [H - m, V]: a [V, H - m] int8 tensor
        self.one_pass = int8_logits_available()  # kernels/sampling's int8_logits, up to INT8_GEMV_ROWS rows
        self.exact_t = weight.index_select(1, exact_channels).t().float().contiguous()  # [m, V] fp32

    def screen(
        self, hidden: torch.Tensor, bf16_logits: bool = False, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [B, H] fp32 -> ([B] tokens, [B] candidates a row) from kernels/sampling's int8 screen (bf16_logits:
        the argmax of the logits rounded to bf16, a bf16 model's head; allowed: [B, W] words of the tokens each row
        may take, `allowed_words`)."""
        hidden = hidden.contiguous()
        split = self.exact_channels.numel() > 0
        if hidden.shape[0] <= INT8_GEMV_ROWS and self.one_pass:  # one C++ call: quantize, one pass over the head
            channels = self.quantized_channels if split else None
            dots, hidden_terms = int8_logits(hidden, channels, self.quantized_t.t())  # [B, V] int32, [B, 3]
        else:
            part = hidden.index_select(1, self.quantized_channels) if split else hidden  # [B, H - m]
            scale, quantized, error = _quantize_rows(part)  # [B], [B, H - m], [B]
            dots = torch._int_mm(quantized.to(torch.int8), self.quantized_t)  # [B, V] int32, exact
            hidden_terms = torch.stack([scale, error, part.norm(dim=1)], dim=1)  # [B, 3]
        exact = hidden.index_select(1, self.exact_channels) @ self.exact_t if split else None  # [B, V]
        return screened_greedy_tokens_int8(
            dots, exact, hidden, hidden_terms, self.weight, self.terms, bf16_logits, allowed
        )


def allowed_words(mask: TokenMask | None, num_rows: int) -> torch.Tensor | None:
    """The screen kernels' allowed words [num_rows, W] int32 of a mask over some of the rows (the others allow every
    token); None without a mask."""
    if mask is None or len(mask.rows) == num_rows:
        return None if mask is None else mask.words
    words = torch.full((num_rows, mask.words.shape[1]), -1, dtype=torch.int32)  # [B, W]
    words[mask.rows] = mask.words
    return words


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] fp32 -> (scale [N], q [N, H] fp32 holding integers in [-127, 127], |x - scale q| [N]): one symmetric
    scale a row, x's largest magnitude on 127."""
    scale = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX  # [N]
    quantized = torch.round(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)  # [N, H]
    error = (x - quantized * scale[:, None]).norm(dim=1)  # [N]
    return scale, quantized, error
