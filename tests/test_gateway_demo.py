"""`loraplex serve` with no --model: the embedded demo (SmolLM2 + three adapters from the user's cache), the
adapters registered and public, auth off; each adapter's behaviour checked through the HTTP API with the real
`openai` client on held-out prompts, and the base shows none of them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from gateway.settings import ServeSettings
from loraplex.cli import with_demo
from loraplex.demo import DEMO_MODEL_NAME
from loraplex.demo.behaviours import BEHAVIOURS, HELD_OUT_PROMPTS
from tests.gateway_server import ServerThread


@pytest.fixture(scope="module")
def demo_server(demo, tmp_path_factory):
    registry = tmp_path_factory.mktemp("registry") / "registry.db"
    settings = ServeSettings(database_url=f"sqlite:///{registry}", device="cpu")
    with ServerThread(with_demo(settings)) as server:
        yield server


def replies(server, model: str) -> list[str]:
    """The held-out prompts sent at once (the engine batches them), answers in prompt order."""
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

    def ask(prompt: str) -> str:
        response = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=100, temperature=0
        )
        return response.choices[0].message.content

    with ThreadPoolExecutor(len(HELD_OUT_PROMPTS)) as pool:
        return list(pool.map(ask, HELD_OUT_PROMPTS))


def test_the_demo_serves_smollm2_and_three_public_adapters_without_keys(demo_server):
    api = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="anything", max_retries=0)
    models = {m.id: m for m in api.models.list().data}
    assert set(models) == {DEMO_MODEL_NAME, *BEHAVIOURS}
    assert all(models[name].parent == DEMO_MODEL_NAME for name in BEHAVIOURS)
    assert not demo_server.state.auth_enabled


@pytest.mark.parametrize("adapter", list(BEHAVIOURS))
def test_each_adapter_shows_its_behaviour_on_held_out_prompts(demo_server, adapter):
    answers = replies(demo_server, adapter)
    assert sum(map(BEHAVIOURS[adapter].check, answers)) >= 7, answers


def test_the_base_shows_none_of_the_behaviours(demo_server):
    answers = replies(demo_server, DEMO_MODEL_NAME)
    for name, behaviour in BEHAVIOURS.items():
        assert not any(map(behaviour.check, answers)), (name, answers)
    assert "Tokyo" in answers[0]  # "What is the capital of Japan?": a real model answering


def test_bench_serve_against_the_demo_server(demo_server, tmp_path):
    """`loraplex bench serve` through the CLI against the live demo: the JSON fields and valid PNGs."""
    from loraplex.cli import main
    from tests.test_bench_serve import check_png, check_result

    main(
        ["bench", "serve", "--url", demo_server.url, "--num-prompts", "6", "--adapters", "0,3",
         "--popularity", "uniform", "--input-len", "8", "--output-len", "4", "--endpoint", "chat",
         "--result-dir", str(tmp_path), "--result-json", "demo.json", "--disable-tqdm", "--timeout", "60"]
    )  # fmt: skip
    result = check_result(tmp_path / "demo.json", 6, [0, 3])
    for run in result["runs"]:
        assert run["failed"] == 0 and run["completed"] == 6
        assert run["ttft_ms"]["p50"] > 0 and run["request_throughput"] > 0
    assert set(result["runs"][1]["per_adapter"]) <= set(BEHAVIOURS)
    assert len(result["plots"]) >= 3
    for plot in result["plots"]:
        check_png(Path(plot))


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("model", [DEMO_MODEL_NAME, *BEHAVIOURS])
def test_structured_outputs_on_the_real_model_and_each_adapter(demo_server, model):
    """response_format json_schema (streamed and not) and json_object through the real client: SmolLM2 and each
    adapter answer with JSON that follows the schema (for the base, the prompt's facts); guided_choice picks a listed
    answer (greedy token by token: not always the one the model would write free, "Kyoto" here)."""
    api = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = "Describe a person named Alice, aged 30, who lives in Paris, as JSON with name, age and city."
    messages = [{"role": "user", "content": ask}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = api.chat.completions.create(
        model=model, messages=messages, max_tokens=80, temperature=0, response_format=schema
    )
    assert reply.choices[0].finish_reason == "stop"
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
    if model == DEMO_MODEL_NAME:
        assert person == {"name": "Alice", "age": 30, "city": "Paris"}
    chunks = api.chat.completions.create(
        model=model, messages=messages, max_tokens=80, temperature=0, response_format=schema, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    anything = api.chat.completions.create(
        model=model, messages=messages, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    capital = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["Tokyo", "Kyoto", "Osaka"]},
    ).choices[0]
    assert capital.message.content in {"Tokyo", "Kyoto", "Osaka"} and capital.finish_reason == "stop"


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def test_tool_calls_on_the_real_model(demo_server):
    """tool_choice naming a function and "required", streamed and not: SmolLM2 calls get_weather for Paris with
    arguments that parse, and a conversation carrying the call and its result is answered as text."""
    api = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        reply = api.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=messages, tools=WEATHER_TOOLS, tool_choice=tool_choice, max_tokens=60,
            temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
        chunks = list(
            api.chat.completions.create(
                model=DEMO_MODEL_NAME, messages=messages, tools=WEATHER_TOOLS, tool_choice=tool_choice,
                max_tokens=60, temperature=0, parallel_tool_calls=False, stream=True,
            )
        )  # fmt: skip
        pieces = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        assert pieces[0].id and pieces[0].function.name == "get_weather"
        assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius"},
    ]
    answer = api.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=history, tools=WEATHER_TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content


def test_the_responses_api_on_the_real_model(demo_server):
    """/v1/responses on SmolLM2 and its adapters: each adapter's behaviour in output_text (streamed through the
    client's accumulator too), and "required" a function_call item for get_weather in Paris."""
    api = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(input="What is the capital of Japan?", max_output_tokens=80, temperature=0)
    for model, behaviour in BEHAVIOURS.items():
        response = api.responses.create(model=model, **ask)
        assert response.status == "completed" and behaviour.check(response.output_text), response.output_text
        with api.responses.stream(model=model, **ask) as stream:
            assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == response.output_text
            assert stream.get_final_response().output_text == response.output_text
    assert "tokyo" in api.responses.create(model=DEMO_MODEL_NAME, **ask).output_text.lower()
    tools = [{"type": "function", **t["function"]} for t in WEATHER_TOOLS]
    weather = api.responses.create(
        model=DEMO_MODEL_NAME, input="What is the weather like in Paris today?", tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = weather.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "paris" in json.loads(call.arguments)["city"].lower()
