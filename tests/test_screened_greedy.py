"""The screened greedy heads (engine/layers/greedy_head.py, kernels/sampling's screens), bf16 and int8: their tokens
are the argmax of the fp32 logits, also where bf16 or int8 alone would pick another token, and the engine's greedy
tokens are the same with either head as without it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cpu_features import cpu_flags, half_dtype_support, has_int8_dot
from engine.layers.greedy_head import Int8HeadLayout, Int8ScreenedGreedyHead, ScreenedGreedyHead, _quantize_rows
from engine.llm import LLM
from engine.sampler import NON_FINITE, Sampler, SamplingRow
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.step_forward import SPLIT_HEAD_MIN_ROWS
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
from tests.hf_models import make_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def screen(hidden: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor | None = None) -> torch.Tensor:
    if approx is None:
        approx = hidden.bfloat16() @ weight.bfloat16().T  # [B, V]: what the bf16 head computes
    return screened_greedy_tokens(approx, hidden, weight.contiguous(), weight.norm(dim=1))


@pytest.mark.parametrize("vocab", [7, 16, 1003, 32000])
def test_screened_tokens_are_the_fp32_logits_argmax(vocab, require_cpu_kernel):
    g = torch.Generator().manual_seed(vocab)
    hidden, weight = torch.randn(24, 64, generator=g) * 3, torch.randn(vocab, 64, generator=g) * 0.05
    exact = hidden.double() @ weight.double().T
    assert torch.equal(screen(hidden, weight), exact.argmax(dim=-1))


def test_near_ties_that_bf16_gets_wrong_are_settled_in_fp32(require_cpu_kernel):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(32, 64, generator=g)
    weight = torch.randn(500, 64, generator=g) * 0.02
    for b in range(32):  # tokens 100 + b and 300 + b: nearly the same row, the later one 1e-3 higher in fp32
        weight[300 + b] = weight[100 + b] = hidden[b] / hidden[b].norm() * 3.0
        weight[300 + b] += hidden[b] / hidden[b].norm() ** 2 * 1e-3
    exact = hidden.double() @ weight.double().T
    approx = hidden.bfloat16() @ weight.bfloat16().T
    assert torch.equal(exact.argmax(dim=-1), torch.arange(300, 332))
    assert not torch.equal(approx.float().argmax(dim=-1), exact.argmax(dim=-1))  # bf16 alone is wrong somewhere
    assert torch.equal(screen(hidden, weight, approx), exact.argmax(dim=-1))


def test_a_non_finite_hidden_state_gives_no_token_and_an_overflowed_screen_cannot_decide(require_cpu_kernel):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 32, generator=g), torch.randn(100, 32, generator=g)
    hidden[1, 4] = float("nan")
    approx = hidden.bfloat16() @ weight.bfloat16().T
    approx[2, 7] = float("inf")
    tokens = screen(hidden, weight, approx)
    assert tokens[1] == NON_FINITE and tokens[2] == UNDECIDED
    assert tokens[0] == (hidden[0].double() @ weight.double().T).argmax()


@pytest.fixture
def require_bf16_logits(require_cpu_kernel):
    if not bf16_logits_available():
        pytest.skip("the one-pass bf16 GEMV needs a CPU with AVX512-BF16")


@pytest.mark.parametrize("dim", [64, 100, 576])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_the_bf16_gemv_holds_the_screens_error_bound(rows, dim, require_bf16_logits):
    """Within the bound the bf16 screen assumes (2^-6 |h| |w_v| + 2^-7 |a_v|) of the exact logits, and one bf16
    rounding from bf16 inputs summed in fp32; rows past a block of 8 and dims off a multiple of 64 included."""
    g = torch.Generator().manual_seed(rows * dim)
    hidden, weight = torch.randn(rows, dim, generator=g) * 3, torch.randn(1003, dim, generator=g) * 0.05
    got = bf16_logits(hidden.bfloat16(), weight.bfloat16().contiguous()).float()  # [rows, 1003]
    exact = hidden.double() @ weight.double().T
    bound = 2**-6 * hidden.double().norm(dim=1)[:, None] * weight.double().norm(dim=1) + 2**-7 * got.abs()
    assert bool(((got - exact).abs() <= bound).all())
    of_bf16_inputs = hidden.bfloat16().double() @ weight.bfloat16().double().T
    torch.testing.assert_close(got.double(), of_bf16_inputs, rtol=2**-8, atol=1e-4)  # one rounding; fp32 sums


def test_the_bf16_head_takes_the_gemv_at_a_few_rows_and_onednn_above(require_bf16_logits, monkeypatch):
    from engine.layers import greedy_head

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs no bf16 weights on this CPU, so the bf16 screened head cannot be built")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3000, 64, generator=g) * 0.05
    head = ScreenedGreedyHead(weight)
    head.few_rows = None  # as on a CPU without the int8 GEMV (the test below takes it)
    calls = []
    monkeypatch.setattr(greedy_head, "bf16_logits", lambda h, w: calls.append(h.shape[0]) or bf16_logits(h, w))
    for rows in (1, greedy_head.GEMV_ROWS, greedy_head.GEMV_ROWS + 1, 16):
        hidden = torch.randn(rows, 64, generator=g) * 3
        assert torch.equal(head.tokens(hidden), (hidden.double() @ weight.double().T).argmax(dim=-1))
    assert calls == [1, greedy_head.GEMV_ROWS]


def kernels_of_steps_of(head, weight, g, calls: list[str], steps) -> list[tuple[int, list[str]]]:
    """[(rows, the kernels `calls` recorded)] for a greedy step of each row count in `steps`, each step's tokens
    checked against the fp64 argmax of its logits."""
    taken = []
    for rows in steps:
        hidden = torch.randn(rows, weight.shape[1], generator=g) * 3
        calls.clear()
        assert torch.equal(head.tokens(hidden), (hidden.double() @ weight.double().T).argmax(dim=-1))
        taken.append((rows, list(calls)))
    return taken


@pytest.mark.parametrize("vocab", [3000, 20])
def test_the_bf16_head_screens_a_few_rows_in_int8_once_calibrated(vocab, require_bf16_logits, monkeypatch):
    """Steps of one to three rows: oneDNN's bf16 GEMM until the int8 head has its calibration rows (the runner gives
    them at start), the int8 GEMV after (half the bytes); where the int8 screen turns itself off (a vocabulary too
    small to pay), the bf16 GEMV. Steps of more rows always take oneDNN's bf16 GEMM. Every token is the fp32
    argmax."""
    from engine.layers import greedy_head

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs no bf16 weights on this CPU, so the bf16 screened head cannot be built")
    if not int8_logits_available():
        pytest.skip("the one-pass int8 GEMV needs a CPU with AVX512-VNNI or AVX2")
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 64, generator=g) * 0.05
    head = ScreenedGreedyHead(weight)
    calls = []
    for name in ("bf16_logits", "int8_logits"):
        kernel = getattr(greedy_head, name)
        monkeypatch.setattr(greedy_head, name, lambda *a, name=name, k=kernel: calls.append(name) or k(*a))

    def kernels_of_steps(*steps: int) -> list[tuple[int, list[str]]]:
        return kernels_of_steps_of(head, weight, g, calls, steps)

    assert kernels_of_steps(1, 3, 16) == [(1, []), (3, []), (16, [])]  # 4 rows of 8 gathered: not calibrated yet
    head.gather(torch.randn(4, 64, generator=g))
    few = ["bf16_logits"] if vocab == 20 else ["int8_logits"]
    assert kernels_of_steps(1, 3, 4, 16, 2) == [(1, few), (3, few), (4, []), (16, []), (2, few)]
    assert head.few_rows.off == (vocab == 20) and (head.plain_bf16 is not None) == (vocab == 20)


@pytest.mark.parametrize("vocab", [3008, 32])
def test_the_bf16_head_takes_the_bf16_panels_where_they_win(vocab, require_cpu_kernel, monkeypatch):
    """Where kernels/linear's bf16 panels win (AMD Zen 4), every bf16 screen takes them, oneDNN's GEMM and the bf16
    GEMV none; steps of one to three rows still go to the int8 screen once calibrated, unless it turns itself off (a
    vocabulary of 32). Elsewhere the head keeps oneDNN's layout. Every token is the fp32 argmax."""
    from engine.layers import greedy_head, packed_linear
    from kernels.linear import bf16_panel_linear_ops

    ops = bf16_panel_linear_ops()
    if ops is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("the bf16 panels need a build for AVX512-BF16 (and the head a CPU whose bf16 oneDNN packs)")
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 64, generator=g) * 0.05
    monkeypatch.setattr(packed_linear, "bf16_panel_linear_wins", lambda: False)
    assert ScreenedGreedyHead(weight).panels is None  # oneDNN's layout
    monkeypatch.setattr(packed_linear, "bf16_panel_linear_wins", lambda: True)
    head = ScreenedGreedyHead(weight)
    assert head.panels is ops and head.packed_bf16.shape == (vocab // 16, 32, 16, 2)
    calls = []

    class Spy:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(ops, name)(*a)

    head.panels = Spy()
    for name in ("bf16_logits", "int8_logits"):
        kernel = getattr(greedy_head, name)
        monkeypatch.setattr(greedy_head, name, lambda *a, name=name, k=kernel: calls.append(name) or k(*a))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append("onednn"))

    def kernels_of_steps(*steps: int) -> list[tuple[int, list[str]]]:
        return kernels_of_steps_of(head, weight, g, calls, steps)

    panels = ["packed_linear_cpu"]
    assert kernels_of_steps(1, 3, 16) == [(1, panels), (3, panels), (16, panels)]  # not calibrated yet
    head.gather(torch.randn(4, 64, generator=g))
    few = panels if vocab == 32 else ["int8_logits"]
    assert kernels_of_steps(1, 3, 4, 64) == [(1, few), (3, few), (4, panels), (64, panels)]
    assert head.few_rows.off == (vocab == 32) and head.plain_bf16 is None


