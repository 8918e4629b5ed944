"""The Responses API's wire format: a chat reply's message as a response's output items, the response object, and a
stream's events.

Output items, in the order the model wrote them: a `reasoning` item (the reasoning parser's split, as
`reasoning_text` content), a `message` with one `output_text` part, and a `function_call` per tool call. A stream
is the events OpenAI sends: `response.created` and `response.in_progress`; per item `response.output_item.added`,
its part's `response.content_part.added`, the `...delta` events, their `...done`, `response.output_item.done`; then
`response.completed` (or `response.incomplete` where max_output_tokens cut it short) with the whole response.
Each event is a named SSE event (`event:` and `data:`) with a `sequence_number`; no `[DONE]` follows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from gateway.generation import Usage

_JSON = json.JSONEncoder(separators=(",", ":"))


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(the response's status, its incomplete_details) for the choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def text_part(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [text_part(text, logprobs)],
    }


def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function.get("arguments", ""),
        "status": status,
    }


def output_items(message: dict[str, Any], status: str, logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
    """A chat reply's assistant message (gateway/chat_replies.py) as output items: its reasoning, its content, its
    calls, each that it has; a message (empty where it holds nothing else) always where it makes no call."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"], status))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        items.append(message_item(content or "", status, logprobs))
    items.extend(call_item(c, "completed") for c in calls)
    return items


def response_object(
    response_id: str,
    created_at: int,
    model: str,
    settings: dict[str, Any],
    output: list[dict[str, Any]],
    status: str,
    incomplete_details: dict[str, str] | None = None,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "error": error,
        "incomplete_details": incomplete_details,
        "output": output,
        "usage": usage,
        **settings,
    }


class ResponseEvents:
    """One streamed response's events, from the chat reply's deltas as ReplyStream makes them ({"reasoning",
    "content", "tool_calls"}, each where present): an item opens when its kind first appears and closes when another
    opens or the response ends; a tool call's later pieces (a named function's arguments as written) add to the
    call opened by its first. `head(status, output, ...)` makes the response object the lifecycle events carry."""

    def __init__(self, head: Callable[..., dict[str, Any]]):
        self.head = head
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the closed items, and the open one last while it is open
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # a delta's tool call index -> its item
        self.held_logprobs: list[dict] = []  # of tokens whose text is held back (a stop string's start)

    @property
    def reasoning_text(self) -> str:
        return "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_JSON.encode(data)}\n\n"

    def start(self) -> list[str]:
        response = self.head("in_progress", [])
        return [self.event(kind, response=response) for kind in ("response.created", "response.in_progress")]

    def push(self, delta: dict[str, Any], logprobs: list[dict] | None = None) -> list[str]:
        events = []
        self.held_logprobs.extend(logprobs or [])
        if delta.get("reasoning"):
            events += self._text_delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            logprobs, self.held_logprobs = self.held_logprobs, []
            events += self._text_delta("message", delta["content"], logprobs)
        for piece in delta.get("tool_calls") or []:
            events += self._call_delta(piece)
        return events

    def finish(self, status: str, incomplete_details: dict[str, str] | None, usage: dict[str, Any]) -> list[str]:
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):  # nothing but reasoning
            events += self._open(message_item("", "in_progress")) + self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        response = self.head(status, self.output, incomplete_details, usage)
        return [*events, self.event(kind, response=response)]

    def fail(self, error: dict[str, Any]) -> list[str]:
        """An error after the stream started: OpenAI's `error` event, then `response.failed`."""
        events = self._close("incomplete")
        events.append(self.event("error", code=error.get("code"), message=error["message"], param=error.get("param")))
        failed = self.head("failed", self.output, error={"code": error.get("code"), "message": error["message"]})
        return [*events, self.event("response.failed", response=failed)]

    # ---- items -------------------------------------------------------------------------------------
    def _index(self) -> int:
        return len(self.output) - 1

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self.open = item
        shown = {**item, "content": []} if "content" in item else item
        events = [self.event("response.output_item.added", output_index=self._index(), item=shown)]
        if "content" in item:
            part = item["content"][0]
            events.append(self._part_event("response.content_part.added", {**part, "text": ""}))
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> str:
        return self.event(kind, item_id=self.open["id"], output_index=self._index(), content_index=0, part=part)

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status if item["type"] != "function_call" else "completed"
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            else:
                done = {"content_index": 0, "text": part["text"], "logprobs": part["logprobs"]}
                events.append(self.event("response.output_text.done", **where, **done))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _text_delta(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            events += self._open(item)
        part = self.open["content"][0]
        part["text"] += text
        where = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", **where, delta=text)]
        part["logprobs"].extend(logprobs or [])
        return [*events, self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs or [])]

    def _call_delta(self, piece: dict[str, Any]) -> list[str]:
        events = []
        arguments = piece.get("function", {}).get("arguments") or ""
        item = self.calls.get(piece.get("index", 0))
        if item is None or "id" in piece:  # a new call: its first piece has its id and name
            events += self._close("completed")
            item = call_item({**piece, "function": {**piece["function"], "arguments": ""}}, "in_progress")
            self.calls[piece.get("index", 0)] = item
            events += self._open(item)
        item["arguments"] += arguments
        if arguments:
            where = {"item_id": item["id"], "output_index": self.output.index(item)}
            events.append(self.event("response.function_call_arguments.delta", **where, delta=arguments))
        return events
