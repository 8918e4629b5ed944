"""A chat choice's text as the assistant message's fields: owns putting the reasoning split (gateway/reasoning.py)
and the tool calls (gateway/tool_calls.py) together, whole and streamed: the reasoning is split off first, and the
calls are read from the content after it. And the check, at startup, that the model's vocabulary has the tags the
server's parsers read."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gateway.reasoning import END_THINK, THINK, ReasoningStream, ReasoningSyntax
from gateway.tool_calls import ToolCalling, ToolCallStream
from gateway.tool_parsers import TOOL_CALL_PARSERS, ToolParser


def parser_warnings(
    vocabulary: Collection[str], tool_call_parser: str | None, reasoning_parser: str | None
) -> list[str]:
    """What the server's parsers expect of the model that its tokenizer's vocabulary lacks, a line per flag: a model
    trained on a syntax has its tags as tokens, so a missing one most likely means the parser is not this model's
    (its replies are then read only where it writes the tags as plain text)."""
    expected = []
    if tool_call_parser is not None:
        expected.append((f"--tool-call-parser {tool_call_parser}", TOOL_CALL_PARSERS[tool_call_parser].TAGS))
    if reasoning_parser is not None:
        expected.append((f"--reasoning-parser {reasoning_parser}", (THINK, END_THINK)))
    warnings = []
    for flag, tags in expected:
        missing = ", ".join(repr(t) for t in tags if t not in vocabulary)
        if missing:
            warnings.append(
                f"{flag}: the tokenizer has no token for {missing}, so this model is most likely not trained on that "
                "syntax; its replies are read as that syntax only where they write the tags as text"
            )
    return warnings


def reasoning_fields(reasoning: str) -> dict[str, str]:
    return {"reasoning": reasoning, "reasoning_content": reasoning}  # vLLM's name, and the one it had before


@dataclass(frozen=True, slots=True)
class ChatReplies:
    """How one request's choices read: `calling` (None: text) and `reasoning` (None: no split), given the rendered
    `prompt`; `include_reasoning` false drops the reasoning from the reply."""

    calling: ToolCalling | None
    reasoning: ReasoningSyntax | None
    prompt: str
    include_reasoning: bool = True

    @property
    def plain(self) -> bool:
        """The text is the content, as it comes."""
        return self.calling is None and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message of a whole choice, its finish reason: "tool_calls" where it stopped having made
        calls; `ToolCalling.reply` for the calls cut short)."""
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(self.prompt, text)
            if self.include_reasoning:
                message.update(reasoning_fields(reasoning))
        content, calls = self.calling.reply(text, finish_reason == "stop") if self.calling else (text, None)
        if calls is None:  # text; none where it all was reasoning, as vLLM sends
            return {**message, "content": text if text or self.reasoning is None else None}, finish_reason
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {**message, "content": content, "tool_calls": calls}, reason

    def stream(self) -> ReplyStream:
        return ReplyStream(
            self.reasoning.stream(self.prompt) if self.reasoning is not None else None,
            self.calling.stream() if self.calling is not None else None,
            self.include_reasoning,
        )


class ReplyStream:
    """One streamed choice: `push` each piece of text (and the finish reason with the last) and get the delta to
    send (None: nothing yet) and the finish reason to send."""

    def __init__(
        self, reasoning: ReasoningStream | None, tools: ToolCallStream | ToolParser | None, include_reasoning: bool
    ):
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning

    def push(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.push(text, final=finish_reason is not None)
            if reasoning and self.include_reasoning:
                delta.update(reasoning_fields(reasoning))
        if self.tools is None:
            if text:
                delta["content"] = text
            return (delta or None), finish_reason
        calls, finish_reason = self.tools.push(text, finish_reason)
        delta.update(calls or {})
        return (delta or None), finish_reason