def int8_screen(
    hidden: torch.Tensor, weight: torch.Tensor, exact_channels: list[int] = (), at_a_time: int | None = None
) -> torch.Tensor:
    """The int8 screen's tokens for hidden's rows, `at_a_time` rows a call (None: all in one call; the one-pass GEMV
    takes calls of up to INT8_GEMV_ROWS rows where the CPU has it, torch._int_mm larger ones)."""
    layout = Int8HeadLayout(weight.contiguous(), torch.tensor(exact_channels, dtype=torch.long))
    return torch.cat([layout.screen(rows)[0] for rows in hidden.split(at_a_time or hidden.shape[0])])


AT_A_TIME = [None, 1, 3]  # rows a call: all at once, and a decode step's few


@pytest.fixture
def require_int8_logits(require_cpu_kernel):
    if not int8_logits_available():
        pytest.skip("the one-pass int8 GEMV needs a CPU with AVX512-VNNI or AVX2")


@pytest.mark.parametrize("channels", [None, [0, 5, 63]])
@pytest.mark.parametrize("dim", [64, 100, 576])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_the_int8_gemv_gives_int_mms_dots_of_the_rows_quantized_as_the_head_quantizes(
    rows, dim, channels, require_int8_logits
):
    """Each hidden row quantized as _quantize_rows does (restricted to its channels, all others dropped) and its int8
    dot product with each head row, exact; rows past a block of 8 and dims off a multiple of 64 included."""
    g = torch.Generator().manual_seed(rows * dim)
    hidden = torch.randn(rows, dim, generator=g) * 3
    hidden[0, dim // 2] = 90.0  # an outlier: every other value of its row rounds coarsely
    kept = torch.tensor([k for k in range(dim) if channels is None or k not in channels])
    part = hidden.index_select(1, kept)  # [rows, Hq]
    weight = torch.randint(-127, 128, (1003, kept.numel()), dtype=torch.int8, generator=g)
    dots, terms = int8_logits(hidden, None if channels is None else kept, weight)
    scale, quantized, error = _quantize_rows(part)
    assert torch.equal(dots, quantized.to(torch.int32) @ weight.to(torch.int32).T)
    torch.testing.assert_close(terms, torch.stack([scale, error, part.norm(dim=1)], dim=1), rtol=1e-5, atol=1e-6)


def test_the_int8_screen_takes_the_gemv_at_a_few_rows_and_int_mm_above(require_int8_logits, monkeypatch):
    from engine.layers import greedy_head

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3000, 64, generator=g) * 0.05
    layout = Int8HeadLayout(weight, torch.tensor([2, 40]))
    calls = []
    monkeypatch.setattr(greedy_head, "int8_logits", lambda h, c, w: calls.append(h.shape[0]) or int8_logits(h, c, w))
    for rows in (1, greedy_head.INT8_GEMV_ROWS, greedy_head.INT8_GEMV_ROWS + 1, 40):
        hidden = torch.randn(rows, 64, generator=g) * 3
        assert torch.equal(layout.screen(hidden)[0], (hidden.double() @ weight.double().T).argmax(dim=-1))
    assert calls == [1, greedy_head.INT8_GEMV_ROWS]


