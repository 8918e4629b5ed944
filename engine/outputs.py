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
    top_logprobs: dict[int, float] | None = None  # the best tokens' logprobs, best first
    rank: int | None = None  # the token's place in its logits (1: the best); set for prompt logprobs


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

    def extended(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by a later one of the same sample, as one delta."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return CompletionOutput(
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            logprobs,
            later.finish_reason,
            later.stop_reason,
        )


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
    # params.prompt_logprobs: each prompt token's logprob given those before it (None for the first), in the delta
    # of the request's first token (and in every accumulated output from then on)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def extended(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta: each sample's text, tokens and
        logprobs joined in order, the request's state (finished, cached tokens, error) the later one's."""
        outputs = {o.index: o for o in self.outputs}
        for o in later.outputs:
            outputs[o.index] = outputs[o.index].extended(o) if o.index in outputs else o
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=sorted(outputs.values(), key=lambda o: o.index),
            finished=later.finished,
            num_cached_tokens=later.num_cached_tokens,
            metrics={**self.metrics, **later.metrics},
            adapter_tier=self.adapter_tier or later.adapter_tier,
            error=later.error,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
