"""The models' tool-call syntaxes (gateway/tool_parsers.py): each parser reads its syntax into OpenAI calls with the
arguments as JSON text, streamed in pieces of any size the same as whole; text stays text, and what only looks like
a call (or is cut short) is sent as written. Through the server: tests/test_gateway_tools.py."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_calls import checked_tools, tool_calling
from gateway.tool_parsers import TOOL_CALL_PARSERS

PARIS = {"city": "Paris", "days": [1, 2], "metric": True, "note": None}

# parser, text, expected content ("" where the reply is calls only), expected calls as (name, arguments)
CASES = [
    ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": ' + json.dumps(PARIS) + "}</tool_call>", "Sure. ",
     [("get_weather", PARIS)]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>',
     "\n", [("ping", {}), ("ping", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(PARIS) + "}", "", [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "ping", '
     '"parameters": {}}', "", [("get_weather", {"city": "Paris"}), ("ping", {})]),
    ("llama3_json", '  \n{"name": "ping", "arguments": {}}', "", [("ping", {})]),
    ("pythonic", '[get_weather(city="Paris", days=[1, 2], metric=True, note=None), ping()]', "",
     [("get_weather", PARIS), ("ping", {})]),
    ("pythonic", "<|python_start|>[get_weather(city='Paris')]<|python_end|>", "", [("get_weather", {"city": "Paris"})]),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(PARIS) + "}]",
     "Let me look. ", [("get_weather", PARIS)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("ping", {})]),
]  # fmt: skip

# replies that are text, whole: plain text, calls that do not read as calls, calls cut short
TEXT = [
    ("hermes", "The weather is fine."),
    ("hermes", "<tool_call>not json</tool_call> then text"),
    ("hermes", '<tool_call>{"name": "get_weather", "argu'),
    ("llama3_json", 'Here: {"name": "ping", "parameters": {}}'),  # a call only where it begins the reply
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but no call's name
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci'),
    ("pythonic", "[1] See the footnote."),
    ("pythonic", "[get_weather('Paris')]"),  # positional: not the syntax
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),  # not a literal: never evaluated
    ("pythonic", "[get_weather(city={1, 2})]"),  # a set has no JSON form
    ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>"),  # nested past Python's stack: still text
    ("llama3_json", "{" + '"a":[' * 50_000),
    ("pythonic", "[f(x=" + "[" * 100_000 + ")]"),
    ("mistral", "No tools needed [TOOL"),
    ("mistral", "[TOOL_CALLS][{'name': 'get_weather'}]"),
]


def feed(parser: str, text: str, piece: int) -> tuple[str, list[dict], str | None, list[str]]:
    """(content, calls, the last finish reason, each delta's keys) of `text` pushed `piece` characters at a time."""
    stream = TOOL_CALL_PARSERS[parser]()
    content, calls, reason, keys = "", [], None, []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    for i, part in enumerate(pieces):
        delta, reason = stream.push(part, "stop" if i == len(pieces) - 1 else None)
        if delta is not None:
            keys.append(sorted(delta))
            content += delta.get("content", "")
            calls += delta.get("tool_calls", [])
    return content, calls, reason, keys


@pytest.mark.parametrize("piece", [1, 4, 10_000])
@pytest.mark.parametrize(("parser", "text", "content", "expected"), CASES)
def test_each_syntax_reads_as_calls_streamed_as_whole(parser, text, content, expected, piece):
    got_content, calls, reason, _ = feed(parser, text, piece)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert [c["index"] for c in calls] == list(range(len(expected)))
    assert all(c["type"] == "function" for c in calls) and len({c["id"] for c in calls}) == len(calls)
    assert reason == "tool_calls"


@pytest.mark.parametrize("piece", [1, 3, 10_000])
@pytest.mark.parametrize(("parser", "text"), TEXT)
def test_text_and_what_does_not_read_as_calls_stay_as_written(parser, text, piece):
    content, calls, reason, _ = feed(parser, text, piece)
    assert (content, calls, reason) == (text, [], "stop")


def test_text_streams_out_before_the_reply_ends():
    """Text goes out as it comes, but for what may begin a call's tag, held back until the next piece tells."""
    stream = TOOL_CALL_PARSERS["mistral"]()
    assert stream.push("Hello", None) == ({"content": "Hello"}, None)
    assert stream.push(" [TOOL", None) == ({"content": " "}, None)  # "[TOOL" may be [TOOL_CALLS]
    assert stream.push("S] and more", None) == ({"content": "[TOOLS] and more"}, None)
    leading = TOOL_CALL_PARSERS["llama3_json"]()
    assert leading.push("  ", None) == (None, None)  # a call may follow the whitespace
    assert leading.push("Sunny", None) == ({"content": "  Sunny"}, None)
    assert leading.push(' {"name": "ping"}', "length") == ({"content": ' {"name": "ping"}'}, "length")


def test_a_reply_cut_short_keeps_its_finish_reason_and_mistral_ids_are_nine_alphanumerics():
    content, calls, reason, _ = feed("hermes", '<tool_call>{"name": "ping"}</tool_call> and <tool_call>{"na', 7)
    assert [c["function"]["name"] for c in calls] == ["ping"] and reason == "tool_calls"
    assert content == ' and <tool_call>{"na'  # the unclosed call, as written
    stream = TOOL_CALL_PARSERS["hermes"]()
    delta, reason = stream.push('<tool_call>{"name": "ping"}</tool_call> more', "length")
    assert reason == "length" and delta["tool_calls"][0]["function"]["name"] == "ping"
    _, calls, _, _ = feed("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', 5)
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls) and len(calls) == 2
    _, calls, _, _ = feed("hermes", '<tool_call>{"name": "ping"}</tool_call>', 5)
    assert re.fullmatch("call_[0-9a-f]{24}", calls[0]["id"])


def test_named_and_required_calls_take_the_servers_id_style():
    """A mistral server's named and required calls get Mistral's nine-character ids too (its templates refuse any
    other id in the calls sent back), streamed and not; other servers' get call_ ids."""
    tools = checked_tools([{"type": "function", "function": {"name": "ping"}}])
    named = {"type": "function", "function": {"name": "ping"}}
    styles = (("mistral", "[A-Za-z0-9]{9}"), ("hermes", "call_[0-9a-f]{24}"), (None, "call_[0-9a-f]{24}"))
    for syntax, pattern in styles:
        for choice, text in ((named, "{}"), ("required", '[{"name": "ping", "parameters": {}}]')):
            calling = tool_calling(tools, choice, True, None, syntax)
            _, calls = calling.reply(text, True)
            delta, _ = calling.stream().push(text, "stop")
            ids = [c["id"] for c in calls] + [c["id"] for c in delta["tool_calls"]]
            assert all(re.fullmatch(pattern, i) for i in ids), (syntax, choice, ids)


FRAGMENTS = [
    "Sure. ", " ", "\n", "<tool_call>", "</tool_call>", "<tool", "_call>", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "{", "}",
    "[", "]", '"name": "ping"', '"arguments": {}', '"parameters": {"city": "Paris"}', ", ", "; ", "ping(", ")", "x=1",
    "<|python_tag|>", "<|python_start|>", "<|python_end|>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
    '[get_weather(city="Oslo")]', "text",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(sorted(TOOL_CALL_PARSERS)),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_split_of_any_reply_reads_as_the_whole_reply(parser, parts, cuts):
    """Pushed in pieces cut anywhere, any reply gives the content and calls it gives whole: the parsers' held text
    and tags never depend on where the pieces fall."""
    text = "".join(parts)
    whole, calls, reason, _ = feed(parser, text, 10**6)
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, content, streamed = TOOL_CALL_PARSERS[parser](), "", []
    pieces = [text[a:b] for a, b in itertools.pairwise(points)] or [""]
    for i, piece in enumerate(pieces):
        delta, last = stream.push(piece, "stop" if i == len(pieces) - 1 else None)
        content += (delta or {}).get("content", "")
        streamed += (delta or {}).get("tool_calls", [])
    assert content == whole and last == reason
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