@pytest.mark.parametrize("at_a_time", AT_A_TIME)
@pytest.mark.parametrize("exact_channels", [[], [0, 5, 63]])
@pytest.mark.parametrize("vocab", [7, 16, 1003, 32000])
def test_int8_screened_tokens_are_the_fp32_logits_argmax(vocab, exact_channels, at_a_time, require_cpu_kernel):
    g = torch.Generator().manual_seed(vocab)
    hidden, weight = torch.randn(24, 64, generator=g) * 3, torch.randn(vocab, 64, generator=g) * 0.05
    hidden[3] = 0.0  # a row of zeros: its scale is the smallest float, every logit 0, token 0
    exact = hidden.double() @ weight.double().T
    assert torch.equal(int8_screen(hidden, weight, exact_channels, at_a_time), exact.argmax(dim=-1))


@pytest.mark.parametrize("at_a_time", AT_A_TIME)
def test_near_ties_that_int8_gets_wrong_are_settled_in_fp32(at_a_time, require_cpu_kernel):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(32, 64, generator=g)
    weight = torch.randn(500, 64, generator=g) * 0.02
    for b in range(32):  # tokens 100 + b and 300 + b: the same int8 row, the later one higher in fp32
        row = hidden[b] / hidden[b].norm() * 3.0
        scale = row.abs().max() / 127
        row = torch.round(row / scale) * scale  # exactly its int8 values times its scale
        k = int((row.abs() < row.abs().max() - scale).nonzero()[0])  # not the largest: the scale stays
        weight[300 + b] = weight[100 + b] = row
        weight[300 + b, k] += 0.2 * scale * hidden[b, k].sign()  # rounds back to the same int8 value
    exact = hidden.double() @ weight.double().T
    layout = Int8HeadLayout(weight, torch.tensor([], dtype=torch.long))
    assert torch.equal(layout.quantized_t.t()[100:132], layout.quantized_t.t()[300:332])
    assert torch.equal(layout.terms[0, 100:132], layout.terms[0, 300:332])  # int8 alone sees ties: it picks 100 + b
    assert torch.equal(exact.argmax(dim=-1), torch.arange(300, 332))
    assert torch.equal(int8_screen(hidden, weight, at_a_time=at_a_time), exact.argmax(dim=-1))


