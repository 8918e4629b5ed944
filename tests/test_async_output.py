"""Async output (EngineConfig.async_output, on with CUDA): a request that stops on no string gets its text and its
RequestOutput while the device runs the next step. On a CPU it is off by default and forced on here: every request
must end with exactly the text, tokens, logprobs and finish reasons it gets with it off, its deltas one step later
(stop-string requests as before), and aborts, failures and detokenizer faults must behave as they do inline."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.interface import SequenceFailed
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.hf_models import base_with_adapters
from tests.test_engine_isolation import WAIT_S, innocents, poison
from tests.test_oracle import prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return base_with_adapters(tmp_path_factory.mktemp("async-output"), tokenizer, r=4)


def make_engine(model, async_output: str) -> LLMEngine:
    base, loras = model
    config = EngineConfig(
        model=str(base),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=96,
        async_output=async_output,
    )
    engine = LLMEngine(config)
    for lora in loras:
        engine.add_adapter(lora)
    return engine


def mixed_requests(loras, stop: str | None = None) -> list[EngineRequest]:
    """Greedy and seeded sampling, n = 2, logprobs, eos allowed, adapters and none; with `stop`, one more request
    that stops on that string (its text is still made at once)."""
    batch = prompts(512, 16, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=12),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, ignore_eos=True),
    ]
    adapters = [None, loras[0], loras[1], loras[0], None, loras[1]]
    requests = [EngineRequest(f"r{i}", batch[i * 2 + 1], *args) for i, args in enumerate(zip(params, adapters))]
    if stop is not None:
        stops = SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True)
        requests.append(EngineRequest("stops", batch[1], stops))  # r0's prompt, so its text holds `stop`
    return requests


def run(engine: LLMEngine, requests: list[EngineRequest], added: bool = False) -> tuple[dict, dict]:
    """Steps until all end (`added`: the requests are in already). Returns request id -> [(index, text, token ids,
    logprobs, finish, stop reason)] summed over its deltas, or the error it failed with; and request id -> the steps
    (1, 2, ...) whose output held a delta of it. Checks that nothing is left behind."""
    for request in requests if not added else ():
        engine.add_request(request)
    results: dict[str, dict[int, list] | Exception] = {r.request_id: {} for r in requests}
    steps: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = 0
    while engine.has_unfinished:
        step += 1
        for out in engine.step():
            steps[out.request_id].append(step)
            if out.error is not None:
                assert out.finished
                results[out.request_id] = out.error
                continue
            for o in out.outputs:
                acc = results[out.request_id].setdefault(o.index, ["", [], [], None, None])
                acc[0] += o.text
                acc[1] += o.token_ids
                acc[2] += [(lp.token_id, lp.logprob) for lp in o.logprobs or []]
                acc[3], acc[4] = o.finish_reason, o.stop_reason
    assert not engine.groups and not engine.unsent
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.adapter_cache.num_pinned == 0
    summed = {
        rid: outs if isinstance(outs, Exception) else sorted((i, *acc) for i, acc in outs.items())
        for rid, outs in results.items()
    }
    return summed, steps


def token_ids(results: dict) -> dict:
    """request id -> each sample's token ids, or the error it failed with."""
    return {rid: r if isinstance(r, Exception) else [ids for _, _, ids, *_ in r] for rid, r in results.items()}


def test_async_output_is_off_on_a_cpu_by_default_and_refuses_other_words(model):
    base, _ = model
    assert EngineConfig(model=str(base), device="cpu").async_output == "off"
    assert EngineConfig(model=str(base), device="cpu", async_output="on").async_output == "on"
    with pytest.raises(ValueError, match="async_output must be auto, on or off"):
        EngineConfig(model=str(base), device="cpu", async_output="yes")


