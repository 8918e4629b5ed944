"""Greedy sampling's C++ pass (kernels/sampling) against torch's argmax and finiteness check, and the sampler's use
of it: the first of equal maxima, -1 for a row with a NaN or an infinity anywhere (vector lanes and the tail)."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import NON_FINITE, Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from kernels.sampling import greedy_tokens


def expected_tokens(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).masked_fill_(~torch.isfinite(logits).all(dim=-1), NON_FINITE)


@pytest.mark.parametrize("vocab", [1, 15, 16, 1003, 32000])
def test_greedy_tokens_are_torch_argmax_with_bad_rows_marked(vocab, require_cpu_kernel):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(40, vocab + 5, generator=g)
    logits = wide[:, :vocab]  # strided rows
    logits[1] = 0.0  # all equal: the first index
    logits[2, -1] = 1e3  # the maximum in the tail
    if vocab > 3:
        logits[3, [vocab // 3, vocab - 2]] = 50.0  # a tie between lanes: the first
        logits[4, vocab // 2] = float("nan")
        logits[5, vocab - 1] = float("inf")
        logits[6, 0] = -float("inf")
    logits[7] = -float("inf")
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected_tokens(logits))
    assert got[7] == NON_FINITE and got[1] == 0


def test_greedy_tokens_apply_only_to_cpu_float32_rows():
    assert greedy_tokens(torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    assert greedy_tokens(torch.zeros(8, 2).T) is None  # columns not contiguous


def test_the_sampler_gives_no_token_to_a_non_finite_row_and_argmax_to_the_others(require_cpu_kernel):
    logits = torch.randn(3, 100)
    logits[1, 17] = float("nan")
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None) for _ in range(3)]
    tokens = [t.token_id for t in Sampler(set())(logits, rows)]
    assert tokens == [int(logits[0].argmax()), NON_FINITE, int(logits[2].argmax())]