@pytest.mark.parametrize("at_a_time", AT_A_TIME)
def test_int8_screen_counts_the_hidden_rows_rounding_error(at_a_time, require_cpu_kernel):
    """Two head rows exact in int8 (no error of their own), v and v + 1 = v + (channels 1 and 2) - channel 3, and
    hidden rows whose channels 1, 2, 3 (0.6, 0.6, 1.4 at scale 1) round to 1, 1, 1: int8 puts v + 1 a whole step
    above v, fp32 puts it 0.2 below. Only the hidden rows' own rounding error (|e_h| |s_v q_v|) keeps v in the
    running."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.rand(6, 64, generator=g) * 2 - 1  # [6, 64]
    hidden[:, 1:4] = torch.tensor([0.6, 0.6, 1.4])
    hidden[torch.arange(6), torch.arange(6) + 8] = 127.0  # each row's own largest channel: scale 1; q 1, 1, 1
    step = 1 / 128  # the head rows' scale (power of two: their int8 values times it are exact)
    weight = torch.round((torch.rand(300, 64, generator=g) * 2 - 1) * 60) * step  # [300, 64], logits well below
    for b in range(6):
        v = 40 * b + 7
        weight[v] = 0.0
        weight[v, 8 + b] = 127 * step
        weight[v + 1] = weight[v]
        weight[v + 1, 1:4] += torch.tensor([step, step, -step])
    exact = hidden.double() @ weight.double().T
    assert torch.equal(exact.argmax(dim=-1), torch.arange(6) * 40 + 7)
    assert torch.equal(int8_screen(hidden, weight, at_a_time=at_a_time), exact.argmax(dim=-1))


@pytest.mark.parametrize("at_a_time", AT_A_TIME)
def test_int8_screen_bounds_hold_where_quantization_errs_most(at_a_time, require_cpu_kernel):
    """Rows with one outlier each (the scale set by it, every other value rounded coarsely), a head with outliers
    too: the screen's bound must still cover the error, so its tokens stay the fp32 argmax."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(16, 96, generator=g), torch.randn(4000, 96, generator=g) * 0.05
    hidden[torch.arange(16), torch.arange(16)] = 400.0
    weight[::7, 11] = -6.0
    exact = hidden.double() @ weight.double().T
    assert torch.equal(int8_screen(hidden, weight, at_a_time=at_a_time), exact.argmax(dim=-1))
    assert torch.equal(int8_screen(hidden, weight, [3, 11, 40], at_a_time), exact.argmax(dim=-1))


