"""Sampler: greedy, top-k / top-p / min-p, temperature, penalties, min_tokens, seeds and logprobs."""

import math

import pytest
import torch

from engine.sampler import (
    NO_LOGPROB,
    NON_FINITE,
    TOP_CANDIDATES,
    Sampler,
    SamplingRow,
    apply_penalties,
    finite_rows,
    top_k_top_p_cut,
)
from engine.sampling_params import SamplingParams

EOS = 2


def make_row(prompt: list[int] | None = None, output: list[int] | None = None, **params_kwargs) -> SamplingRow:
    params = SamplingParams(**params_kwargs)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, list(prompt or []), list(output or []), generator)


def token_ids(sampled) -> list[int]:
    return [s.token_id for s in sampled]


def empirical(sampler: Sampler, logits_row: torch.Tensor, num_draws: int, **params_kwargs) -> torch.Tensor:
    """Frequencies [V] of num_draws unseeded draws, all in one batch."""
    torch.manual_seed(1234)
    rows = [make_row(**params_kwargs) for _ in range(num_draws)]
    drawn = torch.tensor(token_ids(sampler(logits_row.expand(num_draws, -1), rows)))
    return torch.bincount(drawn, minlength=logits_row.shape[0]).float() / num_draws


@pytest.fixture
def sampler() -> Sampler:
    return Sampler({EOS})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_leaves_logits_untouched(sampler, dtype):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    expected = logits.float().argmax(dim=-1).tolist()
    assert token_ids(sampler(logits, [make_row(temperature=0) for _ in range(6)])) == expected
    # the slow path (logprobs asked, a random row beside) takes the same greedy choice
    rows = [make_row(temperature=0, logprobs=1) for _ in range(5)] + [make_row(temperature=1.0)]
    assert token_ids(sampler(logits, rows))[:5] == expected[:5]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab_size", [50, 1000])
def test_top_k_1_and_tiny_top_p_are_greedy(sampler, vocab_size):
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    for _ in range(5):
        rows = [make_row(temperature=1.5, top_k=1) for _ in range(4)]
        rows += [make_row(temperature=1.5, top_p=1e-6) for _ in range(4)]
        assert token_ids(sampler(logits, rows)) == expected


def reference_kept(scores: torch.Tensor, top_k: int, top_p: float) -> range:
    """How many of the best tokens top-k then top-p keep, in float64 by the definition."""
    best = scores.double().sort(descending=True).values[: top_k if top_k > 0 else None]
    if top_p >= 1:
        return range(len(best), len(best) + 1)
    cumulative = best.softmax(dim=-1).cumsum(dim=-1)
    # the smallest prefix whose mass reaches top_p, give or take float32 rounding at the boundary
    fewest, most = (int((cumulative < top_p + slack).sum()) + 1 for slack in (-1e-6, 1e-6))
    return range(fewest, most + 1)


@pytest.mark.parametrize("vocab_size", [40, 2000])
def test_top_k_top_p_cut_matches_the_definition(vocab_size):
    gen = torch.Generator().manual_seed(2)
    settings = [(-1, 0.5), (-1, 0.9), (-1, 0.999), (10, 1.0), (10, 0.6), (300, 0.95), (300, 1.0), (1, 0.3)]
    rows = [make_row(top_k=k, top_p=p) for k, p in settings]
    for scale in (0.5, 4.0):  # flat rows need a full sort for top-p, peaked ones do not
        scores = torch.randn(len(rows), vocab_size, generator=gen) * scale
        best, best_idx = scores.topk(min(vocab_size, TOP_CANDIDATES), dim=-1)
        cut, _ = top_k_top_p_cut(scores, best, best_idx, rows)
        for r, (k, p) in enumerate(settings):
            kept = int((scores[r] >= cut[r]).sum())
            assert kept in reference_kept(scores[r], min(k, vocab_size), p), (scale, k, p)


@pytest.mark.parametrize("vocab_size", [5, 600])
@pytest.mark.parametrize(
    ("params", "expected_probs"),
    [
        (dict(temperature=0.7), (torch.tensor([0.4, 0.3, 0.2, 0.1, 1e-9]).log() / 0.7).softmax(-1)),
        (dict(top_k=3), torch.tensor([4, 3, 2, 0, 0]) / 9),
        (dict(top_p=0.6), torch.tensor([4, 3, 0, 0, 0]) / 7),
        (dict(top_k=300), torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])),  # past TOP_CANDIDATES when V = 600
        (dict(min_p=0.4), torch.tensor([4, 3, 2, 0, 0]) / 9),  # drops p < 0.4 * 0.4
        (dict(top_k=3, top_p=0.75, min_p=0.6), torch.tensor([4, 3, 0, 0, 0]) / 7),
    ],
)
def test_empirical_distribution(sampler, vocab_size, params, expected_probs):
    logits = torch.full((vocab_size,), -40.0)  # [V]; tokens past the first five carry no mass
    logits[:5] = torch.tensor([0.4, 0.3, 0.2, 0.1, 1e-9]).log()
    freq = empirical(sampler, logits, 12_000, **params)
    assert freq[5:].sum() == 0
    assert torch.allclose(freq[:5], expected_probs.float(), atol=0.02), freq[:5]  # ~4 sd
    assert (freq[:5] > 0).tolist() == (expected_probs > 1e-3).tolist()  # dropped tokens never drawn


