"""The models' own tool-call syntaxes, for tool_choice "auto" (`--tool-call-parser`, vLLM's names): owns reading one
choice's text, as it streams, into content and OpenAI tool calls.

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
  around them.
- `llama3_json` (Llama 3.1 / 3.2 JSON calls): a reply that begins with `{` or `<|python_tag|>` is one or more
  `{"name": ..., "parameters": {...}}` objects, `;` between them.
- `pythonic` (Llama 3.2 / 4, ToolACE): a reply that begins with `[` (or `<|python_start|>`) is a Python list of
  calls, `[get_weather(city="Paris"), ping()]`, keyword arguments of literal values.
- `mistral`: text, then `[TOOL_CALLS]` and to the end of the reply the calls, a JSON array of
  `{"name": ..., "arguments": {...}}` or (the v11 tokenizers) `name[ARGS]{...}` pieces; ids of nine letters and
  digits, as Mistral's chat templates ask of the calls sent back.

Text streams out as content as soon as it cannot be the start of a call; a call goes out whole once it is: at its
closing tag (hermes), or at the end of the reply (the others, whose calls run to the end). Calls that do not read
as calls stay text, as written.
"""

from __future__ import annotations

import ast
import json
import secrets
import string
import uuid
from typing import Any, ClassVar

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's tag before a call
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's around a pythonic list
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id in the calls sent back."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` is the JSON text of the arguments."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _named_call(value: Any, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments' JSON) of `{"name": ..., <one of arguments_keys>: {...}}`; None: not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    return value["name"], _arguments_text(arguments)


def tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may yet become the tag)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values `text` holds one after another, whitespace and `separators` between them; None: it holds
    something else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
            return None
        values.append(value)


class ToolParser:
    """One choice's stream: `push` each piece of text, and the finish reason with the last, and get the delta to send
    (content and calls, each call with its index) and the finish reason to send ("tool_calls" for a reply that
    stopped having made calls). Subclasses `read` the syntax."""

    new_id = staticmethod(new_call_id)  # the ids of the calls it reads (and of a named or required call's)
    TAGS: ClassVar[tuple[str, ...]] = ()  # the tokens a model trained on the syntax has (its vocabulary is checked)

    def __init__(self):
        self.num_calls = 0

    def read(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content, calls as (name, arguments' JSON)) that the text so far settles, given the next piece."""
        raise NotImplementedError

    def push(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(the delta for this piece of the reply, None: nothing to send yet; the finish reason to send)."""
        content, calls = self.read(text, finish_reason is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [
                {"index": self.num_calls + i, **call(name, arguments, self.new_id())}
                for i, (name, arguments) in enumerate(calls)
            ]
            self.num_calls += len(calls)
        reason = "tool_calls" if finish_reason == "stop" and self.num_calls else finish_reason
        return (delta or None), reason


class HermesToolParser(ToolParser):
    """`<tool_call>{...}</tool_call>` among text: a call goes out at its closing tag; an unclosed one, or one whose
    JSON does not read as a call, is text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    TAGS = (OPEN, CLOSE)

    def __init__(self):
        super().__init__()
        self.buffer, self.in_call = "", False

    def read(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    held = 0 if final else tag_prefix_len(self.buffer, self.OPEN)
                    content += self.buffer[: len(self.buffer) - held]
                    self.buffer = self.buffer[len(self.buffer) - held :]
                    return content, calls
                content += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(self.OPEN) :], True
                continue
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                if final:  # an unclosed call: the text as written
                    content += self.OPEN + self.buffer
                    self.buffer = ""
                return content, calls
            body, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(self.CLOSE) :], False
            values = _json_values(body, "")
            parsed = _named_call(values[0], ("arguments", "parameters")) if values and len(values) == 1 else None
            if parsed is None:
                content += self.OPEN + body + self.CLOSE
            else:
                calls.append(parsed)


class TrailingToolParser(ToolParser):
    """Syntaxes whose calls run from a marker to the end of the reply: text before the marker streams out; from it
    on the reply is held and read whole at its end (`calls`; None: it is text after all)."""

    def __init__(self):
        super().__init__()
        self.buffer, self.sent_text, self.in_calls = "", False, False

    def find_calls(self, text: str) -> tuple[int | None, int]:
        """(where the calls begin in the unsent `text`, None: not there; how many of its last characters to hold back
        as they may yet begin the calls)."""
        raise NotImplementedError

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def read(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        content = ""
        if not self.in_calls:
            at, held = self.find_calls(self.buffer)
            if at is None:
                cut = len(self.buffer) if final else len(self.buffer) - held
                content, self.buffer = self.buffer[:cut], self.buffer[cut:]
                self.sent_text |= bool(content)
                return content, []
            content, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at:], True
        if not final:
            return content, []
        calls = self.calls(self.buffer)
        if not calls:
            return content + self.buffer, []
        return content, calls


class LeadingToolParser(TrailingToolParser):
    """Calls that make the whole reply: it begins (after whitespace) with one of `STARTS`, else it is text."""

    STARTS: ClassVar[tuple[str, ...]]

    def find_calls(self, text: str) -> tuple[int | None, int]:
        if self.sent_text:
            return None, 0
        head = text.lstrip()
        if head.startswith(self.STARTS):
            return 0, 0
        if not head or any(start.startswith(head) for start in self.STARTS):
            return None, len(text)  # whitespace, or what may become a start: wait
        return None, 0


class Llama3JsonToolParser(LeadingToolParser):
    """`{"name": ..., "parameters": {...}}` objects, `;` between them, after an optional `<|python_tag|>`."""

    STARTS = ("{", PYTHON_TAG)

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.strip().removeprefix(PYTHON_TAG)
        values = _json_values(text, ";")
        parsed = [_named_call(v, ("parameters", "arguments")) for v in values or []]
        return parsed if values and all(parsed) else None


class PythonicToolParser(LeadingToolParser):
    """`[name(key=value, ...), ...]`, the values Python literals (True, None, lists, dicts...), in Llama 4's
    `<|python_start|>...<|python_end|>` or bare."""

    STARTS = ("[", PYTHON_START)

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
                calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None  # not literals, or literals JSON has no form for (sets, bytes)
        return calls


class MistralToolParser(TrailingToolParser):
    """Text, then `[TOOL_CALLS]` and the calls: a JSON array (or object) of `{"name", "arguments"}`, or
    `name[ARGS]{...}` pieces, each after its own `[TOOL_CALLS]` (v11)."""

    new_id = staticmethod(mistral_call_id)
    TAGS = (MISTRAL_CALLS,)

    def find_calls(self, text: str) -> tuple[int | None, int]:
        at = text.find(MISTRAL_CALLS)
        return (at, 0) if at >= 0 else (None, tag_prefix_len(text, MISTRAL_CALLS))

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        pieces = [p.strip() for p in text.split(MISTRAL_CALLS) if p.strip()]
        if len(pieces) == 1 and pieces[0].startswith(("[", "{")):
            values = _json_values(pieces[0], "")
            if not values:
                return None
            items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            parsed = [_named_call(v, ("arguments", "parameters")) for v in items]
            return parsed if items and all(parsed) else None
        calls = []
        for piece in pieces:  # name[ARGS]{...}
            name, marker, arguments = piece.partition(MISTRAL_ARGS)
            values = _json_values(arguments, "") if marker else None
            if not name.strip() or values is None or len(values) != 1:
                return None
            calls.append((name.strip(), _arguments_text(values[0])))
        return calls


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
