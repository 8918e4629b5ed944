"""Reasoning outputs (gateway/reasoning.py) and a chat choice's fields put together (gateway/chat_replies.py): the
`<think>` split, by parser and by what the prompt opened, the same streamed in pieces of any size as whole; the
tool calls read from the content after the reasoning; `include_reasoning: false` drops it. Through the server:
tests/test_gateway_tools.py."""

from __future__ import annotations

import copy
import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat_replies import ChatReplies, parser_warnings
from gateway.reasoning import REASONING_PARSERS, tags_are_special
from gateway.tool_calls import checked_tools, tool_calling

# parser, the prompt's end, the reply, expected (reasoning, content)
CASES = [
    ("deepseek_r1", "<|Assistant|>", "<think>\nCompare 9.11 and 9.8.\n</think>\n\n9.8 is larger.",
     ("\nCompare 9.11 and 9.8.\n", "\n\n9.8 is larger.")),
    ("deepseek_r1", "<|Assistant|><think>\n", "Compare them.</think>9.8", ("Compare them.", "9.8")),  # R1's template
    ("deepseek_r1", "<|Assistant|>", "Compare them, and the reply was cut sh",
     ("Compare them, and the reply was cut sh", "")),  # reasoning until </think>: all of it
    ("qwen3", "<|im_start|>assistant\n", "<think>\nHmm.\n</think>\n\nHello!", ("\nHmm.\n", "\n\nHello!")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>Hello!", ("Hmm.", "Hello!")),  # opened by the prompt
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello! <think> is a tag.",
     (None, "Hello! <think> is a tag.")),  # enable_thinking false: the template closed it, all content
    ("qwen3", "<|im_start|>assistant\n", "Hello!", (None, "Hello!")),
]  # fmt: skip


def streamed(syntax, prompt: str, text: str, piece: int) -> tuple[str, str]:
    stream = syntax.stream(prompt)
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    out = [stream.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("piece", [1, 3, 10_000])
@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), CASES)
def test_the_reasoning_splits_off_streamed_as_whole(parser, prompt, text, expected, piece):
    syntax = REASONING_PARSERS[parser]
    assert syntax.split(prompt, text) == expected
    assert streamed(syntax, prompt, text, piece) == (expected[0] or "", expected[1])


def test_reasoning_streams_out_before_it_ends():
    stream = REASONING_PARSERS["deepseek_r1"].stream("")
    assert stream.push("<thi", False) == ("", "")  # may be <think>: held
    assert stream.push("nk>Step one. </th", False) == ("Step one. ", "")  # may be </think>: held
    assert stream.push("ink>Done", False) == ("", "Done")
    assert stream.push(" here.", True) == ("", " here.")


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = checked_tools([{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}])


def test_the_tool_calls_are_read_from_the_content_after_the_reasoning():
    calling = tool_calling(TOOLS, "auto", True, "hermes")
    replies = ChatReplies(calling, REASONING_PARSERS["qwen3"], "assistant\n")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = f"<think>A <tool_call> is needed.</think>\n{call}"
    message, reason = replies.message(text, "stop")
    assert reason == "tool_calls"
    assert message["reasoning"] == message["reasoning_content"] == "A <tool_call> is needed."
    assert message["content"] is None  # whitespace beside calls: none, as vLLM sends
    (made,) = message["tool_calls"]
    assert made["function"]["name"] == "get_weather" and json.loads(made["function"]["arguments"]) == {"city": "Oslo"}
    stream, deltas = replies.stream(), []
    for i in range(0, len(text), 5):
        deltas.append(stream.push(text[i : i + 5], "stop" if i + 5 >= len(text) else None))
    assert "".join(d.get("reasoning", "") for d, _ in deltas if d) == "A <tool_call> is needed."
    assert [c["function"]["name"] for d, _ in deltas if d for c in d.get("tool_calls", [])] == ["get_weather"]
    assert deltas[-1][1] == "tool_calls"


def test_include_reasoning_false_drops_it_and_no_parser_leaves_the_text_whole():
    text = "<think>private</think>public"
    message, _ = ChatReplies(None, REASONING_PARSERS["deepseek_r1"], "", include_reasoning=False).message(text, "stop")
    assert message == {"role": "assistant", "content": "public"}
    stream = ChatReplies(None, REASONING_PARSERS["deepseek_r1"], "", include_reasoning=False).stream()
    assert stream.push(text, "stop") == ({"content": "public"}, "stop")
    plain = ChatReplies(None, None, "")
    assert plain.plain and plain.message(text, "length") == ({"role": "assistant", "content": text}, "length")


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(sorted(REASONING_PARSERS)),
    prompt=st.sampled_from(["assistant\n", "assistant\n<think>\n", "<think>\n\n</think>\n\n"]),
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</th", " ", "\n", "a", "b c", "<", ">"])),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_any_split_of_any_reply_splits_as_the_whole_reply(parser, prompt, parts, cuts):
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)] or [""]
    stream = REASONING_PARSERS[parser].stream(prompt)
    out = [stream.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    reasoning, content = REASONING_PARSERS[parser].split(prompt, text)
    assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == (reasoning or "", content)


def test_parsers_whose_tags_the_vocabulary_lacks_are_named_at_startup(tokenizer):
    """The server warns, naming the flag and the tag, where the tokenizer has no token for a tag its parsers read
    (a model not trained on that syntax); a vocabulary with the tags, or a syntax without tags of its own, is quiet."""
    vocabulary = tokenizer.get_vocab()  # the tests' tokenizer: no model's tags
    warnings = parser_warnings(vocabulary, "hermes", "deepseek_r1")
    assert [re.search(r"has no token for (.+?), so", w).group(1) for w in warnings] == [
        "'<tool_call>', '</tool_call>'",
        "'<think>', '</think>'",
    ]
    assert warnings[0].startswith("--tool-call-parser hermes: the tokenizer has no token for '<tool_call>'")
    assert warnings[1].startswith("--reasoning-parser deepseek_r1: ")
    (mistral,) = parser_warnings(vocabulary, "mistral", None)
    assert "'[TOOL_CALLS]'" in mistral
    assert parser_warnings({**vocabulary, "<think>": 3}, None, "qwen3")[0].count("think>") == 1  # only what lacks
    assert parser_warnings(vocabulary, "pythonic", None) == parser_warnings(vocabulary, "llama3_json", None) == []
    tagged = {**vocabulary, "<tool_call>": 1, "</tool_call>": 2, "<think>": 3, "</think>": 4}
    assert parser_warnings(tagged, "hermes", "qwen3") == [] and parser_warnings(vocabulary, None, None) == []


def test_think_tags_marked_special_keep_special_tokens_in_the_text(tokenizer):
    """A tokenizer that marks <think> or </think> special has the reasoning split keep special tokens in the text
    (skipped, the tags would be gone before the split reads them); the tests' tokenizer has neither."""
    assert not tags_are_special(tokenizer)
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert tags_are_special(special)
    ids = special.encode("<think>hm</think>ok", add_special_tokens=False)
    assert special.decode(ids, skip_special_tokens=True) == "hmok"  # what a skipping detokenizer would leave
