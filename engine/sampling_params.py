"""SamplingParams: what a request asks of the sampler and the stop checks, validated once at the door; and
StructuredOutputsParams, the form its output must take (the grammar it must follow)."""

from __future__ import annotations

import json as json_module
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: a smaller temperature is sampled greedily
FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32: a larger value becomes inf there
# The sampler divides a seen token's positive logit by the penalty and multiplies a negative one by it, in float32.
# A factor of at most 100 either way keeps every logit a model gives finite (|logit| * 100 < FLOAT32_MAX) and covers
# every useful value (1.0 is off; HF and vLLM suggest 1.0 to 2.0). 1e-300 was accepted before: 0 in float32, so
# its division made +inf logits and NaN probabilities.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
REASONING_FIRST = (None, "required", "optional")


class StructuredOutputError(ValueError):
    """A request's structured output does not compile against the engine's tokenizer (a bad schema, regex or
    grammar): a bad request, refused before it starts, with the compiler's own words."""


@dataclass(slots=True)
class StructuredOutputsParams:
    """The form a request's output must take, as vLLM's StructuredOutputsParams: exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression (`regex`, Rust regex
    syntax, matched whole), one of a list of strings (`choice`), or a grammar (`grammar`: Lark, or GBNF as llama.cpp
    writes it). JSON may hold any whitespace between its tokens, unless `disable_any_whitespace` (then none at all,
    as json.dumps(separators=(",", ":")) writes it). Only its shape is checked here; the engine compiles it against
    its tokenizer and names what does not compile (engine/structured_outputs.py).

    `reasoning_first` lets a reasoning model think before the form begins, as vLLM's reasoning parsers do: the
    grammar holds the text after the reasoning, which runs to the first `</think>` (whitespace after it allowed);
    "required": the reply reasons first (from its start, `<think>` written or not); "optional": it may open with
    `<think>...</think>`, else the form begins at once."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    reasoning_first: str | None = None  # None, "required" or "optional"

    def __post_init__(self) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter 'structured_outputs': {why}")

        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(STRUCTURED_KINDS)
            raise bad(f"give exactly one of {names}; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json_module.loads(self.json)
                except ValueError as e:
                    raise bad(f"json is not valid JSON text: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, dict | bool):
                raise bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar must be a non-empty string")
        if self.reasoning_first not in REASONING_FIRST:
            raise bad(f"reasoning_first must be one of {', '.join(map(str, REASONING_FIRST))}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise bad("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("every choice must be a non-empty string")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


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
    structured_outputs: StructuredOutputsParams | None = None  # the grammar every sample's output follows

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
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
