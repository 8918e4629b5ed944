"""What the engine hands back: per-request outputs, as deltas (streaming) or accumulated (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SequenceFailed(RuntimeError):
    """One request failed alone (`RequestOutput.error`): its logits or hidden states turned NaN or Inf, it sampled a
    token outside the vocabulary, or its step raised. Its blocks and adapter row are freed; other requests go on."""

    def __init__(self, request_id: str, cause: str):
        super().__init__(f"request '{request_id}' failed: {cause}")
        self.request_id, self.cause = request_id, cause

    def __reduce__(self):  # pickles (across a process boundary) with both arguments
        return type(self), (self.request_id, self.cause)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)  # time; queue_s, adapter_load_s once scheduled
    adapter_tier: str | None = None  # where its adapter was on arrival: device, host or disk (None: no adapter)
    error: Exception | None = None  # set when the request failed (its adapter could not be loaded: AdapterError;
    # the request alone broke its step: SequenceFailed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
