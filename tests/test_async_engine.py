"""AsyncEngine: deltas stream from the engine thread; abort frees blocks at once; the event loop stays free."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from engine.async_engine import GIL_SWITCH_INTERVAL_S, AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.engine_probe import engine_thread, held_streams
from tests.hf_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("llama-async")
    make_model(directory, tokenizer, "llama")
    return directory


@pytest.fixture(scope="module")
def async_engine(model_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=128))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request: EngineRequest):
    ids, text, last = [], "", None
    async for delta in engine.generate(request):
        ids += delta.outputs[0].token_ids if delta.outputs else []
        text += delta.outputs[0].text if delta.outputs else ""
        last = delta
    return ids, text, last


def test_streams_match_offline_and_run_concurrently(model_dir, async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 20]
    offline = LLM(model=str(model_dir), device="cpu", num_kv_blocks=128).generate(batch, params)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        t = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(collect(async_engine, EngineRequest(f"s{i}", p, params)) for i, p in enumerate(batch))
        )
        t.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    assert ticks > 10  # the loop kept running while the model did
    for (ids, text, last), off in zip(results, offline):
        assert ids == off.outputs[0].token_ids and text == off.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_abort_mid_stream_frees_blocks_at_once(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = async_engine.generate(EngineRequest("to-abort", [5] * 40, params))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()  # leaving early aborts
        return await async_engine.stats()

    stats = asyncio.run(main())
    assert stats.kv_blocks_free == stats.kv_blocks_total and not stats.num_requests
    assert stats.seqs_running == stats.seqs_waiting == 0


def test_bad_request_fails_alone(async_engine):
    async def main():
        good = collect(async_engine, EngineRequest("good", [5, 6], SamplingParams(temperature=0, max_tokens=4)))
        bad = collect(async_engine, EngineRequest("bad", [], SamplingParams()))
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(main())
    assert isinstance(bad, ValueError) and "empty" in str(bad)
    assert len(good[0]) >= 1 and good[2].finished


def test_the_engine_is_built_and_stepped_on_its_own_thread(model_dir):
    """Built on the engine thread, so on CPU its OpenMP team is the only one in the process (a second, left by the
    thread that loaded the model, makes every team sleep between parallel regions)."""
    threads = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))

    engine = AsyncEngine(build)
    try:
        assert threads == [engine_thread(engine)] and threads[0] is not threading.current_thread()
        comm = Path(f"/proc/self/task/{threads[0].native_id}/comm")
        if comm.exists():  # Linux: named in the OS too, for top, py-spy and bench latency's CPU by thread
            assert comm.read_text().strip() == "loraplex-engine"
        stepped = asyncio.run(collect(engine, EngineRequest("t", [5, 6], SamplingParams(temperature=0, max_tokens=2))))
        assert len(stepped[0]) == 2
    finally:
        engine.shutdown()


def test_a_failed_build_raises_to_the_caller(tmp_path):
    """What building raises on the engine thread (here: no such model) reaches the caller of the constructor."""
    with pytest.raises(FileNotFoundError, match="missing-model"):
        AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(tmp_path / "missing-model"), device="cpu")))


@pytest.mark.parametrize("before", [0.005, 0.0001])
def test_the_engine_thread_gets_the_gil_back_within_half_a_millisecond(model_dir, before):
    """The switch interval drops to GIL_SWITCH_INTERVAL_S (from Python's default 5 ms) so the engine thread waits
    little for the event loop after a GIL-free decode step; a shorter one set by the host process is kept."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(before)
    try:
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=16))
        engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SWITCH_INTERVAL_S))
    finally:
        sys.setswitchinterval(previous)


async def delta_sizes(engine: AsyncEngine, request: EngineRequest) -> tuple[list[int], list[int], str]:
    sizes, ids, text = [], [], ""
    async for delta in engine.generate(request):
        sizes.append(len(delta.outputs[0].token_ids) if delta.outputs else 0)
        ids += delta.outputs[0].token_ids if delta.outputs else []
        text += delta.outputs[0].text if delta.outputs else ""
    return sizes, ids, text


def test_stream_interval_joins_deltas_after_the_first_and_loses_nothing(model_dir):
    """--stream-interval 3: the first token at once, then three steps' tokens per delta, the rest with the last; a
    request asking for 5 gets 5 (the larger of the two); the tokens and text are the offline engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    offline = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64).generate([[5, 6, 7]], params)[0].outputs[0]
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64, stream_interval=3)
    )
    try:

        async def main():
            wider = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, stream_interval=5)
            return await asyncio.gather(
                delta_sizes(engine, EngineRequest("every-3", [5, 6, 7], params)),
                delta_sizes(engine, EngineRequest("every-5", [5, 6, 7], wider)),
            )

        (sizes3, ids3, text3), (sizes5, ids5, text5) = asyncio.run(main())
        assert sizes3 == [1, 3, 3, 3, 1] and sizes5 == [1, 5, 5]
        assert ids3 == ids5 == offline.token_ids and text3 == text5 == offline.text
        assert held_streams(engine) == 0
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        EngineConfig(model=str(model_dir), device="cpu", stream_interval=0)


def test_an_aborted_stream_leaves_no_held_deltas_behind(model_dir):
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64, stream_interval=4)
    )
    try:

        async def main():
            stream = engine.generate(
                EngineRequest("cut", [5] * 8, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            )
            sizes = [len((await anext(stream)).outputs[0].token_ids) for _ in range(2)]
            await stream.aclose()  # aborts, with tokens of up to three steps held
            return sizes, await engine.stats()

        sizes, stats = asyncio.run(main())
        assert sizes == [1, 4] and not stats.num_requests and held_streams(engine) == 0
    finally:
        engine.shutdown()
