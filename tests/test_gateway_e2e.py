"""End to end through a real socket with the real `openai` client: completions and chat, streaming and not,
three adapters and the base interleaved concurrently, each text identical to the offline engine (greedy)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from adapters.ref import LoRARequest
from engine.interface import EngineSnapshot
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for

ADAPTERS = ("sql", "poem", "chat")
MAX_TOKENS = 12
EXACT = {"ignore_eos": True}  # exact token counts
PROMPTS = ["Alice was beginning to get very tired", "It was the best of times", "Call me Ishmael.", "The rabbit"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """A random tiny Llama and three random adapters (ranks 4, 8, 16) on disk."""
    return build_tiny(tmp_path_factory.mktemp("gateway"), tokenizer, dict(zip(ADAPTERS, (4, 8, 16))))


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters)) as running:
        yield running


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def offline_texts(tiny, jobs: list[tuple[str | None, list[int]]]) -> list[tuple[str, int]]:
    """(text, completion tokens) from the offline engine, greedy, for (adapter name, prompt ids) jobs."""
    root, _, adapters = tiny
    llm = LLM(model=str(root / "base"), enable_lora=True, max_loras=4, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    loras = [LoRARequest(name, adapters[name]) if name else None for name, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in jobs], params, lora_request=loras)
    return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]


def stats(server) -> EngineSnapshot:
    return asyncio.run(server.state.engine.stats())


def assert_idle(server) -> None:
    now = stats(server)
    assert now.num_requests == 0
    assert now.kv_blocks_free == now.kv_blocks_total
    assert now.adapter_rows_pinned == 0


def test_interleaved_adapters_stream_and_not_match_the_offline_engine(server, tiny, tokenizer):
    """16 concurrent requests: {base, sql, poem, chat} x {completions, chat} x {stream, not}; the base is
    also reached with TensorRT-LLM's `lora_request` form for one adapter."""
    api = client(server)
    jobs, calls = [], []
    for i, adapter in enumerate([None, *ADAPTERS]):
        prompt = PROMPTS[i % len(PROMPTS)]
        messages = [{"role": "user", "content": prompt}]
        chat_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for kind, ids in (
            ("completion", tokenizer.encode(prompt)),
            ("chat", tokenizer.encode(chat_text, add_special_tokens=False)),
        ):
            for stream in (False, True):
                jobs.append((adapter, ids))
                model, extra = (adapter or BASE), {}
                if adapter == "poem" and stream:
                    model, extra = BASE, {"lora_request": {"lora_name": "poem"}}
                calls.append((kind, model, prompt if kind == "completion" else messages, stream, extra))

    async def run(kind, model, prompt, stream, extra) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": extra}
        if stream:
            common["stream"], common["stream_options"] = True, {"include_usage": True}
        if kind == "completion":
            response = await api.completions.create(prompt=prompt, **common)
        else:
            response = await api.chat.completions.create(messages=prompt, **common)
        if not stream:
            choice = response.choices[0]
            return (choice.text if kind == "completion" else choice.message.content), response.usage
        text, usage = "", None
        async for chunk in response:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                assert chunk.model == model
                text += (c.text if kind == "completion" else c.delta.content) or ""
        return text, usage

    async def run_all():
        return await asyncio.gather(*(run(*call) for call in calls))

    results = asyncio.run(run_all())
    expected = offline_texts(tiny, jobs)
    for call, (text, usage), (want, num_tokens), (_, ids) in zip(calls, results, expected, jobs):
        assert text == want, call
        assert usage.completion_tokens == num_tokens and usage.prompt_tokens == len(ids), call
    assert {a for a, _ in jobs} == {None, *ADAPTERS}
    assert_idle(server)


def test_a_stream_interval_sends_several_tokens_per_chunk_and_the_same_text(server, tiny, tokenizer):
    """vLLM's per-request `stream_interval` (the server's is 1 here): the first token alone, then 4 per chunk, the
    rest with the last; the text and usage are those of a request streamed token by token; 0 is a 400."""
    api = sync_client(server)
    common = {"model": "sql", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0}
    results = []
    for extra in ({}, {"stream_interval": 4}):
        stream = api.completions.create(
            **common, stream=True, stream_options={"include_usage": True}, extra_body={**EXACT, **extra}
        )
        chunks = list(stream)
        sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
        results.append((sizes, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage))
    (one_by_one, text, usage), (joined, joined_text, joined_usage) = results
    assert one_by_one == [1] * MAX_TOKENS and joined == [1, 4, 4, 3]
    assert joined_text == text == offline_texts(tiny, [("sql", tokenizer.encode(PROMPTS[2]))])[0][0]
    assert joined_usage.completion_tokens == usage.completion_tokens == MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(**common, stream=True, extra_body={"stream_interval": 0})
    assert bad.value.body["param"] == "stream_interval" and "at least 1" in bad.value.body["message"]
    assert_idle(server)


def test_models_lists_the_base_and_adapters_with_parent(server):
    models = sync_client(server).models.list().data
    assert models[0].id == BASE and models[0].parent is None
    assert {m.id for m in models[1:]} == set(ADAPTERS)
    assert all(m.parent == BASE for m in models[1:])


def test_n_samples_and_several_prompts_and_logprobs(server, tokenizer):
    api = sync_client(server)
    response = api.completions.create(
        model="sql", prompt=PROMPTS[:2], n=3, max_tokens=5, temperature=1.0, seed=7, logprobs=2, extra_body=EXACT
    )
    assert sorted(c.index for c in response.choices) == list(range(6))
    for c in response.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    assert response.usage.completion_tokens == 30
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:2])
    chat = api.chat.completions.create(
        model="poem",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body=EXACT,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_streamed_samples_of_several_prompts_match_the_request_unstreamed(server):
    """Two prompts x n = 2 seeded samples (completions), and n = 2 chat samples: each choice's streamed text (its
    chunks told apart by their index) is the text of the same request unstreamed, run alone the same way."""
    api = sync_client(server)
    seeded = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 2, "extra_body": EXACT}
    unstreamed = api.completions.create(model="poem", prompt=PROMPTS[:2], **seeded)
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(model="poem", prompt=PROMPTS[:2], stream=True, **seeded):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in unstreamed.choices}
    assert len(streamed) == 4 and len(set(streamed.values())) > 1

    messages = [{"role": "user", "content": PROMPTS[2]}]
    unstreamed_chat = api.chat.completions.create(model="chat", messages=messages, **seeded)
    streamed = {}
    for chunk in api.chat.completions.create(model="chat", messages=messages, stream=True, **seeded):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in unstreamed_chat.choices}
    assert len(streamed) == 2


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    body = {"model": "sql", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    for _ in range(200):  # the abort reaches the engine thread within a few steps
        if not stats(server).num_requests:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert_idle(server)
    assert stats(server).generated_tokens > 0
    again = sync_client(server).completions.create(model="sql", prompt="x", max_tokens=3, extra_body=EXACT)
    assert again.usage.completion_tokens == 3  # the engine thread lives on


def test_a_non_streaming_client_that_goes_away_aborts_its_request(server):
    before = stats(server).generated_tokens
    body = {"model": "chat", "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(60, read=0.3)) as http:
        http.post(f"{server.url}/v1/completions", json=body)
    for _ in range(100):
        if not stats(server).num_requests:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert_idle(server)
    assert 0 < stats(server).generated_tokens - before < 400  # stopped early, not run to the end


def test_health_version_and_openapi_docs(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/version").json()["version"]
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/adapters"} <= set(paths)
        assert "swagger" in http.get("/docs").text.lower()
