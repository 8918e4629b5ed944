"""Structured outputs end to end, through a real socket with the real `openai` client: OpenAI's response_format and
vLLM's structured_outputs / guided_* fields, completions and chat, streamed and not, run concurrently with free
requests; each text is the offline engine's for the same StructuredOutputsParams (greedy), and a schema that does not
compile is a 400 naming its field while the requests beside it finish."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
MAX_TOKENS = 24
COMPACT = {"json": SCHEMA, "disable_any_whitespace": True}
# (body fields, the engine's StructuredOutputsParams for them)
FORMS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": COMPACT}, COMPACT),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, {"regex": r"[0-9]{3}-[a-z]{2}"}),
    ({"guided_choice": ["yes", "no", "maybe"]}, {"choice": ["yes", "no", "maybe"]}),
    ({"guided_grammar": 'root ::= "<" [a-c]+ ">"'}, {"grammar": 'root ::= "<" [a-c]+ ">"'}),
    ({"structured_outputs": {"regex": "x+y"}}, {"regex": "x+y"}),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("structured"), tokenizer, {"sql": 8})


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters)) as running:
        yield running


def offline(tiny, jobs: list[tuple[str | None, list[int], dict]]) -> list[str]:
    """The offline engine's greedy texts for (adapter, prompt ids, StructuredOutputsParams options) jobs."""
    root, _, adapters = tiny
    llm = LLM(model=str(root / "base"), enable_lora=True, max_loras=4, device="cpu")
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**so))
        for _, _, so in jobs
    ]
    loras = [LoRARequest(name, adapters[name]) if name else None for name, _, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in jobs], params, lora_request=loras)
    return [o.outputs[0].text for o in outs]


def test_every_form_streamed_and_not_matches_the_offline_engine(server, tiny, tokenizer):
    """Each form on completions and chat, streamed and not, on the base and an adapter, all at once beside free
    requests: 28 constrained requests, each the offline engine's text for its grammar."""
    api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "give me data"}]
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    jobs, calls = [], []
    for i, (fields, so) in enumerate(FORMS):
        model = "sql" if i % 2 else BASE
        adapter = "sql" if i % 2 else None
        for stream in (False, True):
            jobs.append((adapter, tokenizer.encode("data:"), so))
            calls.append(
                api.completions.create(
                    model=model, prompt="data:", max_tokens=MAX_TOKENS, temperature=0, stream=stream, extra_body=fields
                )
            )
            jobs.append((adapter, chat_ids, so))
            calls.append(
                api.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=stream,
                    extra_body=fields,
                )
            )
    free = [api.completions.create(model=BASE, prompt="free", max_tokens=8, temperature=0) for _ in range(4)]

    async def text(call) -> str:
        result = await call
        if isinstance(result, openai.AsyncStream):
            parts = []
            async for chunk in result:
                for choice in chunk.choices:
                    delta = getattr(choice, "delta", None)
                    parts.append((delta.content if delta else choice.text) or "")
            return "".join(parts)
        choice = result.choices[0]
        return choice.message.content if hasattr(choice, "message") else choice.text

    async def run():
        return await asyncio.gather(*(text(c) for c in calls + free))

    got = asyncio.run(run())
    assert got[: len(calls)] == offline(tiny, jobs)
    for (fields, _), text_ in zip([(f, s) for f, s in FORMS for _ in range(4)], got):
        if "guided_regex" in fields:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_)
        if "guided_choice" in fields:
            assert text_ in ("yes", "no", "maybe")
        if "structured_outputs" in fields and "json" in fields["structured_outputs"]:
            value = json.loads(text_)
            assert set(value) == {"ok", "n"}
    assert all(len(t) > 0 for t in got[len(calls) :])


def test_n_samples_each_follow_the_grammar(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = api.completions.create(
        model="sql", prompt="id:", max_tokens=12, n=3, temperature=1.0, seed=3, extra_body={"guided_regex": "[a-f]{4}"}
    )
    assert len(reply.choices) == 3 and all(re.fullmatch("[a-f]{4}", c.text) for c in reply.choices)
    assert all(c.finish_reason == "stop" for c in reply.choices)


def test_a_schema_that_does_not_compile_is_a_400_and_the_others_finish(server):
    api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}

    async def run():
        good = [
            api.completions.create(
                model=BASE, prompt="p", max_tokens=6, temperature=0, extra_body={"guided_regex": "z+"}
            )
            for _ in range(3)
        ]
        bad = api.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "x"}], max_tokens=6, response_format=bad_schema
        )
        return await asyncio.gather(*good, bad, return_exceptions=True)

    *good, bad = asyncio.run(run())
    assert isinstance(bad, openai.BadRequestError)
    assert bad.body["param"] == "response_format" and "JSON schema" in bad.body["message"]
    assert bad.body["code"] == "invalid_structured_output"
    assert all(re.fullmatch("z+", g.choices[0].text) for g in good)
    snapshot = asyncio.run(server.state.engine.stats())
    assert snapshot.num_requests == 0 and snapshot.kv_blocks_free == snapshot.kv_blocks_total