def test_int8_head_takes_outlier_channels_exactly_and_turns_off_where_it_cannot_pay(require_cpu_kernel, caplog):
    """Hidden rows like a trained model's (a few channels 400x the rest): the head's calibration, on the finite rows
    of its first calls (a stream's steps of one row each), takes channels exactly, which leaves few candidates, and
    its tokens are the fp32 argmax; on a vocabulary too small to pay for the screen it turns itself off (None: the
    full head)."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(32, 256, generator=g), torch.randn(20000, 256, generator=g) * 0.05
    hidden[:, [7, 99, 200]] *= 400.0
    weight[:, [7, 99, 200]] /= 400.0  # as in trained heads: the outliers move every logit about alike
    exact = hidden.double() @ weight.double().T
    head = Int8ScreenedGreedyHead(weight)
    for b in range(4):  # too few rows to calibrate on: the full head
        assert head.tokens(hidden[b : b + 1]) is None and head.layout is None
    not_finite = hidden[4:8].clone()
    not_finite[1, 3] = float("nan")
    assert head.tokens(not_finite) is None and head.layout is None  # 7 finite rows gathered: the NaN row is not
    with caplog.at_level("INFO", logger="engine.layers.greedy_head"):
        assert torch.equal(head.tokens(hidden[8:10]), exact[8:10].argmax(dim=-1))  # the 8th row: calibrated
    assert torch.equal(head.tokens(hidden), exact.argmax(dim=-1))
    assert set(head.layout.exact_channels.tolist()) >= {7, 99, 200}
    assert head.layout.screen(hidden)[1].double().mean() < 200  # candidates a row, of 20,000
    assert torch.equal(head.tokens(hidden[:3]), exact[:3].argmax(dim=-1))  # calibrated: any number of rows
    assert "channels exact" in caplog.text
    small = Int8ScreenedGreedyHead(weight[:20])
    assert small.tokens(hidden) is None and small.off


def test_an_int8_head_of_a_few_rows_leaves_larger_steps_to_the_full_head(require_int8_logits):
    """The head a CPU without VNNI gets (max_rows: only the one-pass GEMV pays there): steps of more rows get None
    (the caller's full head), and gather nothing for the calibration; steps of up to max_rows get the fp32 argmax."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(3000, 64, generator=g) * 0.05
    head = Int8ScreenedGreedyHead(weight, max_rows=4)
    assert head.tokens(torch.randn(8, 64, generator=g)) is None and head.layout is None and not head.gathered
    head.gather(torch.randn(8, 64, generator=g))  # the runner's prompt at start
    for rows, screened in ((5, False), (4, True), (1, True)):
        hidden = torch.randn(rows, 64, generator=g) * 3
        tokens = head.tokens(hidden)
        assert (tokens is not None) == screened
        if screened:
            assert torch.equal(tokens, (hidden.double() @ weight.double().T).argmax(dim=-1))


def bf16_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The greedy tokens of a bf16 model's head: the first maximum of its fp32 sums rounded to bf16."""
    return (hidden.double() @ weight.double().T).float().bfloat16().argmax(dim=-1)  # the first of equal maxima


def test_a_bf16_heads_screen_takes_the_first_of_the_ties_bf16_rounding_makes(require_cpu_kernel):
    """Token 3's logit 1 - 2^-10 and token 20's 1 + 2^-10 both round to 1.0 in bf16: the bf16 model's argmax is 3,
    though 20 is higher in fp32 and the screen's bound is tight enough (every channel exact) to drop 3 from an fp32
    screen. The bf16 screen keeps it (its floor lowered by the ties' reach) and rounds before comparing."""
    hidden = torch.zeros(1, 8)
    hidden[0, :2] = 1.0
    weight = torch.zeros(40, 8)
    weight[:, 0] = -4.0
    weight[3, :2] = torch.tensor([1.0, -(2.0**-10)])
    weight[20, :2] = torch.tensor([1.0, 2.0**-10])
    logits = hidden @ weight.T  # [1, 40], exact: every value is a bf16 value, and so is each product
    assert logits[0, 3] < logits[0, 20] and logits[0, 3].bfloat16() == logits[0, 20].bfloat16()
    terms = torch.zeros(4, 40)  # every channel exact: no int8 part, its scales and errors 0
    terms[3] = weight.norm(dim=1)

    def tokens_and_candidates(bf16_logits: bool) -> tuple[int, int]:
        dots, hidden_terms = torch.zeros(1, 40, dtype=torch.int32), torch.zeros(1, 3)
        tokens, counts = screened_greedy_tokens_int8(dots, logits, hidden, hidden_terms, weight, terms, bf16_logits)
        return int(tokens[0]), int(counts[0])

    assert tokens_and_candidates(False) == (20, 1)  # fp32: 3 is screened out
    assert tokens_and_candidates(True) == (3, 2)
    assert int(bf16_argmax(hidden, weight)[0]) == 3


def tying_logits(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [rows, 64] and weight [3000, 64] of small integers (bf16 values): every logit is an exact integer in
    fp32 whatever the order of the sum, 4352-5341 here, where bf16 (8 significant bits) rounds to multiples of 32, so
    rows' top logits often tie after rounding."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-6, 7, (rows, 64), generator=g).float()
    weight = torch.randint(-6, 7, (3000, 64), generator=g).float()
    hidden[:, 9], weight[:, 9] = 8.0, 600.0  # every logit shifted up by 4800
    return hidden, weight


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("at_a_time", AT_A_TIME)
@pytest.mark.parametrize("exact_channels", [[], [0, 5, 63]])
def test_a_bf16_heads_screen_gives_the_argmax_of_its_bf16_logits(
    exact_channels, at_a_time, weight_dtype, require_cpu_kernel
):
    """The token is the first of the top logits that tie after rounding to bf16 (9 of the 24 rows have such ties);
    the head's rows in fp32 or in bf16 (a bf16 model's own, read as they are), the same values."""
    hidden, weight = tying_logits(24, seed=7)
    rounded = (hidden @ weight.T).bfloat16().float()  # [24, 3000]
    assert int(((rounded == rounded.amax(dim=1, keepdim=True)).sum(dim=1) > 1).sum()) >= 6  # rows with ties at top
    assert not torch.equal((hidden @ weight.T).argmax(dim=-1), bf16_argmax(hidden, weight))  # fp32's argmax differs
    layout = Int8HeadLayout(weight.to(weight_dtype), torch.tensor(exact_channels, dtype=torch.long))
    tokens = torch.cat([layout.screen(rows, bf16_logits=True)[0] for rows in hidden.split(at_a_time or 24)])
    assert torch.equal(tokens, bf16_argmax(hidden, weight))


def test_a_bf16_models_head_screens_steps_of_a_few_rows_in_bf16s_terms(require_int8_logits):
    """Int8ScreenedGreedyHead.for_bf16_model: the head's bf16 weight and bf16 hidden rows in; steps of up to GEMV_ROWS
    rows give the argmax of the bf16 logits once calibrated, the first of their ties, larger ones None (the model's
    own head)."""
    from engine.layers import greedy_head

    hidden, weight = tying_logits(32, seed=8)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()  # exactly
    head = Int8ScreenedGreedyHead.for_bf16_model(weight)
    assert head.weight.data_ptr() == weight.data_ptr()  # the head's own bf16 rows, no fp32 copy
    head.gather(hidden[:8])  # the runner's prompt at start
    assert head.layout is not None
    tokens = torch.cat([head.tokens(rows) for rows in hidden[8:].split(greedy_head.GEMV_ROWS)])
    assert torch.equal(tokens, bf16_argmax(hidden[8:].float(), weight.float()))
    assert head.tokens(hidden[: greedy_head.GEMV_ROWS + 1]) is None


def test_int8_screen_without_a_finite_head_or_hidden_state(require_cpu_kernel):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 32, generator=g), torch.randn(100, 32, generator=g)
    hidden[1, 4] = float("nan")
    tokens = int8_screen(hidden, weight)
    assert tokens[1] == NON_FINITE
    assert tokens[0] == (hidden[0].double() @ weight.double().T).argmax()
    weight[7, 3] = float("inf")
    assert int8_screen(hidden[:1], weight)[0] == UNDECIDED  # the screen cannot tell: the head takes full logits


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("screened")
    hf = make_model(directory, tokenizer, "llama")
    llm = LLM(model=str(directory), dtype="float32", device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
    return llm, hf.lm_head.weight.detach()  # the head's fp32 weight (ours is packed for oneDNN, no dense copy)


@pytest.mark.parametrize("head_type", [ScreenedGreedyHead, Int8ScreenedGreedyHead])
def test_the_engine_gives_the_same_greedy_tokens_with_the_screened_head_as_without(llm, head_type, require_cpu_kernel):
    # oneDNN's own check: it packs no bf16 weights without avx512bw or avx_ne_convert (AVX2 CPUs); the runner builds
    # no bf16 screened head there (the test below holds it to that)
    if head_type is ScreenedGreedyHead and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs no bf16 weights on this CPU, so the bf16 screened head cannot be built")
    llm, head_weight = llm
    runner = llm.engine.runner
    saved = runner.greedy_head
    runner.greedy_head = head_type(head_weight)  # on a CPU without native bf16 (or VNNI) only slower
    if head_type is Int8ScreenedGreedyHead:  # screen every step, with two channels exact (uncalibrated)
        runner.greedy_head.layout = Int8HeadLayout(runner.greedy_head.weight, torch.tensor([1, 17]))
    calls = []
    tokens_of = runner.greedy_head.tokens
    runner.greedy_head.tokens = lambda hidden, mask=None: calls.append(hidden.shape[0]) or tokens_of(hidden, mask)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    screened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls and sum(calls) == 4 * 10  # every step's tokens came from the screened head
    one = [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]  # steps of one row (the GEMV's)
    assert calls[-10:] == [1] * 10
    head, runner.greedy_head = runner.greedy_head, None
    try:
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        full_one = [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params)]
    finally:
        runner.greedy_head = head
    assert screened == full and one == full_one
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    calls.clear()
    llm.generate(prompts[:1], with_logprobs)
    assert not calls  # a row that reads its logits takes the full head
    runner.greedy_head = saved


def test_greedy_rows_beside_rows_that_need_logits_take_the_screened_head_alone(llm, require_cpu_kernel):
    """SPLIT_HEAD_MIN_ROWS greedy rows beside a sampled one, one with logprobs and one held to a regex: the greedy
    rows' tokens come from the screened head (its steps see them alone), the others' from their own full logits;
    every token and logprob is the one the engine gives without the screened head. Greedy rows held to a grammar,
    with min_tokens' ban or without, and one with the ban alone count among the screened ones."""
    llm, _ = llm
    runner = llm.engine.runner
    if runner.greedy_head is None:
        pytest.skip("this CPU builds no screened head")
    calls = []
    tokens_of = runner.greedy_head.tokens
    runner.greedy_head.tokens = lambda hidden, mask=None: calls.append(hidden.shape[0]) or tokens_of(hidden, mask)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    others = [
        SamplingParams(temperature=0.9, seed=4, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.0, max_tokens=8, min_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
        ),
    ]
    # greedy under a grammar: screened with its mask
    held = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{8}"))
    banned = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)  # eos refused until the 8th token
    params = [*others, held, banned, *[greedy] * SPLIT_HEAD_MIN_ROWS]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (len(params),))]
    head = runner.greedy_head
    try:
        split = llm.generate(prompts, params)
        # the decode steps screened the greedy rows apart from the rest, the two held to a grammar (one with
        # min_tokens' ban) and the one with the ban alone with them while they ran
        assert sum(SPLIT_HEAD_MIN_ROWS <= c <= SPLIT_HEAD_MIN_ROWS + 3 for c in calls) >= 7
        assert max(calls) == SPLIT_HEAD_MIN_ROWS + 3
        runner.greedy_head = None
        full = llm.generate(prompts, params)
    finally:
        runner.greedy_head = head
        del head.tokens
    for ours, theirs in zip(split, full):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    got, want = split[1].outputs[0].logprobs, full[1].outputs[0].logprobs
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-5)


