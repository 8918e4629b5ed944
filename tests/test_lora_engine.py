"""Multi-LoRA in the engine: more adapters than device rows, cold loads off the critical path, adapter
identity in the prefix cache, and bad adapters refused without harming anyone else."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest

from adapters.lora_weights import AdapterError
from adapters.ref import LoRARequest
from engine.async_engine import AsyncEngine, EngineStopped
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.engine_probe import llm_engine
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_ADAPTERS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("lora-engine")
    hf = make_model(directory / "base", tokenizer, "llama")
    paths = [make_adapter(hf, directory / f"a{i}", seed=i) for i in range(NUM_ADAPTERS)]
    return directory / "base", [LoRARequest(f"a{i}", p) for i, p in enumerate(paths)], hf


def make_llm(base, **options) -> LLM:
    config = {"max_loras": 4, "max_lora_rank": 16, "num_kv_blocks": 512, **options}
    return LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, **config)


def assert_idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.adapter_cache.num_pinned == 0


def test_more_adapters_than_rows_all_complete_unchanged_and_never_evict_a_pinned_row(model):
    base, loras, _ = model
    batch = prompts(256, 12, seed=4)
    per_prompt = [loras[i % NUM_ADAPTERS] for i in range(len(batch))]
    roomy = make_llm(base, max_loras=NUM_ADAPTERS)
    expected = [o.outputs[0].token_ids for o in roomy.generate(batch, GREEDY, lora_request=per_prompt)]

    tight = make_llm(base, max_loras=2, max_cpu_loras=3)
    cache = tight.engine.adapter_cache
    activate = cache._activate

    def checked_activate(row, host):  # the invariant: a row is only overwritten when nobody pins it
        assert cache._rows.pins[row] == 0, f"row {row} overwritten while pinned"
        activate(row, host)

    cache._activate = checked_activate
    got = [o.outputs[0].token_ids for o in tight.generate(batch, GREEDY, lora_request=per_prompt)]
    assert got == expected
    assert cache.stats.device_evictions > 0 and cache.stats.host_evictions > 0
    steps = tight.engine.stats.num_steps
    assert steps <= len(batch) * (GREEDY.max_tokens + 2)  # bounded: rows rotate, nobody waits forever
    adapter_of = {str(i): per_prompt[i].adapter_id for i in range(len(batch))}  # the LLM numbers requests 0, 1, ...
    assert max(len({adapter_of[rid] for rid, _ in r.scheduled}) for r in tight.engine.step_trace) <= 2
    assert_idle(tight)


def test_two_versions_of_a_name_never_share_prefix_blocks(model, tmp_path, tokenizer):
    base, loras, _ = model
    llm = make_llm(base)
    v1 = LoRARequest("support-bot", loras[0].path)
    v2 = LoRARequest("support-bot", loras[1].path)  # same name, other weights: another digest
    prompt = prompts(256, 16, seed=2)[13]  # 64 tokens
    llm.generate([[*prompt, 5]], GREEDY, lora_request=v1)
    [same] = llm.generate([[*prompt, 6]], GREEDY, lora_request=v1)
    [other] = llm.generate([[*prompt, 6]], GREEDY, lora_request=v2)
    assert same.num_cached_tokens == 64  # same adapter content: the prefix is reused
    assert other.num_cached_tokens == 0  # new weights under the old name: never the old KV
    cold = make_llm(base, enable_prefix_caching=False).generate([[*prompt, 6]], GREEDY, lora_request=v2)[0]
    assert other.outputs[0].token_ids == cold.outputs[0].token_ids
    digests = {llm.engine.adapter_cache.digest(v) for v in (v1, v2)}
    assert len(digests) == 2


def corrupt(kind: str, good: str, directory) -> str:
    bad = directory / kind
    shutil.copytree(good, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    if kind == "rank-too-high":
        return good  # checked with a lower max_lora_rank below
    if kind == "dora":
        config["use_dora"] = True
    elif kind == "missing-weights":
        (bad / "adapter_model.safetensors").unlink()
    elif kind == "truncated":
        data = (bad / "adapter_model.safetensors").read_bytes()
        (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 3])
    (bad / "adapter_config.json").write_text(json.dumps(config))
    return str(bad)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("dora", "DoRA|dora"),
        ("missing-weights", "adapter_model"),
        ("truncated", "adapter_model"),
        ("rank-too-high", "rank"),
    ],
)
def test_bad_adapter_is_refused_clearly_and_others_keep_serving(model, tmp_path, kind, words):
    base, loras, _ = model
    llm = make_llm(base, max_lora_rank=4) if kind == "rank-too-high" else make_llm(base)
    bad = LoRARequest(f"bad-{kind}", corrupt(kind, loras[0].path, tmp_path))
    with pytest.raises(AdapterError, match=rf"bad-{kind}|{bad.path}") as info:
        llm.generate([[5, 6, 7]], GREEDY, lora_request=bad)
    assert any(w in str(info.value) for w in words.split("|"))
    ok_lora = None if kind == "rank-too-high" else loras[1]
    [ok] = llm.generate([[5, 6, 7]], GREEDY, lora_request=ok_lora)
    assert len(ok.outputs[0].token_ids) == GREEDY.max_tokens
    assert_idle(llm)


def test_offline_a_bad_adapter_past_the_first_rows_ends_its_own_requests_and_the_others_finish(model, tmp_path):
    base, loras, _ = model
    llm = make_llm(base, max_loras=1, max_cpu_loras=2)
    bad = LoRARequest("bad-late", corrupt("truncated", loras[0].path, tmp_path))
    outputs = llm.generate([[5, 6, 7], [8, 9], [5, 6, 7]], GREEDY, lora_request=[loras[1], bad, loras[2]])
    assert isinstance(outputs[1].error, AdapterError) and "bad-late" in str(outputs[1].error)
    assert [len(out.outputs[0].token_ids) for out in (outputs[0], outputs[2])] == [GREEDY.max_tokens] * 2
    assert outputs[0].error is None and outputs[2].error is None
    assert_idle(llm)


def test_offline_generate_reads_each_adapter_once_when_there_are_more_than_host_memory_holds(model):
    base, loras, _ = model
    llm = make_llm(base, max_loras=1, max_cpu_loras=2)
    batch = prompts(256, 2 * NUM_ADAPTERS, seed=7)
    outputs = llm.generate(batch, GREEDY, lora_request=[loras[i // 2] for i in range(len(batch))])
    assert all(out.error is None and len(out.outputs[0].token_ids) == GREEDY.max_tokens for out in outputs)
    # each adapter read when its turn neared, not all up front (which pushed the first ones out before their turn)
    assert llm.engine.adapter_cache.stats.loads == NUM_ADAPTERS
    assert_idle(llm)


def test_async_cold_adapter_loads_while_others_run_and_a_bad_one_fails_alone(model, tmp_path):
    base, loras, _ = model
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256)
    )
    cache = llm_engine(engine).adapter_cache
    gate = threading.Event()
    read = cache.read

    def slow_read(lora):
        if lora.adapter_id == "slow":
            assert gate.wait(30)
        return read(lora)

    cache.read = slow_read
    slow = LoRARequest("slow", loras[2].path)
    bad = LoRARequest("broken", str(tmp_path / "nowhere"))

    async def run(request_id, lora, release_after=None):
        tokens = []
        async for delta in engine.generate(EngineRequest(request_id, [5, 6, 7, 8], GREEDY, lora=lora)):
            tokens += delta.outputs[0].token_ids if delta.outputs else []
            if release_after and len(tokens) >= release_after:
                gate.set()
        return tokens

    async def main():
        return await asyncio.gather(
            run("slow", slow),
            run("base", None, release_after=GREEDY.max_tokens),
            run("bad", bad),
            return_exceptions=True,
        )

    try:
        slow_tokens, base_tokens, bad_result = asyncio.run(main())
        trace = list(llm_engine(engine).step_trace)
    finally:
        engine.shutdown()
    assert isinstance(bad_result, AdapterError) and "broken" in str(bad_result)
    assert len(base_tokens) == len(slow_tokens) == GREEDY.max_tokens
    base_done = next(r.step for r in trace if "base" in r.finished)
    slow_first = next(r.step for r in trace if "slow" in r.sampled)
    assert base_done < slow_first  # the base request ran to the end while the adapter was still loading


def test_a_stream_on_a_resident_adapter_cannot_starve_one_waiting_for_a_row(model):
    from engine.scheduler import ROW_WAIT_STEPS

    base, loras, _ = model
    llm = make_llm(base, max_loras=1)
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for lora in loras[:2]:
        engine.adapter_cache.load(lora)
    engine.add_request(EngineRequest("first-a0", [5, 6, 7], long, lora=loras[0]))
    engine.step()
    engine.add_request(EngineRequest("waiting-a1", [5, 6, 7], long, lora=loras[1]))
    got_row_at = None
    for step in range(200):  # a0 requests keep coming, each would extend a0's hold on the only row
        engine.add_request(EngineRequest(f"stream-a0-{step}", [8, 9], long, lora=loras[0]))
        for out in engine.step():
            if out.request_id == "waiting-a1" and got_row_at is None:
                got_row_at = step
        if got_row_at is not None:
            break
    assert got_row_at is not None and got_row_at <= ROW_WAIT_STEPS + 2 * long.max_tokens
    while engine.has_unfinished:
        engine.step()
    assert_idle(llm)


def drain(engine) -> tuple[dict[str, dict[int, list[int]]], dict[str, Exception]]:
    """Steps until idle: each request's tokens by sample index, and the errors requests ended with."""
    tokens: dict[str, dict[int, list[int]]] = {}
    errors: dict[str, Exception] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            for delta in out.outputs:
                tokens.setdefault(out.request_id, {}).setdefault(delta.index, []).extend(delta.token_ids)
    return tokens, errors


