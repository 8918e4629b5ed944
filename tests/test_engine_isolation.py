"""One bad request never fails the others (issue 15): a sequence whose logits turn NaN/Inf, or whose step raises, is
failed alone with SequenceFailed; every other request gets exactly its greedy tokens, and no block or adapter row
leaks. A fault no request can be blamed for stops the engine thread, and every caller gets EngineStopped.

Faults are injected by token: hooks on the model's embedding turn one token's embedding to NaN (so the NaN flows
through attention into that sequence's KV blocks, as a blown-up adapter would) or make the forward raise when the
token is in the batch. Both are tokens that no innocent prompt or output holds."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.interface import EngineStopped, SequenceFailed
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.engine_probe import llm_engine
from tests.hf_models import base_with_adapters
from tests.test_oracle import prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
RANDOM = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
WAIT_S = 120  # only so that a hang fails the test instead of the run; no test is about speed


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return base_with_adapters(tmp_path_factory.mktemp("isolation"), tokenizer, r=4)


def make_engine(model, **options) -> LLMEngine:
    """An engine with both adapters in host memory, so requests are admitted in the order they come."""
    base, loras = model
    config = {"max_loras": 2, "max_lora_rank": 8, "num_kv_blocks": 64, **options}
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", enable_lora=True, **config))
    for lora in loras:
        engine.add_adapter(lora)
    return engine


def innocents(loras) -> list[EngineRequest]:
    """Five greedy requests of 3 to 47 tokens (so decode groups pad their block tables), with and without adapters;
    the last asks for n=2 samples, so it forks in the step where the bad one fails."""
    batch = [prompts(512, 16, seed=3)[i] for i in (2, 7, 11, 12, 5)]
    adapters = [None, loras[0], loras[1], loras[0], loras[1]]
    params = [GREEDY] * 4 + [SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)]
    return [EngineRequest(f"ok-{i}", *args) for i, args in enumerate(zip(batch, params, adapters))]


def run(engine: LLMEngine, requests: list[EngineRequest], late: list[EngineRequest] = ()) -> dict:
    """Adds `requests`, then `late` ones after three steps, and steps until all end: request id -> its tokens, or the
    error it failed with."""
    results: dict[str, list[int] | Exception] = {r.request_id: [] for r in [*requests, *late]}
    for request in requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished or (late and steps <= 3):
        if steps == 3:
            for request in late:
                engine.add_request(request)
        steps += 1
        for out in engine.step():
            if out.error is not None:
                assert out.finished
                results[out.request_id] = out.error
            elif not isinstance(results[out.request_id], Exception):
                results[out.request_id] += [t for o in out.outputs for t in o.token_ids]
    return results


def poison(engine: LLMEngine, nan_token: int | None = None, raise_token: int | None = None) -> None:
    """Hooks on the embedding: `nan_token`'s embedding becomes NaN; a forward whose batch holds `raise_token` raises."""
    embed = engine.runner.model.model.embed_tokens

    def pre_hook(module, args):
        if raise_token is not None and bool((args[0] == raise_token).any()):
            raise RuntimeError(f"injected fault on token {raise_token}")

    def hook(module, args, out):
        return out if nan_token is None else out.masked_fill((args[0] == nan_token).unsqueeze(-1), math.nan)

    embed.register_forward_pre_hook(pre_hook)
    embed.register_forward_hook(hook)