def packed_mask(rows: list[int], refused: torch.Tensor) -> TokenMask:
    """refused [C, V] bool as a TokenMask: bit t % 32 of word t // 32 set where token t is allowed."""
    vocab = refused.shape[1]
    words = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= (~refused[:, t]).long() << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return TokenMask(rows, words, vocab, torch.device("cpu"))


def test_the_heads_screen_masked_rows_to_the_allowed_tokens_argmax(require_bf16_logits):
    """A grammar's mask on some rows, the bf16 head and the int8 one: each masked row's token is the argmax of its fp32
    logits over the tokens it allows, also where that is far below the row's own maximum; a row that allows nothing
    is left to the full head."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs no bf16 weights on this CPU")
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(1003, 64, generator=g)
    hidden = torch.randn(5, 64, generator=g) * 3
    logits = hidden @ weight.T  # [5, V]
    refused = torch.rand(3, 1003, generator=g) < 0.9  # [3, V]: rows 0, 2 and 4 allow a tenth of the tokens
    refused[1, logits[2].topk(50).indices] = True  # row 2 refuses its 50 best
    mask = packed_mask([0, 2, 4], refused)
    head = ScreenedGreedyHead(weight)
    expected = logits.argmax(dim=1)
    expected[[0, 2, 4]] = logits[[0, 2, 4]].masked_fill(refused, -torch.inf).argmax(dim=1)
    assert head.tokens(hidden, mask).tolist() == expected.tolist()
    assert expected[2] != logits[2].argmax()
    nothing = refused.clone()
    nothing[1] = True
    assert head.tokens(hidden, packed_mask([0, 2, 4], nothing)) is None
    assert (packed_mask([1], refused[:1]).refused == refused[:1]).all()  # the layout the kernel reads, round trip
    int8_head = Int8ScreenedGreedyHead(weight)
    int8_head.layout = Int8HeadLayout(int8_head.weight, torch.tensor([1, 17]))  # screen every call, two exact channels
    assert int8_head.tokens(hidden, mask).tolist() == expected.tolist()
    assert int8_head.tokens(hidden, packed_mask([0, 2, 4], nothing)) is None


def test_a_bf16_engine_gives_the_same_greedy_tokens_with_the_screened_head_as_without(
    tmp_path_factory, tokenizer, require_int8_logits
):
    """A bf16 model: the runner builds the int8 head of a bf16 model, steps of up to GEMV_ROWS rows take their tokens
    from it, and the tokens are those of the model's own bf16 head (its tie rule is held by the kernel tests above:
    this tiny model's logits need not tie), and --no-screened-greedy builds none."""
    from engine.layers import greedy_head

    directory = tmp_path_factory.mktemp("screened_bf16")
    make_model(directory, tokenizer, "llama")
    llm = LLM(model=str(directory), dtype="bfloat16", device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
    runner = llm.engine.runner
    head = runner.greedy_head
    assert isinstance(head, Int8ScreenedGreedyHead) and head.bf16_logits and head.max_rows == greedy_head.GEMV_ROWS
    assert head.layout is not None or head.off  # calibrated at start
    # screen every step (a tiny vocabulary's calibration may turn it off)
    head.layout, head.off = Int8HeadLayout(head.weight, torch.tensor([1, 17])), False
    screened_rows = []
    tokens_of = head.tokens

    def counted(hidden: torch.Tensor, mask=None) -> torch.Tensor | None:
        token_ids = tokens_of(hidden, mask)
        if token_ids is not None:
            screened_rows.append(hidden.shape[0])
        return token_ids

    head.tokens = counted
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate() -> list[list[int]]:
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts[: greedy_head.GEMV_ROWS], params)]
        return batched + [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]

    screened = generate()
    assert sum(screened_rows) >= (greedy_head.GEMV_ROWS + 4) * 11  # every decode step's tokens came from the screen
    runner.greedy_head = None
    assert generate() == screened
    off = LLM(model=str(directory), dtype="bfloat16", device="cpu", num_kv_blocks=16, screened_greedy=False)
    assert off.engine.runner.greedy_head is None