def test_forks_share_one_adapter_row_while_their_adapter_is_removed_and_re_added(model, tmp_path):
    """n=4: a request pins its adapter row once, at admission, and the samples forked when its prefill ends share
    that pin. Removing the adapter mid-prefill and adding other weights under the same name and path neither
    kills the engine nor changes what the running request computes with; its one release frees the old row,
    and the next request runs on the new weights."""
    base, loras, _ = model
    directory = tmp_path / "swap"
    lora = LoRARequest("swap@1", str(directory))
    prompt = prompts(256, 16, seed=5)[14]  # 80 tokens: five prefill steps of 16
    sampled = SamplingParams(temperature=1.0, n=4, max_tokens=8, ignore_eos=True, seed=7)

    def engine_with(weights: LoRARequest):
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(weights.path, directory)
        engine = make_llm(base, max_loras=2, max_num_seqs=8, max_num_batched_tokens=16).engine
        engine.adapter_cache.load(lora)
        return engine

    def alone(weights: LoRARequest) -> dict[int, list[int]]:
        engine = engine_with(weights)
        engine.add_request(EngineRequest("r", prompt, sampled, lora=lora))
        return drain(engine)[0]["r"]

    old, new = alone(loras[0]), alone(loras[1])
    assert old != new and all(len(t) == 8 for t in old.values()) and len(old) == 4
    engine = engine_with(loras[0])
    engine.add_request(EngineRequest("r", prompt, sampled, lora=lora))
    engine.step()  # admitted: its first chunk of 16 prompt tokens ran on the row it pins
    assert engine.adapter_cache.evict(lora)  # deleted while pinned: the row is freed at the last release
    shutil.rmtree(directory)
    shutil.copytree(loras[1].path, directory)
    engine.adapter_cache.load(lora)  # registered again: other weights under the same key
    tokens, errors = drain(engine)
    assert not errors and tokens["r"] == old  # its 4 samples ran to the end on the weights it started with
    assert engine.adapter_cache.num_pinned == 0 and engine.adapter_cache.tier(lora) == "host"
    engine.add_request(EngineRequest("after", prompt, sampled, lora=lora))
    assert drain(engine)[0]["after"] == new
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.adapter_cache.num_pinned == 0


