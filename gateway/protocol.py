"""The OpenAI-compatible request bodies (with vLLM's sampling extras) and their mapping to SamplingParams.

Fields follow OpenAI's API reference; vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, ...) and
TensorRT-LLM's `lora_request` are accepted in the body. Unknown fields are ignored, as OpenAI's servers do.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from engine.interface import SamplingParams, StructuredOutputsParams
from gateway.errors import APIError
from gateway.request_model import RequestModel
from gateway.structured_fields import structured_field, structured_outputs
from gateway.tool_calls import ToolCalling, checked_tools, template_message_tool_calls, tool_calling

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class LoRASelection(BaseModel):
    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None  # accepted for compatibility; the registry decides the path


# Fields that ask for output this server does not make: each is refused with a 400 naming it unless it is None, []
# or one of the values that ask for what is served anyway. Ignoring one would break the caller's contract.
# field -> (the values that mean "as served", why it is refused)
REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "sampling only"),
    "include_stop_str_in_output": ((False,), "the stop string is never part of the text"),
    "bad_words": ((), "no banned words"),
    "allowed_token_ids": ((), "no allowed-token lists"),
    "logits_processors": ((), "no per-request logits processors"),
    "truncate_prompt_tokens": ((), "a prompt over the limit is refused, never truncated"),
}
CHAT_REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    **REFUSED_UNLESS,
    "functions": ((), "no legacy function calls: use tools"),  # the legacy form of tools
    "function_call": (("none", "auto"), "no legacy function calls: use tool_choice"),
    "echo": ((False,), "the reply holds the new message only"),
    "continue_final_message": ((False,), "the reply is a new message"),
    "add_special_tokens": ((False,), "the chat template writes the special tokens"),
}
COMPLETION_REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    **REFUSED_UNLESS,
    "add_special_tokens": ((True,), "the tokenizer's special tokens are always added"),
}


def refuse_unsupported(body: BaseModel, refused: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 naming the first field of `refused` that the body sets to a value other than a served one (read from
    the body's extra fields: none of them is a field of the model)."""
    extra = body.model_extra or {}
    for name, (served, why) in refused.items():
        value = extra.get(name)
        if value is not None and value != [] and value not in served:
            raise APIError(400, f"{name} is not supported ({why})", param=name)


class SamplingFields(RequestModel):
    """The sampling knobs shared by completions and chat. Other fields are kept as extras, so that those asking for
    output this server does not make are refused (REFUSED_UNLESS) and the rest are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    lora_request: LoRASelection | None = None  # TensorRT-LLM's form; `model` then names the base
    stream_interval: int | None = None  # steps per streamed chunk after the first (the server's, if larger)
    response_format: dict[str, Any] | None = None  # OpenAI's structured outputs (gateway/structured_fields.py)

    def _unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    @property
    def structured_field(self) -> str | None:
        """The field that asks for a structured output (response_format, structured_outputs, guided_*), if one does."""
        return structured_field(self.response_format, self.model_extra or {})

    def structured(self) -> StructuredOutputsParams | None:
        """The structured output the body asks for; a 400 naming the field when it is malformed."""
        return structured_outputs(self.response_format, self.model_extra or {})

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises a 400 naming the parameter when a value is out of range."""
        self._unsupported()
        structured = self.structured()
        values: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        values = {k: v for k, v in values.items() if v is not None}
        if values.get("top_k") == 0:
            values["top_k"] = -1
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                **values,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                stream_interval=self.stream_interval,
                structured_outputs=structured,
            )
        except ValueError as e:
            message = str(e)
            param = message.split("'")[1] if message.startswith("invalid sampling parameter '") else None
            raise APIError(400, message, param=param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt before each choice's text (and its tokens' logprobs before the choice's)
    prompt_logprobs: int | None = None  # vLLM's: each choice's `prompt_logprobs`
    suffix: str | None = None
    best_of: int | None = None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """How many best tokens each prompt token's entry lists: what prompt_logprobs asks, or with echo what
        logprobs asks (its layout shows the prompt's tokens too); the larger where both are set."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)

    def _unsupported(self) -> None:
        super()._unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        refuse_unsupported(self, COMPLETION_REFUSED_UNLESS)
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of must equal n (beam-free sampling)", param="best_of")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    def template_input(self) -> dict[str, Any]:
        """The message as a chat template reads it: role, content as text, name, tool calls and the call a tool
        message answers where given."""
        message = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        if self.tool_calls:
            message["tool_calls"] = template_message_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"message content of type '{part.type}' is not supported", param="messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # gateway/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    _calling: ToolCalling | None = PrivateAttr(None)  # set by resolve_tool_calling
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser) from the reply
    prompt_logprobs: int | None = None  # vLLM's: the response's `prompt_logprobs`, over the rendered prompt
    add_generation_prompt: bool = True
    chat_template: str | None = None  # vLLM's per-request override
    chat_template_kwargs: dict[str, Any] | None = None

    def _unsupported(self) -> None:
        super()._unsupported()
        refuse_unsupported(self, CHAT_REFUSED_UNLESS)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """As SamplingFields', a range error of the logprobs count naming top_logprobs, the field chat sets it by;
        with tool_choice "auto", special tokens stay in the text (a model's call tags may be special tokens), as
        vLLM's parsers ask."""
        try:
            params = super().sampling_params(max_tokens, logprobs, prompt_logprobs)
        except APIError as e:
            if e.param != "logprobs":
                raise
            raise APIError(400, e.message.replace("'logprobs'", "'top_logprobs'"), param="top_logprobs") from None
        if self._calling is not None and self._calling.is_auto:
            params.skip_special_tokens = False
        return params

    @cached_property
    def checked_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them, checked once a request; a 400 naming what is malformed."""
        return checked_tools(self.tools)

    def resolve_tool_calling(self, auto_parser: str | None, syntax: str | None = None) -> None:
        """Settles how the reply calls a tool (`calling`; None: it is text), given the server's parser of the model's
        own call syntax for "auto" (None: "auto" is refused) and its --tool-call-parser (the calls' id style); a 400
        naming tools or tool_choice where they are wrong."""
        self._calling = tool_calling(
            self.checked_tools, self.tool_choice, self.parallel_tool_calls, auto_parser, syntax
        )

    @property
    def calling(self) -> ToolCalling | None:
        return self._calling

    @property
    def structured_field(self) -> str | None:
        held = self._calling is not None and self._calling.structured is not None
        return "tools" if held else super().structured_field

    def structured(self) -> StructuredOutputsParams | None:
        if self._calling is None or self._calling.structured is None:  # text, or auto: the model's own syntax
            return super().structured()
        other = super().structured_field
        if other is not None:
            raise APIError(400, f"tool_choice asks for a tool call and {other} for another form: give one", param=other)
        return self._calling.structured

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
