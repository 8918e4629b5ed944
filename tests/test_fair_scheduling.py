"""Fair scheduling across tenants (virtual token counters) against first come first served, on a real engine.

Tenant A floods 50 long requests; a few steps later tenant B sends 3 short ones. Under `fcfs` B waits behind
all of A. Under `fair` B is lifted to A's counter on arrival, so B's requests take the first seats that free up:
they finish before A has finished more than the requests it was already running, and B's service deficit over
its wait stays within the VTC bound (the tokens of the batch A held when B arrived)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.fairness import DECODE_WEIGHT, PREFILL_WEIGHT, VirtualTokenCounter, make_policy
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.hf_models import make_model

SEATS = 4
VOCAB = 512
A_PROMPT, A_TOKENS, B_PROMPT, B_TOKENS = 16, 24, 8, 4


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("fair") / "base"
    make_model(directory, tokenizer, "llama")
    return directory


def prompts(length: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, length), generator=g).tolist()


def cost(prompt_len: int, max_tokens: int) -> float:
    """The weighted tokens a request is computed for: its prompt, and every output token but the last (sampled,
    never fed back)."""
    return PREFILL_WEIGHT * prompt_len + DECODE_WEIGHT * (max_tokens - 1)


def make_engine(base, policy: str) -> LLMEngine:
    config = EngineConfig(
        model=str(base), device="cpu", dtype="float32", max_num_seqs=SEATS, num_kv_blocks=256, scheduling_policy=policy
    )
    return LLMEngine(config)


def request(request_id: str, tenant: str, prompt: list[int], max_tokens: int, weight: float = 1.0) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return EngineRequest(request_id, prompt, params, tenant=tenant, tenant_weight=weight)


def flood_then_short(engine: LLMEngine) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """A's 50 requests, 5 steps, then B's 3; returns the finishing order and each tenant's service (weighted
    tokens) from B's arrival to B's last finish."""
    for i, ids in enumerate(prompts(A_PROMPT, 50, seed=1)):
        engine.add_request(request(f"A{i}", "A", ids, A_TOKENS))
    for _ in range(5):
        engine.step()
    before = dict(engine.scheduler.policy.service)
    for i, ids in enumerate(prompts(B_PROMPT, 3, seed=2)):
        engine.add_request(request(f"B{i}", "B", ids, B_TOKENS))
    finished: list[str] = []
    during: dict[str, float] = {}
    while engine.has_unfinished:
        finished += [out.request_id for out in engine.step() if out.finished]
        if not during and sum(r.startswith("B") for r in finished) == 3:
            during = {t: engine.scheduler.policy.service[t] - before.get(t, 0.0) for t in ("A", "B")}
    return finished, during, dict(engine.scheduler.policy.service)


def test_under_fcfs_the_short_tenant_waits_behind_the_whole_flood(base):
    finished, _, _ = flood_then_short(make_engine(base, "fcfs"))
    last_b = max(finished.index(f"B{i}") for i in range(3))
    # B is admitted only after every A request was: all but the last batch of A finish first
    assert sum(r.startswith("A") for r in finished[:last_b]) >= 50 - SEATS, finished


def test_under_fair_the_short_tenant_takes_the_first_free_seats_and_its_deficit_is_bounded(base):
    finished, during, service = flood_then_short(make_engine(base, "fair"))
    last_b = max(finished.index(f"B{i}") for i in range(3))
    a_before_b = sum(r.startswith("A") for r in finished[:last_b])
    assert a_before_b <= SEATS, finished  # only the A requests already running when B came
    # the VTC bound: B's deficit while it waited is at most the service of the batch A held when B arrived
    bound = SEATS * cost(A_PROMPT, A_TOKENS)
    b_own = 3 * cost(B_PROMPT, B_TOKENS)
    assert during["B"] == pytest.approx(b_own)
    assert during["A"] - during["B"] <= bound, during
    assert service["A"] == pytest.approx(50 * cost(A_PROMPT, A_TOKENS))


def test_backlogged_tenants_share_admissions_by_weight(base):
    """A (weight 1) and B (weight 3) each send 40 equal requests at once: while both are backlogged, B gets
    three admissions for each of A's."""
    engine = make_engine(base, "fair")
    for i, ids in enumerate(prompts(A_PROMPT, 40, seed=3)):
        engine.add_request(request(f"A{i}", "A", ids, 8))
        engine.add_request(request(f"B{i}", "B", ids, 8, weight=3.0))
    finished: list[str] = []
    while len(finished) < 32:
        finished += [out.request_id for out in engine.step() if out.finished]
    a, b = sum(r.startswith("A") for r in finished[:32]), sum(r.startswith("B") for r in finished[:32])
    assert b / a == pytest.approx(3.0, rel=0.25), finished


def test_an_idle_tenant_banks_no_credit():
    """A tenant that was idle while another was served is lifted to the backlogged minimum on arrival."""
    policy = VirtualTokenCounter()
    policy.counters.update({"A": 500.0, "C": 900.0})
    waiting = [_seq("A", 0), _seq("C", 1)]
    newcomer = _seq("B", 2)
    policy.on_arrival(newcomer, waiting)
    assert policy.counters["B"] == 500.0
    policy.counters["A"] = 100.0  # A is served; B stays above it
    policy.on_arrival(_seq("B", 3), [*waiting, newcomer])  # B already backlogged: not lifted again
    assert policy.counters["B"] == 500.0
    assert [s.group.tenant for s in policy.order([*waiting, newcomer])] == ["A", "B", "C"]


def test_offline_generate_takes_tenants_and_policies_are_named(base):
    llm = LLM(model=str(base), device="cpu", dtype="float32", num_kv_blocks=64, scheduling_policy="fair")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts(8, 2, seed=5), params, tenant=["t1", "t2"])
    assert all(len(o.outputs[0].token_ids) == 3 and o.metrics["queue_s"] >= 0 for o in outputs)
    assert set(llm.engine.scheduler.policy.service) == {"t1", "t2"}
    with pytest.raises(ValueError, match="2 prompts but 1 tenants"):
        llm.generate(prompts(8, 2, seed=5), params, tenant=["t1"])
    with pytest.raises(ValueError, match="scheduling policy 'lottery'"):
        make_policy("lottery")
    with pytest.raises(ValueError, match="tenant_weight must be a positive"):
        llm.engine.add_request(request("w", "t", [5, 6], 2, weight=0.0))


def _seq(tenant: str, arrival: int):
    from engine.sequence import Sequence, SequenceGroup

    group = SequenceGroup(request(f"r{arrival}", tenant, [5, 6], 2), arrival)
    seq = Sequence(group, 0, [5, 6], detokenizer=None)
    group.seqs.append(seq)
    return seq


def test_the_fairness_benchmark_trace_keeps_the_rate_ratio_and_replays_on_the_engine(base):
    from bench.fairness import replay, summarize, trace

    arrivals = trace(rate=2.0, ratio=10.0, duration=30.0, vocab=VOCAB)
    heavy = sum(tenant == "heavy" for _, tenant, _ in arrivals)
    assert arrivals == sorted(arrivals, key=lambda a: a[0]) and 8 <= heavy / (len(arrivals) - heavy) <= 12
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", scheduling_policy="fair"))
    few = [(0.0, "heavy", arrivals[0][2]), (0.0, "light", arrivals[1][2])]
    records = replay(engine, few, [None])
    assert [r["tokens"] for r in records] == [64, 64]
    summary = summarize(records, wall=1.0)
    assert summary["light"]["requests"] == 1 and summary["heavy"]["output_tok_s"] == 64
