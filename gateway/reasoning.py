"""Reasoning outputs (`--reasoning-parser`, vLLM's names): owns splitting one chat choice's text, as it streams, into
the model's reasoning, `<think>...</think>`, and the reply's content after it.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the reply reasons from its start, whether it writes `<think>`
  or its template wrote it into the prompt, up to `</think>`; a reply cut short before it is all reasoning.
- `qwen3` (Qwen3): the reply reasons only where it opens with `<think>` or the prompt ends with an open one (a
  template in thinking mode); else, as with `enable_thinking: false`, it is all content.

The reasoning goes out as `reasoning` and, its older name that clients still read, `reasoning_content`; a request's
`include_reasoning: false` (vLLM's) drops it. A reply held to a grammar (structured outputs, a named or required
tool call) reasons first, as vLLM's: its grammar holds the text after `</think>` (`reasoning_first`, required where
the reply reasons from its start, else optional).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_parsers import tag_prefix_len

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    reasons_from_start: bool  # deepseek_r1: reasoning until </think>, <think> or not

    def opened(self, prompt: str) -> bool:
        """Whether a reply to `prompt` (the rendered chat) reasons from its start."""
        return self.reasons_from_start or prompt.rstrip().endswith(THINK)

    def reasoning_first(self, prompt: str) -> str:
        """How a grammar that holds a reply to `prompt` leaves room for the reasoning before its form
        (StructuredOutputsParams.reasoning_first)."""
        return "required" if self.opened(prompt) else "optional"

    def stream(self, prompt: str) -> ReasoningStream:
        """The splitter of one choice of a reply to `prompt`."""
        return ReasoningStream(self.opened(prompt))

    def split(self, prompt: str, text: str) -> tuple[str | None, str]:
        """(reasoning, None: none; content) of a whole reply."""
        reasoning, content = self.stream(prompt).push(text, final=True)
        return (reasoning or None), content


REASONING_PARSERS = {"deepseek_r1": ReasoningSyntax(True), "qwen3": ReasoningSyntax(False)}


def tags_are_special(tokenizer) -> bool:
    """Whether the tokenizer marks <think> or </think> special: the text then keeps special tokens where the
    reasoning is split, as a detokenizer that skipped them would drop the tags."""
    return bool({THINK, END_THINK} & set(tokenizer.all_special_tokens))


class ReasoningStream:
    """Text pieces in, (reasoning, content) out. What may be the start of a tag is held back until the next piece
    tells."""

    def __init__(self, opened: bool):
        self.opened = opened  # the prompt (or the parser) has the reply reason from its start
        self.state = "start"  # start: the reply's opening not read yet; then reasoning, then content
        self.buffer = ""

    def push(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK):
                self.buffer, self.state = head[len(THINK) :], "reasoning"
            elif not final and (not head or THINK.startswith(head)):
                return "", ""  # whitespace, or what may become <think>: wait
            else:
                self.state = "reasoning" if self.opened else "content"
        if self.state == "content":
            content, self.buffer = self.buffer, ""
            return "", content
        at = self.buffer.find(END_THINK)
        if at >= 0:
            reasoning, content = self.buffer[:at], self.buffer[at + len(END_THINK) :]
            self.buffer, self.state = "", "content"
            return reasoning, content
        cut = len(self.buffer) if final else len(self.buffer) - tag_prefix_len(self.buffer, END_THINK)
        reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return reasoning, ""
