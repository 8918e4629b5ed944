"""`/v1/responses` through a real socket with the real `openai` client: a response is the chat completion of the same
turn (greedy: the same text, the same token counts), streamed through the client's own event accumulator
(`client.responses.stream`, which checks every event's order and identity) and not; instructions, earlier calls and
the tools' outputs reach the template as chat's messages do; a named function's call, a JSON schema, a reasoning
split and logprobs come back as OpenAI's output items; what this server does not serve is a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.responses_format import ResponseEvents
from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error
from tests.test_gateway_tools import CITY, MESSAGES, REASONING_SETTINGS, THINKING_TEMPLATE, TOOL_TEMPLATE, TOOLS

QUESTION = MESSAGES[0]["content"]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's form of chat's tools
CLOSED_CITY = {**CITY, "additionalProperties": False}  # an object that ends after its city: the reply completes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("responses"), tokenizer, {"sql": 8})


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, trust_request_chat_template=True)) as running:
        yield running


@pytest.fixture(scope="module")
def reasoning_server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, **REASONING_SETTINGS)) as running:
        yield running


def api(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_reply(client, messages, **kw):
    return client.chat.completions.create(model="sql", messages=messages, temperature=0, **kw)


def streamed(client, **kw):
    """(the events, the final response) of a stream read by the client's accumulator, which raises on an event out
    of order or an item whose identity changed."""
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_a_response_is_the_chat_completion_of_the_turn(server):
    client = api(server)
    chat = chat_reply(client, [{"role": "system", "content": "Be brief."}, *MESSAGES], max_tokens=12)
    assert chat.choices[0].finish_reason == "length"  # random weights: 12 tokens cut it short
    ask = dict(model="sql", instructions="Be brief.", input=QUESTION, max_output_tokens=12, temperature=0)
    response = client.responses.create(**ask)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "sql"
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == chat.usage.total_tokens
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.status == message.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief." and response.store is False
    # the same as input items, and as a stream: the deltas are the text, the last event the response
    parts = [{"type": "input_text", "text": QUESTION}]
    items = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    again = client.responses.create(model="sql", input=items, max_output_tokens=12, temperature=0)
    assert again.output_text == response.output_text
    events = list(client.responses.create(**ask, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [response.output_text]


def test_a_completed_stream_reads_through_the_clients_accumulator(server):
    client = api(server)
    chat = chat_reply(client, MESSAGES, max_tokens=40, stop=["e"])
    assert chat.choices[0].finish_reason == "stop"  # random weights write an "e" within 40 tokens
    ask = dict(model="sql", input=QUESTION, max_output_tokens=40, temperature=0, extra_body={"stop": ["e"]})
    events, final = streamed(client, **ask)
    assert final.status == "completed" and final.output_text == chat.choices[0].message.content
    assert final.usage.output_tokens == chat.usage.completion_tokens
    assert [e.type for e in events][-1] == "response.completed"
    text_events = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in text_events) == final.output_text
    assert final.incomplete_details is None


def test_earlier_calls_and_tool_outputs_reach_the_template_as_chats(server):
    """The assistant's function_call items and the tools' function_call_output items are the chat messages
    (assistant tool_calls, then tool) that the template shows: the same greedy reply from the same prompt."""
    client = api(server)
    args = json.dumps({"city": "Paris"})
    chat_messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    template = {"chat_template": TOOL_TEMPLATE}
    chat = chat_reply(client, chat_messages, tools=TOOLS, tool_choice="none", max_tokens=16, extra_body=template)
    items = [
        *MESSAGES,
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier reasoning: dropped, as chat templates do
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    response = client.responses.create(
        model="sql", input=items, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=16, temperature=0,
        extra_body=template,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_named_function_is_a_function_call_item(server):
    """A named function's call, streamed through the client's accumulator: its arguments' deltas, their done event
    and the final item are chat's arguments (a schema that ends the object, so that the call completes)."""
    client = api(server)
    pick = {"name": "pick", "parameters": CLOSED_CITY}
    named = {"type": "function", "function": {"name": "pick"}}
    chat = chat_reply(
        client, MESSAGES, tools=[{"type": "function", "function": pick}], tool_choice=named, max_tokens=150
    )
    ask = dict(model="sql", input=QUESTION, tools=[{"type": "function", **pick}], max_output_tokens=150, temperature=0)
    response = client.responses.create(**ask, tool_choice={"type": "function", "name": "pick"})
    assert chat.choices[0].finish_reason == "tool_calls" and response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "pick" and call.status == "completed"
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    events, final = streamed(client, **ask, tool_choice={"type": "function", "name": "pick"})
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments  # sent as they are written
    (streamed_call,) = final.output
    assert (streamed_call.name, streamed_call.arguments) == ("pick", call.arguments)


def test_a_json_schema_holds_the_text(server):
    client = api(server)
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CLOSED_CITY}}
    chat = chat_reply(client, MESSAGES, max_tokens=150, response_format=schema).choices[0].message.content
    form = {"format": {"type": "json_schema", "name": "city", "schema": CLOSED_CITY, "strict": True}}
    response = client.responses.create(model="sql", input=QUESTION, max_output_tokens=150, temperature=0, text=form)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    assert response.output_text == chat and json.loads(chat)["city"] in ("Paris", "Tokyo")