def assert_idle(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished and not engine.groups
    assert bm.num_free_blocks == bm.num_blocks and all(rc == 0 for rc in bm.ref_counts)
    assert engine.adapter_cache.num_pinned == 0


@pytest.fixture(scope="module")
def clean(model):
    """The innocent batch's greedy tokens on a fresh engine, alone; and two tokens it never holds."""
    _, loras = model
    requests = innocents(loras)
    results = run(make_engine(model), requests)
    used = {t for r in requests for t in r.prompt_token_ids} | {t for ids in results.values() for t in ids}
    nan_token, raise_token = [t for t in range(3, 512) if t not in used][:2]
    return results, nan_token, raise_token


@pytest.mark.parametrize("params", [GREEDY, RANDOM], ids=["greedy", "temperature-1"])
def test_a_sequence_with_nan_logits_fails_alone_and_its_nan_kv_reaches_nobody(model, clean, params):
    _, loras = model
    expected, nan_token, _ = clean
    engine = make_engine(model)
    poison(engine, nan_token=nan_token)
    # first in, so its NaN K/V land in block 0: the block that pads every decode group's block tables
    bad = EngineRequest("bad", [5, 6, nan_token, 7], replace(params, n=3), lora=loras[1])
    got = run(engine, [bad, *innocents(loras)])
    error = got.pop("bad")
    assert isinstance(error, SequenceFailed) and error.request_id == "bad"
    assert "NaN or Inf" in str(error)
    assert got == expected
    assert_idle(engine)
    assert run(engine, innocents(loras)) == expected  # its freed blocks were scrubbed: later batches are clean
    assert_idle(engine)


def test_a_bad_request_alone_in_its_step_fails_alone_once_the_self_test_clears_the_engine(model, clean):
    _, loras = model
    expected, nan_token, raise_token = clean
    engine = make_engine(model)
    poison(engine, nan_token=nan_token, raise_token=raise_token)
    for bad in [EngineRequest("nan", [nan_token], GREEDY), EngineRequest("raises", [raise_token], GREEDY)]:
        assert isinstance(run(engine, [bad])[bad.request_id], SequenceFailed)
        assert_idle(engine)
    assert run(engine, innocents(loras)) == expected


def test_a_nan_in_a_prefill_chunk_that_does_not_sample_fails_that_request_alone(model, clean):
    _, loras = model
    expected, nan_token, _ = clean
    engine = make_engine(model, max_num_batched_tokens=32, max_num_seqs=8)  # the 40-token prompt takes 2 chunks
    poison(engine, nan_token=nan_token)
    bad = EngineRequest("bad", [nan_token] + [9] * 39, GREEDY)
    got = run(engine, [bad, *innocents(loras)])
    assert isinstance(got.pop("bad"), SequenceFailed)
    assert got == expected
    assert_idle(engine)
    assert run(engine, innocents(loras)) == expected  # the chunk's blocks were scrubbed, not cached
    assert_idle(engine)


def test_a_request_that_makes_the_step_raise_fails_alone_mid_decode(model, clean):
    _, loras = model
    expected, _, raise_token = clean
    engine = make_engine(model)
    poison(engine, raise_token=raise_token)
    bad = EngineRequest("bad", [5, raise_token, 6], GREEDY, lora=loras[1])
    got = run(engine, innocents(loras), late=[bad])  # joins while the others decode
    error = got.pop("bad")
    assert isinstance(error, SequenceFailed) and "injected fault" in str(error)
    assert got == expected
    assert_idle(engine)
    assert run(engine, innocents(loras)) == expected
    assert_idle(engine)


def test_a_step_that_raises_once_is_retried_and_nobody_fails(model, clean):
    _, loras = model
    expected, _, _ = clean
    engine = make_engine(model)
    calls = 0

    def flaky(module, args):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("a transient fault")

    engine.runner.model.model.embed_tokens.register_forward_pre_hook(flaky)
    assert run(engine, innocents(loras)) == expected
    assert_idle(engine)


async def collect(engine: AsyncEngine, request: EngineRequest) -> list[int]:
    ids = []
    async for delta in engine.generate(request):
        ids += [t for o in delta.outputs for t in o.token_ids]
    return ids


def test_through_the_async_engine_the_bad_stream_raises_and_the_engine_lives_on(model, clean):
    _, loras = model
    expected, nan_token, raise_token = clean
    engine = AsyncEngine(lambda: make_engine(model))
    poison(llm_engine(engine), nan_token=nan_token, raise_token=raise_token)
    requests = [
        EngineRequest("nan", [5, nan_token], RANDOM),
        *innocents(loras),
        EngineRequest("raises", [raise_token, 5], GREEDY, lora=loras[0]),
    ]

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests), return_exceptions=True)

    try:
        nan, *good, raises = asyncio.run(asyncio.wait_for(main(), WAIT_S))
        assert isinstance(nan, SequenceFailed) and isinstance(raises, SequenceFailed)
        assert dict(zip(expected, good)) == expected
        assert engine.is_alive
        stats = asyncio.run(engine.stats())
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.adapter_rows_pinned == 0
        assert stats.num_requests == stats.seqs_running == stats.seqs_waiting == 0
    finally:
        engine.shutdown()


def test_a_fault_nobody_can_be_blamed_for_stops_the_engine_and_every_caller_gets_engine_stopped(model, caplog):
    _, loras = model
    engine = AsyncEngine(lambda: make_engine(model))

    def dead_device(module, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm_engine(engine).runner.model.register_forward_pre_hook(dead_device)

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in innocents(loras)), return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), WAIT_S))
        assert all(isinstance(r, EngineStopped) for r in results), results
        assert not engine.is_alive
        with pytest.raises(EngineStopped):  # a later command fails at once instead of hanging
            asyncio.run(asyncio.wait_for(engine.validate(innocents(loras)[0]), WAIT_S))
        assert any("engine stopped" in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()


def test_a_step_that_keeps_raising_outside_any_request_stops_the_engine(model):
    _, loras = model
    engine = AsyncEngine(lambda: make_engine(model))

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    llm_engine(engine).scheduler.schedule = broken_schedule
    try:
        with pytest.raises(EngineStopped):
            asyncio.run(asyncio.wait_for(collect(engine, innocents(loras)[0]), WAIT_S))
        assert not engine.is_alive
    finally:
        engine.shutdown()


def test_offline_generate_returns_the_failed_request_with_its_error_and_the_others_whole(model, clean):
    from engine.llm import LLM

    base, loras = model
    expected, nan_token, _ = clean
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    poison(llm.engine, nan_token=nan_token)
    requests = innocents(loras)
    outputs = llm.generate(
        [{"prompt_token_ids": [5, 6, nan_token, 7]}, *({"prompt_token_ids": r.prompt_token_ids} for r in requests)],
        [GREEDY, *(r.sampling for r in requests)],
        lora_request=[None, *(r.lora for r in requests)],
    )
    assert isinstance(outputs[0].error, SequenceFailed)
    assert all(out.error is None for out in outputs[1:])
    got = [[t for o in out.outputs for t in o.token_ids] for out in outputs[1:]]
    # the n=2 request's two samples come back one after the other here, interleaved step by step in `expected`
    assert [sorted(tokens) for tokens in got] == [sorted(tokens) for tokens in expected.values()]
    assert got[:4] == list(expected.values())[:4]
