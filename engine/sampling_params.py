"""SamplingParams: what a request asks of the sampler and the stop checks, validated once at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: a smaller temperature is sampled greedily
FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32: a larger value becomes inf there
# The sampler divides a seen token's positive logit by the penalty and multiplies a negative one by it, in float32.
# A factor of at most 100 either way keeps every logit a model gives finite (|logit| * 100 < FLOAT32_MAX) and covers
# every useful value (1.0 is off; HF and vLLM suggest 1.0 to 2.0). 1e-300 was accepted before: 0 in float32, so
# its division made +inf logits and NaN probabilities.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length; 0: the prompt alone (its logprobs, its cache)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: the sampled token's own only)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token after the first (0: the token's own only)
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no stop strings), as vLLM's flag
    stream_interval: int | None = None  # steps per streamed delta after the first, at least the engine's (vLLM's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter '{param}': {why}")

        for name in FLOAT_FIELDS:  # NaN passes every range check below (each comparison is False): refuse it first
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise bad(name, f"must be a finite number, got {value}")
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", f"must be non-negative, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise bad("stream_interval", f"must be at least 1, got {self.stream_interval}")
        if self.stop and not self.detokenize:
            raise bad("stop", "stop strings need detokenize=True")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