def test_min_p_one_keeps_only_the_best(sampler):
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(3))
    rows = [make_row(temperature=2.0, min_p=1.0) for _ in range(16)]
    assert token_ids(sampler(logits, rows)) == logits.argmax(dim=-1).tolist()


def test_penalties_change_logits_exactly():
    vocab_size = 8
    scores = torch.tensor(
        [
            [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5],
            [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5],
            [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    rows = [
        make_row([0, 1, 5], [2, 3, 3, 6, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        make_row([0, 1], [1, 1, 7], frequency_penalty=-0.5),  # prompt tokens not counted
        make_row([4, 4], [], repetition_penalty=0.5),  # prompt alone is "seen"; < 1 rewards
        make_row([0], [1, 2]),  # no penalties: untouched
    ]
    expected = scores.clone()
    for r, row in enumerate(rows):
        p = row.params
        for t in range(vocab_size):
            s = expected[r, t].item()
            if t in row.prompt_token_ids or t in row.output_token_ids:
                s = s / p.repetition_penalty if s > 0 else s * p.repetition_penalty
            count = row.output_token_ids.count(t)
            s -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[r, t] = s
    assert expected[0, 3] == -3.0 * 2 - 0.5 * 3 - 0.25  # spot-check the reference itself
    apply_penalties(scores, rows)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_steers_greedy(sampler):
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    assert token_ids(sampler(logits, [make_row([1], [], temperature=0)])) == [1]
    assert token_ids(sampler(logits, [make_row([1], [], temperature=0, repetition_penalty=1.2)])) == [2]
    assert token_ids(sampler(logits, [make_row([], [1], temperature=0, presence_penalty=0.2)])) == [2]


def test_min_tokens_bans_eos_and_stop_token_ids(sampler):
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 0.0]])  # eos (2) best, then 3, then 4

    def greedy(num_output: int, **kwargs) -> int:
        row = make_row([5], [5] * num_output, temperature=0, **kwargs)
        return sampler(logits, [row])[0].token_id

    assert greedy(1, min_tokens=3) == 3
    assert greedy(3, min_tokens=3) == EOS
    assert greedy(0, min_tokens=2, stop_token_ids=[3]) == 4
    assert greedy(0, min_tokens=2, stop_token_ids=[3], ignore_eos=True) == EOS  # eos not banned then
    assert greedy(0) == EOS
    many = sampler(logits.expand(200, -1), [make_row([5], [], min_tokens=1, temperature=5.0) for _ in range(200)])
    assert EOS not in token_ids(many)


SEEDED_VARIANTS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.2, top_p=0.9),
    dict(temperature=1.0, top_k=400, top_p=0.99),  # top-k past TOP_CANDIDATES: the sorted path
    dict(temperature=1.0, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.4),
]


@pytest.mark.parametrize("variant", SEEDED_VARIANTS)
def test_same_seed_same_tokens_whatever_the_batch(sampler, variant):
    vocab_size, num_steps = 1000, 8

    def step_logits(step: int) -> torch.Tensor:  # [V], the seeded row's logits at this step
        return torch.randn(vocab_size, generator=torch.Generator().manual_seed(100 + step))

    def run(seed: int, batched: bool) -> list[int]:
        row = make_row([3, 4, 5], [], seed=seed, **variant)
        for step in range(num_steps):
            rows, logits, place = [row], step_logits(step).unsqueeze(0), 0
            if batched:  # other rows around it, their own seeds, and a different place in the batch
                others = [make_row(temperature=0), make_row(temperature=1.0, top_p=0.5), make_row(seed=7)]
                others += [make_row(temperature=0.5, top_k=5, presence_penalty=1.0, logprobs=2)]
                rows, place = [*others[:2], row, *others[2:]], 2
                noise = torch.randn(len(rows), vocab_size) * 3
                logits = torch.cat([noise[:2], logits, noise[3:]])
            row.output_token_ids.append(sampler(logits, rows)[place].token_id)
        return row.output_token_ids

    alone = run(seed=42, batched=False)
    assert run(seed=42, batched=False) == alone
    torch.manual_seed(999)  # the global RNG must not matter either
    assert run(seed=42, batched=True) == alone
    assert run(seed=43, batched=True) != alone


