"""RequestLimits: what one `/v1` request may ask for (samples, prompts, prompt tokens, chat templates), so that no
single request can stall the event loop or flood the engine. Each limit is a 400 naming its parameter and the
option that raises it. With them, the parsers the server reads its model's replies with (tool calls, reasoning)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import APIError
from gateway.settings import ServeSettings


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int
    max_sequences_per_request: int
    max_prompt_tokens: int  # resolved: the option, or the model's context length
    trust_request_chat_template: bool
    chat_template_timeout: float
    tool_call_parser: str | None = None  # the parser of the model's call syntax for tool_choice "auto" (None: refused)
    tool_call_syntax: str | None = None  # --tool-call-parser, "auto" served or not: the style of the calls' ids
    reasoning_parser: str | None = None  # the parser of the model's reasoning (None: the reply is all content)

    @classmethod
    def of(cls, settings: ServeSettings, max_model_len: int) -> RequestLimits:
        return cls(
            max_n=settings.max_n,
            max_sequences_per_request=settings.max_sequences_per_request,
            max_prompt_tokens=min(settings.max_prompt_tokens or max_model_len, max_model_len),
            trust_request_chat_template=settings.trust_request_chat_template,
            chat_template_timeout=settings.chat_template_timeout,
            tool_call_parser=settings.tool_call_parser if settings.enable_auto_tool_choice else None,
            tool_call_syntax=settings.tool_call_parser,
            reasoning_parser=settings.reasoning_parser,
        )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(400, f"n is {n}; this server allows at most {self.max_n} (--max-n)", param="n")

    def check_sequence_count(self, count: int, n: int) -> None:
        """Prompts and samples together: 1,000 prompts at n=128 would be 128,000 sequences from one request."""
        if count * n > self.max_sequences_per_request:
            raise APIError(
                400,
                f"the request holds {count} prompts with n={n}, {count * n} sequences; this server accepts at most "
                f"{self.max_sequences_per_request} per request (--max-sequences-per-request)",
                param="prompt",
            )
