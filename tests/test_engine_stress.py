"""A seeded random mix against the invariants: preemption, chunked prefill, prefix hits, n > 1, adapters rotating
through too few rows, aborts mid-flight. Outputs must equal a roomy run's, and nothing may leak."""

from __future__ import annotations

import random

import pytest

from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.test_lora_engine import NUM_ADAPTERS, assert_idle, make_llm, model  # noqa: F401 (fixture)

NUM_REQUESTS = 40


def random_requests(loras, seed: int = 7) -> list[EngineRequest]:
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(3)]  # common prefixes: cache hits
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 17, 40]))]
        if rng.random() < 0.5:
            prompt = rng.choice(shared) + prompt
        n = rng.choice([1, 1, 1, 2, 3])
        temperature = 0.0 if n == 1 else 0.8
        params = SamplingParams(n=n, temperature=temperature, seed=i, max_tokens=rng.randint(1, 20), ignore_eos=True)
        lora = rng.choice([None, *loras])
        requests.append(EngineRequest(f"r{i}", prompt, params, lora=lora))
    return requests


def run(llm, requests, abort_ids=(), abort_at_step=4) -> dict[str, list[list[int]]]:
    engine = llm.engine
    for lora in {r.lora for r in requests if r.lora is not None}:
        engine.adapter_cache.load(lora)
    tokens = {r.request_id: [[] for _ in range(r.sampling.n)] for r in requests}
    finished = set()
    for request in requests:
        engine.add_request(request)
    step = 0
    while engine.has_unfinished:
        step += 1
        if step == abort_at_step:
            for request_id in abort_ids:
                out = engine.abort(request_id)
                if out is not None:
                    finished.add(request_id)
        for out in engine.step():
            for o in out.outputs:
                tokens[out.request_id][o.index] += o.token_ids
            if out.finished:
                finished.add(out.request_id)
        assert step < 2000, "the mix did not drain"
    assert finished == set(tokens)
    return tokens


# (seed, engine options): tight pools, few rows, small host tier, chunked prefill, several block sizes
MIXES = [
    (7, dict(max_loras=2, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32)),
    (11, dict(max_loras=2, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)),
    (12, dict(max_loras=2, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)),
    (17, dict(max_loras=3, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=32, block_size=8)),
    (10, dict(max_loras=3, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=32)),
]


@pytest.mark.parametrize(("seed", "options"), MIXES)
def test_random_mix_keeps_outputs_and_invariants(model, seed, options):  # noqa: F811
    base, loras, _ = model
    roomy = make_llm(base, max_loras=NUM_ADAPTERS, num_kv_blocks=1024)
    expected = run(roomy, random_requests(loras[:5], seed))
    assert_idle(roomy)

    requests = random_requests(loras[:5], seed)
    tight = make_llm(base, max_cpu_loras=3, **options)
    aborted = {"r3", "r11", "r25"}
    got = run(tight, requests, abort_ids=aborted)
    assert tight.engine.adapter_cache.stats.host_evictions > 0
    for request in requests:
        samples = got[request.request_id]
        if request.request_id in aborted:
            assert all(len(s) <= request.sampling.max_tokens for s in samples)
            continue
        assert all(len(s) == request.sampling.max_tokens for s in samples), request.request_id
        assert samples == expected[request.request_id], request.request_id  # greedy and seeded alike
    assert_idle(tight)
