"""`LORAPLEX_CPU_MARCH=x86-64-v3 python -m tests.int8_avx2_check` checks the int8 GEMV's AVX2 path (built where the
compiler's target has AVX2 and no AVX512-VNNI): its dot products are exactly those of the rows quantized as the int8
head quantizes them, and the int8 screen's tokens at a few rows are the fp32 argmax (over a grammar's allowed tokens
too). Run in a process of its own by
tests/test_screened_greedy.py, as the tests' own process has the kernels built for this CPU. Exits 0 when all hold."""

from __future__ import annotations

import os

import torch

from engine.layers.greedy_head import Int8HeadLayout, _quantize_rows
from kernels.sampling import bf16_logits_available, int8_logits, int8_logits_available


def main() -> None:
    assert os.environ.get("LORAPLEX_CPU_MARCH") == "x86-64-v3", "run with LORAPLEX_CPU_MARCH=x86-64-v3"
    assert int8_logits_available() and not bf16_logits_available()  # the AVX2 build: no AVX-512 at all
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8, 11):
        for dim in (64, 100, 576):
            for channels in (None, torch.tensor([k for k in range(dim) if k not in (0, 5, 63)])):
                hidden = torch.randn(rows, dim, generator=g) * 3
                hidden[0, dim // 2] = 90.0
                part = hidden if channels is None else hidden.index_select(1, channels)
                weight = torch.randint(-127, 128, (1003, part.shape[1]), dtype=torch.int8, generator=g)
                dots, terms = int8_logits(hidden, channels, weight)
                scale, quantized, error = _quantize_rows(part)
                assert torch.equal(dots, quantized.to(torch.int32) @ weight.to(torch.int32).T), (rows, dim)
                expected = torch.stack([scale, error, part.norm(dim=1)], dim=1)
                torch.testing.assert_close(terms, expected, rtol=1e-5, atol=1e-6)
    hidden, weight = torch.randn(16, 96, generator=g) * 3, torch.randn(4000, 96, generator=g) * 0.05
    hidden[torch.arange(16), torch.arange(16)] = 400.0  # one outlier a row: every other value rounds coarsely
    exact = (hidden.double() @ weight.double().T).argmax(dim=-1)
    for exact_channels in ([], [3, 11, 40]):
        layout = Int8HeadLayout(weight, torch.tensor(exact_channels, dtype=torch.long))
        for at_a_time in (1, 3, 16):
            tokens = torch.cat([layout.screen(rows)[0] for rows in hidden.split(at_a_time)])
            assert torch.equal(tokens, exact), (exact_channels, at_a_time)
    # a grammar's mask (the kernel's 8-lane words): the argmax of the allowed tokens, far below the rows' own best
    logits = hidden.double() @ weight.double().T  # [16, V]
    refused = torch.rand(16, 4000, generator=g) < 0.8
    refused[torch.arange(16), exact] = True
    allowed = torch.zeros(16, 125, dtype=torch.int64)
    for t in range(4000):
        allowed[:, t // 32] |= (~refused[:, t]).long() << (t % 32)
    allowed = torch.where(allowed >= 2**31, allowed - 2**32, allowed).to(torch.int32)
    masked = logits.masked_fill(refused, -torch.inf).argmax(dim=-1)
    layout = Int8HeadLayout(weight, torch.tensor([3, 11, 40]))
    assert torch.equal(layout.screen(hidden, allowed=allowed)[0], masked)
    print("int8 GEMV, AVX2 build: ok")


if __name__ == "__main__":
    main()