def test_logprobs_are_raw_log_softmax(sampler):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 500, generator=gen) * 2).to(torch.bfloat16)
    rows = [
        make_row([1, 2], [3, 3], temperature=0.7, top_k=10, repetition_penalty=1.5, logprobs=5),
        make_row(temperature=0, logprobs=0),
        make_row(temperature=1.0, top_p=0.8, logprobs=20, seed=1),
        make_row(temperature=1.0),
    ]
    sampled = sampler(logits, rows)
    raw = logits.float().log_softmax(dim=-1)
    for r, (row, token) in enumerate(zip(rows, sampled, strict=True)):
        if row.params.logprobs is None:
            assert token.top_logprobs is None and math.isnan(token.logprob)
            continue
        assert token.logprob == pytest.approx(raw[r, token.token_id].item(), abs=1e-5)
        top = token.top_logprobs
        assert len(top) == row.params.logprobs
        assert list(top.values()) == sorted(top.values(), reverse=True)
        for t, value in top.items():
            assert value == pytest.approx(raw[r, t].item(), abs=1e-5)
        if top:  # complete: nothing left out beats what is listed (ties in bf16 may go either way)
            left_out = torch.ones(raw.shape[1], dtype=torch.bool)
            left_out[list(top)] = False
            assert raw[r][left_out].max().item() <= min(top.values()) + 1e-6
    assert sampled[1].token_id == logits[1].float().argmax().item()
    assert sampled[1].top_logprobs == {}
    assert math.isnan(NO_LOGPROB)  # "not computed" can never pass for a real log-prob


def test_fast_path_and_mixed_batch_at_serving_size(sampler):
    """B = 64, V = 32000: the shapes the timing claims are about, checked for sense, not speed."""
    batch, vocab_size = 64, 32000
    logits = torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(6)) * 5
    greedy = sampler(logits, [make_row(temperature=0) for _ in range(batch)])
    assert token_ids(greedy) == logits.argmax(dim=-1).tolist()
    rows = [
        make_row(list(range(i, i + 50)), [i], temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)
        for i in range(batch)
    ]
    penalized = logits.clone()
    apply_penalties(penalized, rows)
    for token, row_scores in zip(sampler(logits, rows), penalized, strict=True):
        assert token.token_id in row_scores.topk(50).indices.tolist()


# ---- issue 15: a poisoned row gets no token, and the rows beside it are untouched -----------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e39),  # inf in float32
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -math.inf),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", 1e-300),  # 0 in float32: a positive logit divided by it is inf
        ("repetition_penalty", 1e6),
    ],
)
def test_non_finite_or_overflowing_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^invalid sampling parameter '{field}': "):
        SamplingParams(**{field: value})


def test_repetition_penalty_range_ends_are_accepted():
    SamplingParams(repetition_penalty=0.01)
    SamplingParams(repetition_penalty=100)


ROW_KINDS = {
    "plain-greedy": dict(temperature=0),
    "greedy-penalised": dict(temperature=0, repetition_penalty=1.3, logprobs=2),
    "random": dict(temperature=1.0, seed=3),
    "top-k-top-p": dict(temperature=0.7, top_k=5, top_p=0.8, seed=4),
    "min-p-logprobs": dict(temperature=1.0, min_p=0.1, logprobs=3, seed=5),
}


@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_row_with_non_finite_logits_gets_no_token_and_the_others_are_unchanged(sampler, kind, poison):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)) * 3
    rows = lambda: [make_row([1, 2], [3], **ROW_KINDS[kind]) for _ in range(4)]  # noqa: E731 (fresh generators)
    clean = token_ids(sampler(logits, rows()))
    poisoned = logits.clone()
    poisoned[2, 17] = poison
    got = token_ids(sampler(poisoned, rows()))
    assert got[2] == NON_FINITE
    assert got[:2] + got[3:] == clean[:2] + clean[3:]
    assert all(0 <= t < 300 for t in clean)


def test_an_overflow_after_penalties_or_temperature_is_caught(sampler):
    logits = torch.zeros(2, 50)
    logits[:, 7] = 1e37  # finite, but a repetition penalty of 0.01 takes it past float32
    greedy = [make_row([7], [], temperature=0, repetition_penalty=0.01) for _ in range(2)]
    assert token_ids(sampler(logits, greedy)) == [NON_FINITE] * 2
    assert token_ids(sampler(logits[:1], [make_row([7], [], temperature=1, repetition_penalty=0.01)])) == [NON_FINITE]
    hot = torch.zeros(1, 50)
    hot[0, 3] = 3.3e38
    assert token_ids(sampler(hot, [make_row(temperature=0.5)])) == [NON_FINITE]  # 6.6e38 after temperature
    assert token_ids(sampler(hot, [make_row(temperature=1.0)])) == [3]  # finite all along: drawn as usual


def test_finite_rows_flags_exactly_the_rows_holding_nan_or_inf_even_when_a_finite_sum_overflows():
    logits = torch.zeros(6, 5)
    logits[1, 2] = math.nan
    logits[2, 0] = math.inf
    logits[3, 4] = -math.inf
    logits[4, 1], logits[4, 3] = math.inf, -math.inf  # their sum is NaN
    logits[5, :] = 3e38  # finite values whose float32 sum overflows to inf: still a finite row
    assert finite_rows(logits).tolist() == [True, False, False, False, False, True]
    assert finite_rows(logits[:1]).tolist() == [True]


def test_min_tokens_over_max_tokens_is_refused_naming_min_tokens():
    with pytest.raises(ValueError, match=r"^invalid sampling parameter 'min_tokens': must be at most max_tokens \(2\)"):
        SamplingParams(max_tokens=2, min_tokens=3)
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100  # up to the context: checked later
