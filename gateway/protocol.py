"""The OpenAI-compatible request bodies (with vLLM's sampling extras) and their mapping to SamplingParams.

Fields follow OpenAI's API reference; vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, ...) and
TensorRT-LLM's `lora_request` are accepted in the body. Unknown fields are ignored, as OpenAI's servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.interface import SamplingParams
from gateway.errors import APIError
from gateway.request_model import RequestModel

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class LoRASelection(BaseModel):
    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None  # accepted for compatibility; the registry decides the path


CONSTRAINED_DECODING_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class SamplingFields(RequestModel):
    """The sampling knobs shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

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
    # Asked for, refused: each changes what the output must be, so ignoring it would break the caller's contract.
    response_format: dict[str, Any] | None = None  # OpenAI's structured outputs; {"type": "text"} is the default
    structured_outputs: Any = None  # vLLM's constrained decoding, and its older guided_* fields
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None

    def _unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            kind = self.response_format.get("type")
            message = f"response_format of type {kind!r} is not supported (no constrained decoding)"
            raise APIError(400, message, param="response_format")
        for name in CONSTRAINED_DECODING_FIELDS:
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported (no constrained decoding)", param=name)
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is not supported (sampling only)", param="use_beam_search")
        if self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported", param="prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises a 400 naming the parameter when a value is out of range."""
        self._unsupported()
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
                skip_special_tokens=self.skip_special_tokens,
                stream_interval=self.stream_interval,
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
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> None:
        super()._unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
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
    tools: list[dict] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict] | None = None  # the legacy form of tools
    function_call: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # vLLM's per-request override
    chat_template_kwargs: dict[str, Any] | None = None

    def _unsupported(self) -> None:
        super()._unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.functions:
            raise APIError(400, "functions are not supported", param="functions")
        for name in ("tool_choice", "function_call"):  # "none" (or "auto", with nothing to call) asks for text
            if getattr(self, name) not in (None, "none", "auto"):
                raise APIError(400, f"{name} {getattr(self, name)!r} is not supported (no tool calls)", param=name)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
