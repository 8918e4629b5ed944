"""Tool calls on chat completions: owns reading `tools` and `tool_choice`, the structured output that makes the
model call a tool, and the reply's text as OpenAI's `tool_calls`.

A named function (`{"type": "function", "function": {"name": ...}}`) holds the reply to that function's parameters
schema: the text is the call's `arguments`. `"required"` holds it to a JSON array of one or more calls,
`[{"name": ..., "parameters": {...}}]`, each of a listed function with its own schema (one call only with
`parallel_tool_calls: false`). Both are vLLM's way, so they work with any model, the template told of the tools or
not. The JSON may hold whitespace, as the model writes it: held to OpenAI's compact form, SmolLM2 picked the wrong
function for "required" where it picks the right one free. `"none"` writes text. `"auto"`, OpenAI's default once
tools are given, lets the model choose between text and a call in its own syntax: the server's --tool-call-parser
reads it (gateway/tool_parsers.py); without --enable-auto-tool-choice it is a 400 asking for one of the others, as
vLLM's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.interface import StructuredOutputsParams
from gateway.errors import APIError
from gateway.tool_parsers import TOOL_CALL_PARSERS, ToolParser, call, new_call_id

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}


def checked_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The request's tools, each {"type": "function", "function": {"name", "description"?, "parameters"}} (a missing
    schema: no parameters), as the chat template reads them; a 400 naming what is wrong."""
    if not tools:
        return None
    checked, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", param="tools")
        if name in names:
            raise APIError(400, f"tools[{i}]: two tools are named {name!r}", param="tools")
        names.add(name)
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How a reply calls tools: one named function, a required array of calls, or (auto) the model's own call syntax
    read by a parser."""

    function: str | None  # the named function
    structured: StructuredOutputsParams | None  # what holds the reply; None: auto
    parser: type[ToolParser] | None = None  # auto: the parser of the model's call syntax
    new_id: Callable[[], str] = new_call_id  # a named or required call's id, in the model's style (mistral's)

    @property
    def is_auto(self) -> bool:
        return self.parser is not None

    def reply(self, text: str, complete: bool) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool_calls) of the reply's text. A named function's call is made whatever its arguments' state
        (cut short by max_tokens, they are cut short too, as OpenAI's are); the required calls once the array is
        complete (text before); auto's, those the text holds whole (None: it holds none)."""
        if self.parser is not None:
            delta, _ = self.parser().push(text, "stop")
            calls = [{k: v for k, v in c.items() if k != "index"} for c in (delta or {}).get("tool_calls", [])]
            content = (delta or {}).get("content") or ""
            return (content if content.strip() or not calls else None), (calls or None)
        if self.function is not None:
            return None, [call(self.function, text, self.new_id())]
        if not complete:
            return text, None
        calls = json.loads(text)
        return None, [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False), self.new_id()) for c in calls]

    def stream(self) -> ToolCallStream | ToolParser:
        return self.parser() if self.parser is not None else ToolCallStream(self)


class ToolCallStream:
    """One streamed choice of a named or required reply: a named function's arguments go out as they are written
    (the call's index, id, type and name with the first piece); required calls go out whole once the array is
    complete, or as text when max_tokens cut it short."""

    def __init__(self, calling: ToolCalling):
        self.calling, self.text, self.call_id = calling, "", calling.new_id()
        self.started = False

    def push(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(the delta for this piece of the reply, None: nothing to send yet; the finish reason to send)."""
        self.text += text
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.calling.function is not None:
            if not text and finish_reason is None:
                return None, None
            piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.started:
                self.started = True
                piece.update(id=self.call_id, type="function")
                piece["function"] = {"name": self.calling.function, "arguments": text}
            return {"tool_calls": [piece]}, reason
        if finish_reason is None:
            return None, None
        content, calls = self.calling.reply(self.text, finish_reason == "stop")
        if calls is None:
            return {"content": content}, finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, reason


def tool_calling(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    auto_parser: str | None = None,
    syntax: str | None = None,
) -> ToolCalling | None:
    """What tool_choice asks of the reply given the (checked) tools and the server's parser for "auto" (None: "auto"
    is refused): None for text; a 400 naming the field when the choice is not one this server serves or names no
    listed tool. `syntax`, the server's --tool-call-parser whether "auto" is served or not, gives the calls' ids
    their style."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if choice not in ("auto", "required") and not (isinstance(choice, dict) and choice.get("type") == "function"):
        message = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        raise APIError(400, message, param="tool_choice")
    if not tools:
        if choice == "auto":  # nothing to call: text, as OpenAI answers
            return None
        raise APIError(400, "tool_choice asks for a tool call, but no tools are given", param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(
                400,
                "tool_choice 'auto' (the default once tools are given) needs the server started with "
                "--enable-auto-tool-choice and --tool-call-parser (the model's own call syntax): ask for 'required' "
                "or a named function, or 'none' for text",
                param="tool_choice",
            )
        return ToolCalling(None, None, TOOL_CALL_PARSERS[auto_parser])
    new_id = TOOL_CALL_PARSERS[syntax].new_id if syntax is not None else new_call_id
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in by_name:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolCalling(name, StructuredOutputsParams(json=by_name[name]), new_id=new_id)
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in by_name.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolCalling(None, StructuredOutputsParams(json=schema), new_id=new_id)


def template_message_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: each call's arguments as an object (the API
    sends a JSON string; templates write `arguments | tojson`), as vLLM hands them over."""
    calls = []
    for tool_call in tool_calls:
        if not isinstance(tool_call, dict) or not isinstance(tool_call.get("function"), dict):
            raise APIError(400, "an assistant message's tool_calls must be OpenAI tool calls", param="messages")
        function = dict(tool_call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                raise APIError(400, "a tool call's arguments must be a JSON object", param="messages") from None
        calls.append({**tool_call, "function": function})
    return calls