def test_deferred_outputs_match_inline_ones_one_step_later_and_stop_strings_still_stop(model):
    _, loras = model
    inline, inline_steps = run(make_engine(model, "off"), mixed_requests(loras))
    text = inline["r0"][0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # in the middle of r0's text, which "stops" will repeat
    assert stop.strip(), text
    inline, inline_steps = run(make_engine(model, "off"), mixed_requests(loras, stop))
    deferred, deferred_steps = run(make_engine(model, "on"), mixed_requests(loras, stop))
    assert deferred == inline
    assert inline["stops"][0][4] == "stop" and inline["stops"][0][5] == stop  # it did stop on the string
    assert len(inline["r2"]) == 2 and inline["r3"][0][3]  # the n = 2 samples; r3's logprobs
    for request_id, steps in inline_steps.items():
        if request_id == "stops":
            assert deferred_steps[request_id] == steps  # stop strings decide when it ends: its text comes at once
        else:
            assert deferred_steps[request_id] == [step + 1 for step in steps], request_id


def test_the_step_runs_while_the_previous_outputs_are_built(model, monkeypatch):
    """The deferred outputs are built once per step, after the step's forward is queued and before its tokens are
    read: the order of calls inside one step."""
    engine = make_engine(model, "on")
    calls: list[str] = []
    monkeypatch.setattr(engine.runner, "execute", _recording(engine.runner.execute, "execute", calls))
    monkeypatch.setattr(engine, "_send", _recording(engine._send, "send", calls))
    monkeypatch.setattr(engine.sampler, "argmax_tokens", _recording(engine.sampler.argmax_tokens, "tokens", calls))
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    engine.step()  # the prompt: nothing unsent yet
    assert calls == ["execute", "tokens"] and len(engine.unsent) == 1
    calls.clear()
    assert [out.outputs[0].token_ids for out in engine.step()] and calls == ["execute", "send", "tokens"]


def _recording(fn, name: str, calls: list[str]):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


def test_an_abort_sends_a_finished_requests_unsent_delta_and_drops_a_running_ones(model):
    engine = make_engine(model, "on")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(EngineRequest("short", [5, 6, 7], params))
    engine.add_request(EngineRequest("long", [8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)))
    first = {out.request_id for out in engine.step()}  # the prompts ran; their deltas are unsent
    assert not first and {g.request_id for g, _ in engine.unsent} == {"short", "long"}
    sent = {out.request_id: out for out in engine.step()}  # the prompts' deltas; "short" ends, unsent
    assert set(sent) == {"short", "long"} and not sent["short"].finished
    final = engine.abort("short")
    assert final.finished and final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 1
    both = sent["short"].outputs[0].token_ids + final.outputs[0].token_ids
    assert sent["short"].outputs[0].text + final.outputs[0].text == engine.tokenizer.decode(both)
    aborted = engine.abort("long")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.unsent and not engine.has_unfinished and engine.abort("short") is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_detokenizer_fault_fails_its_request_alone_while_the_step_runs(model, monkeypatch):
    _, loras = model
    inline, _ = run(make_engine(model, "off"), innocents(loras))
    engine = make_engine(model, "on")
    requests = innocents(loras)
    for request in requests:
        engine.add_request(request)
    assert engine.step() == []  # the prompts ran; their first deltas wait for the next step

    def broken(token_ids):
        raise RuntimeError("injected detokenizer fault")

    monkeypatch.setattr(engine.groups["ok-1"].seqs[0].detokenizer, "push", broken)
    got, _ = run(engine, requests, added=True)
    error = got.pop("ok-1")
    assert isinstance(error, SequenceFailed) and "detokenizing its token raised" in str(error)
    del inline["ok-1"]
    assert token_ids(got) == token_ids(inline)  # the others, n = 2 included, as inline


def test_a_nan_request_fails_alone_with_deferred_outputs_too(model):
    """The isolation tests' NaN fault with async output on: the others' tokens as with it off."""
    _, loras = model
    inline, _ = run(make_engine(model, "off"), innocents(loras))
    used = {t for r in innocents(loras) for t in r.prompt_token_ids}
    used |= {t for samples in token_ids(inline).values() for ids in samples for t in ids}
    nan_token = next(t for t in range(3, 512) if t not in used)
    engine = make_engine(model, "on")
    poison(engine, nan_token=nan_token)
    bad = EngineRequest("bad", [5, 6, nan_token, 7], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    got, _ = run(engine, [bad, *innocents(loras)])
    assert isinstance(got.pop("bad"), SequenceFailed)
    assert token_ids(got) == token_ids(inline)


def test_streams_through_the_async_engine_get_the_inline_text_and_tokens(model):
    _, loras = model
    inline, _ = run(make_engine(model, "off"), mixed_requests(loras))
    engine = AsyncEngine(lambda: make_engine(model, "on"))

    async def stream(request: EngineRequest) -> list:
        samples: dict[int, list] = {}
        async for out in engine.generate(request):
            for o in out.outputs:
                acc = samples.setdefault(o.index, ["", []])
                acc[0] += o.text
                acc[1] += o.token_ids
        return [(i, text, ids) for i, (text, ids) in sorted(samples.items())]

    async def main():
        return await asyncio.gather(*(stream(r) for r in mixed_requests(loras)))

    try:
        streamed = asyncio.run(asyncio.wait_for(main(), WAIT_S))
        assert streamed == [[(i, text, ids) for i, text, ids, *_ in inline[rid]] for rid in inline]
        stats = asyncio.run(engine.stats())
        assert stats.num_requests == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    finally:
        engine.shutdown()
