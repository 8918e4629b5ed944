"""Tool calls through a real socket with the real `openai` client: a named function's arguments and the required
calls are the offline engine's text under the schema tool_choice makes (greedy), streamed and not; the tools, an
assistant's calls (their arguments as objects) and the tool's answer reach the chat template; tool_choice "auto"
and malformed tools are 400s naming the field. The real model calling the right function: tests/test_gateway_demo.py.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from gateway.reasoning import REASONING_PARSERS
from gateway.tool_calls import ToolCallStream, checked_tools, tool_calling
from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters
]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD_SCHEMA = {"type": "object", "required": 1}
NAMED_F = {"type": "function", "function": {"name": "f"}}
# a template that shows what it was given: the tools, each message's calls (arguments read as an object), the answers
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}\n{% endfor %}<s>assistant: "
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("tools"), tokenizer, {"sql": 8})


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, trust_request_chat_template=True)) as running:
        yield running


def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def calling(tool_choice, parallel: bool = True, parser: str | None = None):
    return tool_calling(checked_tools(TOOLS), tool_choice, parallel, parser)


def offline_reply(tiny, tokenizer, tool_choice, max_tokens: int) -> tuple[str, str]:
    """(text, finish reason) of the offline engine on MESSAGES under the schema tool_choice makes, greedy."""
    root, _, _ = tiny
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    llm = LLM(model=str(root / "base"), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=calling(tool_choice).structured)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params)
    return out.outputs[0].text, out.outputs[0].finish_reason


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_tool_calls_are_the_offline_engines_text_streamed_and_not(server, tiny, tokenizer, tool_choice):
    text, finish = offline_reply(tiny, tokenizer, tool_choice, 40)
    reply = api(server).chat.completions.create(
        model=BASE, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=40, temperature=0
    )
    choice = reply.choices[0]
    complete = finish == "stop"
    assert choice.finish_reason == ("tool_calls" if complete else finish)
    chunks = list(
        api(server).chat.completions.create(
            model=BASE, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=40, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if tool_choice == NAMED:  # the call, cut short or not: its arguments are the text
        (call,) = choice.message.tool_calls
        assert choice.message.content is None and call.function.name == "get_weather" and call.id.startswith("call_")
        assert call.function.arguments == text
        assert pieces[0].id and pieces[0].function.name == "get_weather" and {p.index for p in pieces} == {0}
        assert "".join(p.function.arguments for p in pieces) == text
    elif complete:
        calls = json.loads(text)
        assert [c.function.name for c in choice.message.tool_calls] == [c["name"] for c in calls]
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [c["parameters"] for c in calls]
        assert [p.function.name for p in pieces] == [c["name"] for c in calls]
    else:  # the array cut short by max_tokens: text, as the model wrote it
        assert choice.message.tool_calls is None and choice.message.content == text
        assert not pieces and streamed_text == text


def test_tool_call_streams_unit():
    """A named call's pieces carry its id, type and name once; the required calls go out whole, with their indices."""
    named = ToolCallStream(calling(NAMED))
    first, _ = named.push('{"city":', None)
    second, reason = named.push(' "Paris"}', "stop")
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert first["tool_calls"][0]["id"].startswith("call_") and first["tool_calls"][0]["type"] == "function"
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]} and reason == "tool_calls"
    required = ToolCallStream(calling("required"))
    assert required.push('[{"name": "ping", "parameters": {}},', None) == (None, None)
    calls, reason = required.push(' {"name": "get_weather", "parameters": {"city": "Tokyo"}}]', "stop")
    assert reason == "tool_calls" and [c["index"] for c in calls["tool_calls"]] == [0, 1]
    assert [c["function"]["name"] for c in calls["tool_calls"]] == ["ping", "get_weather"]
    assert json.loads(calls["tool_calls"][1]["function"]["arguments"]) == {"city": "Tokyo"}
    assert ToolCallStream(calling("required")).push("[{", "length") == ({"content": "[{"}, "length")