def test_only_rows_that_read_nothing_but_their_argmax_skip_the_full_logits():
    """argmax_bans: the rows the screened head may take (their banned tokens, masked there) and the others (None)."""
    sampler = Sampler(eos_token_ids={2})

    def row(**params) -> SamplingRow:
        return SamplingRow(SamplingParams(temperature=0.0, **params), [5, 6], [], None)

    assert sampler.argmax_bans(row()) == set() and sampler.argmax_bans(row(ignore_eos=True, min_tokens=4)) == set()
    assert sampler.argmax_bans(row(min_tokens=4)) == {2}  # eos banned until 4 tokens
    assert sampler.argmax_bans(row(stop_token_ids=[9], min_tokens=2)) == {2, 9}
    assert sampler.argmax_bans(row(logprobs=1)) is None
    assert sampler.argmax_bans(row(repetition_penalty=1.2)) is None
    assert sampler.argmax_bans(SamplingRow(SamplingParams(temperature=0.7), [5], [], None)) is None


def test_the_runner_builds_the_head_for_fp32_where_bf16_is_native_else_with_vnni_unless_turned_off(
    llm, require_cpu_kernel
):
    from engine.layers import greedy_head

    llm, _ = llm
    native_bf16, int8_dot = half_dtype_support("bfloat16")[0], has_int8_dot()
    int8_few_rows = int8_logits_available()  # the one-pass GEMV: AVX512-VNNI, or AVX2 alone
    expected = (
        ScreenedGreedyHead if native_bf16 else Int8ScreenedGreedyHead if int8_dot or int8_few_rows else type(None)
    )
    model = llm.engine.config.model
    on = LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=16)
    head = on.engine.runner.greedy_head
    assert type(head) is expected
    if expected is Int8ScreenedGreedyHead:  # without VNNI only steps of a few rows, the GEMV's, are screened
        assert head.max_rows == (None if int8_dot else greedy_head.AVX2_MAX_ROWS)
    int8_head = head.few_rows if isinstance(head, ScreenedGreedyHead) else head
    if int8_head is not None:  # calibrated at start on the runner's own prompt: no request's step pays for it
        assert (int8_head.layout is not None or int8_head.off) and not int8_head.gathered
    off = LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=16, screened_greedy=False)
    assert off.engine.runner.greedy_head is None


def test_the_int8_gemvs_avx2_build_gives_exact_dots_and_the_fp32_argmax(require_cpu_kernel):
    """The kernels built for x86-64-v3 (AVX2, no AVX-512) in a process of their own: the int8 GEMV's path for CPUs
    without VNNI (tests/int8_avx2_check.py), which a build for this CPU does not compile where it has VNNI."""
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("the AVX2 build runs on an x86-64 CPU with AVX2")
    env = {**os.environ, "LORAPLEX_CPU_MARCH": "x86-64-v3"}
    argv = [sys.executable, "-m", "tests.int8_avx2_check"]
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "int8 GEMV, AVX2 build: ok" in result.stdout