def test_logprobs_are_chats(server):
    client = api(server)
    chat = chat_reply(client, MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    ask = dict(model="sql", input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2)
    response = client.responses.create(**ask, include=["message.output_text.logprobs"])
    (part,) = response.output[0].content
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [(lp.token, lp.logprob) for lp in chat]
    assert [len(lp.top_logprobs) for lp in part.logprobs] == [2] * len(chat)
    events = list(client.responses.create(**ask, include=["message.output_text.logprobs"], stream=True))
    tokens = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert tokens == [lp.token for lp in chat]


def test_the_reasoning_is_a_reasoning_item(reasoning_server):
    """--reasoning-parser qwen3, a template that opens <think>: random weights never close it, so the reply is all
    reasoning (chat's reasoning field), an empty message after it; its tokens count as reasoning tokens."""
    client = api(reasoning_server)
    thinking = {"chat_template": THINKING_TEMPLATE}
    chat = chat_reply(client, MESSAGES, max_tokens=12, extra_body=thinking).choices[0].message
    ask = dict(model="sql", input=QUESTION, max_output_tokens=12, temperature=0, extra_body=thinking)
    response = client.responses.create(**ask)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.model_extra["reasoning"]
    assert message.type == "message" and response.output_text == ""
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


@pytest.mark.parametrize(
    "body, status, param, text",
    [
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "send the turns in input"),
        ({"background": True}, 400, "background", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools", "'web_search'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input", "image"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input", "item_reference"),
        ({"input": []}, 400, "input", "empty"),
        ({"max_output_tokens": 10**6}, 400, "max_output_tokens", ""),
        ({"text": {"format": {"type": "xml"}}}, 400, "text.format", "text.format"),
        ({"include": ["file_search_call.results"]}, 400, "include", "file_search_call.results"),
        ({"model": "nope"}, 404, "model", "nope"),
        ({"tool_choice": "required"}, 400, "tool_choice", "no tools"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(server, body, status, param, text):
    request = {"model": BASE, "input": QUESTION, "max_output_tokens": 4, **body}
    assert_openai_error(httpx.post(f"{server.url}/v1/responses", json=request, timeout=60), status, param, text)


def test_nothing_is_stored_and_a_stateless_clients_include_is_served(server):
    """A stateless client (the Agents SDK with store=False) asks for reasoning.encrypted_content: served (the
    reasoning is in the clear, nothing to encrypt); retrieving the response by its id is a 404 that says why."""
    client = api(server)
    ask = dict(model="sql", input=QUESTION, max_output_tokens=4, temperature=0, store=False)
    response = client.responses.create(**ask, include=["reasoning.encrypted_content"])
    assert response.status == "incomplete" and response.store is False
    got = httpx.get(f"{server.url}/v1/responses/{response.id}", timeout=60)
    assert_openai_error(got, 404, "response_id", "stores no responses")


def test_logprobs_beside_a_parser_are_refused(reasoning_server):
    request = {"model": BASE, "input": QUESTION, "include": ["message.output_text.logprobs"]}
    response = httpx.post(f"{reasoning_server.url}/v1/responses", json=request, timeout=60)
    assert_openai_error(response, 400, "include", "text replies only")


def test_response_events_open_and_close_items_in_order():
    """The event machine alone: reasoning, then text, then a call in two pieces; each item opened once, closed
    when the next opens, the response's output the items as closed."""
    events = ResponseEvents(lambda status, output, *rest: {"id": "resp_x", "status": status, "output": list(output)})
    out = events.start()
    out += events.push({"reasoning": "hm"}) + events.push({"content": "Sure. "})
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    out += events.push({"tool_calls": [first]})
    out += events.push({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    out += events.finish("completed", None, {})
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in out]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = json.loads(out[-1].split("data: ", 1)[1])["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][1]["content"][0]["text"] == "Sure. "
    assert [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in out] == list(range(len(out)))


def test_a_reply_of_reasoning_alone_still_ends_with_a_message():
    events = ResponseEvents(lambda status, output, *rest: {"status": status, "output": list(output)})
    out = events.start() + events.push({"reasoning": "hm"}) + events.finish("incomplete", {"reason": "x"}, {})
    final = json.loads(out[-1].split("data: ", 1)[1])
    assert final["type"] == "response.incomplete"
    assert [item["type"] for item in final["response"]["output"]] == ["reasoning", "message"]


def test_a_failure_after_the_start_is_an_error_event_then_response_failed():
    events = ResponseEvents(lambda status, output, *rest, error=None: {"status": status, "error": error})
    out = events.start() + events.push({"content": "Hi"})
    out += events.fail({"code": "sequence_failed", "message": "the engine failed this request", "param": None})
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in out]
    assert kinds[-3:] == ["response.output_item.done", "error", "response.failed"]
    failed = json.loads(out[-1].split("data: ", 1)[1])["response"]
    assert failed == {
        "status": "failed",
        "error": {"code": "sequence_failed", "message": "the engine failed this request"},
    }