def test_parallel_tool_calls_false_allows_one_call():
    schema = calling("required", parallel=False).structured.json
    assert schema["maxItems"] == 1 and "maxItems" not in calling("required").structured.json


def test_the_template_sees_the_tools_the_calls_and_the_answers(server, tokenizer):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
    ]
    body = {"model": BASE, "messages": history, "tools": TOOLS, "chat_template": TOOL_TEMPLATE}
    rendered = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()
    text = tokenizer.decode(rendered["tokens"])
    assert text.startswith("[tool get_weather][tool ping]<s>user: weather in Paris?")
    assert "[call get_weather city=Paris]" in text and "<s>tool: sunny[answers call_7]" in text
    reply = api(server).chat.completions.create(
        model=BASE, messages=history, tools=TOOLS, tool_choice="none", max_tokens=3, temperature=0,
        extra_body={"chat_template": TOOL_TEMPLATE},
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls is None and reply.usage.prompt_tokens == rendered["count"]


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"tools": TOOLS}, "tool_choice", "'auto'"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "two tools"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]}, "tools", "parameters"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format", "one"),
        ({"tools": [{"function": {"name": "f", "parameters": BAD_SCHEMA}}], "tool_choice": NAMED_F}, "tools", "JSON"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
            "messages",
            "arguments",
        ),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, text):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={"model": BASE, "messages": MESSAGES, **body})
        assert_openai_error(response, 400, param, text)
        assert http.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}).is_success


HERMES_TEXT = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "ping", "arguments": {}}</tool_call> <tool_call>{not json}</tool_call> <tool'
)


def test_the_hermes_parser_reads_the_same_calls_at_every_split():
    """The text cut in two at every place (a stream's pieces): the same content and calls, tags never leaking into
    the content except where a call does not read (bad JSON, an unclosed tag)."""
    expected_content = "Let me look.  <tool_call>{not json}</tool_call> <tool"
    for cut in range(len(HERMES_TEXT) + 1):
        stream = calling("auto", parser="hermes").stream()
        deltas = [stream.push(HERMES_TEXT[:cut], None), stream.push(HERMES_TEXT[cut:], "stop")]
        content = "".join((d or {}).get("content", "") for d, _ in deltas)
        calls = [c for d, _ in deltas for c in (d or {}).get("tool_calls", [])]
        assert content == expected_content, cut
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "ping")], cut
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert deltas[-1][1] == "tool_calls"
    content, calls = calling("auto", parser="hermes").reply("just text", True)
    assert (content, calls) == ("just text", None)
    content, calls = calling("auto", parser="hermes").reply('<tool_call>{"name": "ping"}</tool_call>', True)
    assert content is None and calls[0]["function"] == {"name": "ping", "arguments": "{}"}


# each parser's syntax calling get_weather for Tokyo, and the content the reply keeps beside the call
AUTO_CALLS = {
    "hermes": ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo"}}</tool_call>', "Sure. "),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Tokyo"}}', None),
    "pythonic": ('[get_weather(city="Tokyo")]', None),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', "Sure. "),
}


@pytest.fixture(scope="module", params=sorted(AUTO_CALLS))
def auto_server(request, tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, enable_auto_tool_choice=True, tool_call_parser=request.param)) as s:
        s.parser = request.param
        yield s


# --reasoning-parser qwen3 beside --tool-call-parser hermes, per-request templates trusted
REASONING_SETTINGS = dict(
    enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3", trust_request_chat_template=True
)


@pytest.fixture(scope="module")
def reasoning_server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, **REASONING_SETTINGS)) as running:
        yield running