def test_async_adapter_verbs_move_an_adapter_between_tiers(model):
    base, loras, _ = model
    a, b = loras[:2]
    config = EngineConfig(model=str(base), device="cpu", enable_lora=True, max_loras=1, num_kv_blocks=64)
    engine = AsyncEngine.from_config(config)

    async def main():
        info = await engine.add_adapter(a)
        assert (info.adapter_id, info.rank, info.alpha) == ("a0", 8, 16.0) and info.digest.startswith("sha256:")
        assert await engine.digest(a) == info.digest and await engine.tier(a) == "host"
        assert await engine.load_adapter(a) == "device"
        assert await engine.pin_adapter(a) == "device"
        assert await engine.load_adapter(b) == "host"  # the only row is pinned
        stats = await engine.stats()
        assert stats.adapters_on_device == ("a0",) and stats.adapter_rows_pinned == 1
        assert stats.adapters_on_host == ("a0", "a1") and stats.adapter_loads == 2
        assert await engine.unpin_adapter(a) is True and await engine.unpin_adapter(a) is False
        assert await engine.load_adapter(b) == "device" and await engine.tier(a) == "host"  # b took a's row
        assert await engine.unload_adapter(b) is False and await engine.tier(b) == "host"
        assert await engine.remove_adapter(a) is False and await engine.tier(a) == "disk"
        assert await engine.digest(a) is None
        with pytest.raises(AdapterError, match="nowhere"):
            await engine.add_adapter(LoRARequest("nowhere", "/no/such/adapter"))
        with pytest.raises(ValueError, match="empty"):
            await engine.validate(EngineRequest("bad", [], GREEDY))
        stats = await engine.stats()
        assert stats.adapter_rows_pinned == 0 and stats.adapters_on_device == () and stats.num_requests == 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    with pytest.raises(EngineStopped):  # a stopped engine answers at once instead of leaving callers waiting
        asyncio.run(engine.tier(a))
    assert asyncio.run(engine.stats()).adapters_on_host == ("a1",)
