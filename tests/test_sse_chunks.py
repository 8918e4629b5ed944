"""The gateway's SSE chunks of plain text: TextChunks' templates give byte for byte what encoding the whole chunk
dict gives, for any text and choice index."""

from __future__ import annotations

import json

import pytest

from gateway.openai_format import TextChunks, sse

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 1_700_000_000, "model": 'sql/ünï "q"'}
TEXTS = [
    "",
    "plain",
    ' "quoted" and \\backslash\\ ',
    "line\nbreak\ttab\r",
    "\x00\x01\x1f control",
    "é 東京 😀 \ud83d",  # a lone surrogate too: ensure_ascii writes it as an escape
    "</script>",
    "\x00loraplex:text\x00",  # the template's own slot, as text
]


def completion(index: int, text: str) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
    return {**HEAD, "choices": [choice]}


def chat(index: int, text: str) -> dict:
    choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {**HEAD, "object": "chat.completion.chunk", "choices": [choice]}


@pytest.mark.parametrize("make", [completion, chat])
def test_text_chunks_are_the_whole_dict_encoded(make):
    chunks = TextChunks(make)
    for index in (0, 3, 0, 12):
        for text in TEXTS:
            got = chunks(index, text)
            assert got == sse(make(index, text))
            assert json.loads(got.removeprefix("data: ")) == make(index, text)