def test_auto_tool_choice_reads_the_models_calls(auto_server):
    """With --enable-auto-tool-choice --tool-call-parser P, tools and no tool_choice ("auto"): a reply in P's syntax
    (here held to it by guided_regex, random weights writing nothing of the kind) comes back as tool_calls, streamed
    and not; a reply in plain text stays text."""
    call_text, content = AUTO_CALLS[auto_server.parser]
    regex = re.escape(call_text)
    client = api(auto_server)
    reply = client.chat.completions.create(
        model="sql", messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0, extra_body={"guided_regex": regex}
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}
    chunks = list(
        client.chat.completions.create(
            model="sql", messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0, stream=True,
            extra_body={"guided_regex": regex},
        )
    )  # fmt: skip
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert [(p.index, p.function.name) for p in pieces] == [(0, "get_weather")]
    assert json.loads(pieces[0].function.arguments) == {"city": "Tokyo"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = client.chat.completions.create(
        model="sql", messages=MESSAGES, tools=TOOLS, max_tokens=10, temperature=0, extra_body={"guided_regex": "a+b"}
    ).choices[0]
    assert re.fullmatch("a+b", text.message.content)
    assert text.message.tool_calls is None and text.finish_reason == "stop"
    named = client.chat.completions.create(
        model="sql", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=30
    ).choices[0]
    pattern = "[A-Za-z0-9]{9}" if auto_server.parser == "mistral" else "call_[0-9a-f]{24}"  # the server's id style
    assert all(re.fullmatch(pattern, c.id) for c in [call, pieces[0], *named.message.tool_calls])


THINKING_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: <think>\n"


def test_the_reasoning_parser_splits_the_reply(reasoning_server):
    """--reasoning-parser qwen3 beside the tool parser: a prompt that opens <think> has the reply reason (random
    weights never close it: all of it), streamed and not, and no content nor calls made of it; include_reasoning
    false drops it; a prompt that opens nothing leaves the reply content, its reasoning null."""
    client = api(reasoning_server)
    ask = dict(model="sql", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    thinking = {"chat_template": THINKING_TEMPLATE}
    whole = client.chat.completions.create(**ask, extra_body=thinking).choices[0]
    reasoning = whole.message.model_extra["reasoning"]
    assert reasoning and whole.message.model_extra["reasoning_content"] == reasoning
    assert whole.message.content is None and whole.message.tool_calls is None and whole.finish_reason == "length"
    chunks = list(client.chat.completions.create(**ask, stream=True, extra_body=thinking))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""
    dropped = client.chat.completions.create(**ask, extra_body={**thinking, "include_reasoning": False}).choices[0]
    assert "reasoning" not in (dropped.message.model_extra or {}) and dropped.message.content is None
    plain_template = THINKING_TEMPLATE.removesuffix("<think>\n")
    plain = client.chat.completions.create(**ask, extra_body={"chat_template": plain_template}).choices[0]
    assert plain.message.content and plain.message.model_extra["reasoning"] is None


@pytest.fixture(scope="module")
def offline_form_after_thinking(tiny, tokenizer) -> tuple[str, str]:
    """(the prompt, the offline engine's greedy text) of MESSAGES under THINKING_TEMPLATE held to CITY, the
    reasoning first."""
    root, _, _ = tiny
    prompt = tokenizer.apply_chat_template(MESSAGES, chat_template=THINKING_TEMPLATE, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    so = StructuredOutputsParams(json=CITY, reasoning_first="required")
    llm = LLM(model=str(root / "base"), device="cpu")
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)
    )
    return prompt, out.outputs[0].text


def test_a_form_follows_the_reasoning(reasoning_server, offline_form_after_thinking):
    """With a reasoning parser a reply held to a grammar reasons first, as vLLM's: the server's reply is the offline
    engine's text under the schema with reasoning_first "required" (the prompt opens <think>), split by the parser."""
    prompt, text = offline_form_after_thinking
    reasoning, content = REASONING_PARSERS["qwen3"].split(prompt, text)
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    reply = api(reasoning_server).chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=24, temperature=0, response_format=schema,
        extra_body={"chat_template": THINKING_TEMPLATE},
    ).choices[0]  # fmt: skip
    assert reasoning and (reply.message.model_extra["reasoning"], reply.message.content) == (reasoning, content or None)
