"""OpenAI's Responses API request (`POST /v1/responses`) read as the chat completion it asks for.

A response is one chat turn in another layout: `instructions` is a system message, `input` a string (one user
message) or a list of items (messages, the assistant's earlier `function_call`s, the tools' `function_call_output`s;
earlier `reasoning` items are dropped, as chat templates drop earlier reasoning), `tools` are function tools in
their flat form, `text.format` is the structured output, `max_output_tokens` the completion's limit. Everything
then runs as chat does (template, tool calls, reasoning split, limits, accounting); gateway/responses_format.py
writes the reply as a response. This server stores no responses: `previous_response_id` and `background` are
refused with a 400 that says to send the conversation in `input` (vLLM stores them only where told to, in one
process's memory). vLLM's sampling extras (top_k, min_p, repetition_penalty, ...) are read as in chat.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest
from gateway.request_model import RequestModel

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# asked by clients that keep no state (the Agents SDK with store=False) to round-trip the reasoning: this server's
# reasoning items carry their text in the clear, and earlier reasoning is dropped from the prompt, so there is
# nothing to encrypt; accepted, and the items' encrypted_content stays null
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
SERVED_INCLUDES = (LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE)
# chat's field -> the Responses field it comes from, for errors raised while the request runs as chat
CHAT_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",  # the engine's check of the context length
    "response_format": "text.format",
    "top_logprobs": "top_logprobs",
}
_CHAT_FIELD = re.compile(r"\b(" + "|".join(f for f in CHAT_FIELDS if f != "top_logprobs") + r")\b")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("system", "developer", "user", "assistant")


def responses_error(error: APIError) -> APIError:
    """A chat error as the Responses request's: its param and the field names in its message are the Responses
    body's."""
    param = CHAT_FIELDS.get(error.param, error.param) if error.param is not None else None
    message = _CHAT_FIELD.sub(lambda m: CHAT_FIELDS[m.group(1)], error.message)
    return APIError(error.status_code, message, param=param, code=error.code, headers=error.headers)


class ResponsesRequest(RequestModel):
    """The body of `POST /v1/responses`: OpenAI's fields (those this server reads, the rest ignored) and vLLM's
    sampling extras, kept as extra fields and handed to chat."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, echoed; the model reasons as it does
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def _refuse_unserved(self) -> None:
        if self.previous_response_id is not None:
            message = "previous_response_id is not supported: this server stores no responses; send the turns in input"
            raise APIError(400, message, param="previous_response_id")
        if self.background:
            raise APIError(400, "background is not supported: this server stores no responses", param="background")
        if self.truncation == "auto":
            message = "truncation 'auto' is not supported (a prompt over the limit is refused)"
            raise APIError(400, message, param="truncation")
        unknown = sorted(set(self.include or []) - set(SERVED_INCLUDES))
        if unknown:
            message = f"include {unknown[0]!r} is not supported (only {' and '.join(map(repr, SERVED_INCLUDES))} are)"
            raise APIError(400, message, param="include")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response is; a 400 naming the Responses field that is wrong."""
        self._refuse_unserved()
        passed = {k: v for k, v in (self.model_extra or {}).items() if k not in ("messages", "n", "response_format")}
        body: dict[str, Any] = {
            **passed,
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "user": self.user,
        }
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            param = CHAT_FIELDS.get(param.split(".")[0], param)
            raise APIError(400, f"invalid value for '{param}': {first.get('msg', 'invalid')}", param=param) from None

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages; a 400 naming the item that is wrong. Consecutive function
        calls are one assistant message's tool_calls, as chat writes them."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise APIError(400, "input is empty", param="input")
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = {
                    "id": _text(item, "call_id", where),
                    "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                content = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
                messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": content})
            elif kind == "reasoning":
                continue  # earlier reasoning: not shown to the model again
            else:
                served = "message, function_call, function_call_output, reasoning"
                raise APIError(400, f"{where}: items of type {kind!r} are not supported ({served} are)", param="input")
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Function tools in chat's form; a 400 naming a hosted tool (web search, file search, MCP, ...)."""
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                message = f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function tools are)"
                raise APIError(400, message, param="tools")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                message = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
                raise APIError(400, message, param="tool_choice")
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format: {"type": "json_schema", "name", "schema", "strict"} flat, where
        chat nests the schema under json_schema."""
        form = (self.text or {}).get("format")
        if form is None:
            return None
        if not isinstance(form, dict):
            raise APIError(400, "text.format must be an object", param="text.format")
        if form.get("type") != "json_schema":
            return form
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response shows them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_logprobs": self.top_logprobs,
            "tools": self.tools or [],
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": self.text or {"format": {"type": "text"}},
            "reasoning": self.reasoning,
            "truncation": self.truncation or "disabled",
            "metadata": self.metadata or {},
            "user": self.user,
            "store": False,  # nothing is kept: the caller sends the conversation each turn
            "background": False,
            "previous_response_id": None,
        }


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return value


def _parts_text(parts: Any, where: str) -> str:
    """The text of a content list (input_text / output_text parts); a 400 naming a part of another kind (images,
    files: this server reads text)."""
    if not isinstance(parts, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}]: content of type {kind!r} is not supported (text is)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}", param="input")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _parts_text(content, f"{where}.content")}
