"""The workload of one run: each request's prompt, output length, model (adapter or base) and send time.

Popularity laws (Punica's axis): `distinct` round robin over the K adapters, `identical` all on the first,
`uniform` uniform random, `zipf:ALPHA` p(i) ∝ 1/(i+1)^ALPHA. Arrivals: a Poisson process at `request_rate`
(exponential gaps, the first request at 0), or all at once when the rate is inf. Everything is seeded.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import BenchError

POPULARITY_LAWS = ("distinct", "identical", "uniform", "zipf:ALPHA")

# short common words: about one token each (with its leading space) in the usual BPE vocabularies
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you"
    " were her all she there would their we him been has when who will more no if out so said what up its about"
    " into than them can only other new some could time these two may then do first any my now such like our"
    " over man me even most made after also did many before must through back years where much your way well"
    " down should because each just those people how too little state good very make world still own see men"
    " work long get here between both life being under never day same another know while last might us great"
    " old year off come since against go came right used take three"
)
WORDS = tuple(_WORDS.split())


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    num_prompts: int
    request_rate: float  # requests per second; inf: all at once
    popularity: str  # one of POPULARITY_LAWS
    input_len: int  # synthetic prompts: tokens with `tokenizer`, else words
    output_len: int  # max_tokens, unless the dataset line gives output_len
    dataset: Path | None = None  # JSON lines: {"prompt": str, "output_len"?: int}
    tokenizer: Path | None = None  # a Hugging Face tokenizer directory: exact synthetic prompt lengths
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    prompt_len: int  # tokens if counted with a tokenizer, else words (an estimate)
    output_len: int


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    model: str  # an adapter's name, or the base model's
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int
    output_len: int
    arrival_s: float  # when it is sent, after the run starts


def build_requests(options: WorkloadOptions, base: str, adapters: list[str], run_index: int = 0) -> list[RequestSpec]:
    """The requests of one run; `adapters` empty means every request goes to the base model.

    Prompts are seeded per run (so repeated runs do not hit each other's prefix cache); arrivals and adapter
    choices are seeded alike in every run."""
    prompts = load_prompts(options, np.random.default_rng([options.seed, run_index, 1]))
    rng = np.random.default_rng(options.seed)
    arrivals = arrival_times(options.num_prompts, options.request_rate, rng)
    choices = choose_adapters(options.popularity, options.num_prompts, len(adapters), rng)
    return [
        RequestSpec(i, adapters[c] if c >= 0 else base, p.text, p.prompt_len, p.output_len, a)
        for i, (p, a, c) in enumerate(zip(prompts, arrivals, choices))
    ]


def parse_popularity(spec: str) -> float | None:
    """The Zipf exponent for `zipf:ALPHA`, None for the other laws; BenchError for anything else."""
    if spec in ("distinct", "identical", "uniform"):
        return None
    name, _, alpha = spec.partition(":")
    try:
        value = float(alpha)
    except ValueError:
        value = math.nan
    if name != "zipf" or not value > 0 or math.isinf(value):
        raise BenchError(f"--popularity must be one of {', '.join(POPULARITY_LAWS)} with ALPHA > 0, got {spec!r}")
    return value


def choose_adapters(popularity: str, num_requests: int, num_adapters: int, rng: np.random.Generator) -> list[int]:
    """Each request's adapter as an index into the K adapters; -1 (the base model) for all when K is 0."""
    alpha = parse_popularity(popularity)
    if num_adapters == 0:
        return [-1] * num_requests
    if popularity == "distinct":
        return [i % num_adapters for i in range(num_requests)]
    if popularity == "identical":
        return [0] * num_requests
    if popularity == "uniform":
        return rng.integers(num_adapters, size=num_requests).tolist()
    weights = 1.0 / np.arange(1, num_adapters + 1) ** alpha
    return rng.choice(num_adapters, size=num_requests, p=weights / weights.sum()).tolist()


def arrival_times(num_requests: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Send times in seconds from the start: a Poisson process (the first at 0), or all 0 when the rate is inf."""
    if not request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 or inf, got {request_rate}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = rng.exponential(1.0 / request_rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def load_prompts(options: WorkloadOptions, rng: np.random.Generator) -> list[Prompt]:
    tokenizer = load_tokenizer(str(options.tokenizer)) if options.tokenizer is not None else None
    if options.dataset is not None:
        return dataset_prompts(options.dataset, options.num_prompts, options.output_len, tokenizer)
    return [synthetic_prompt(options.input_len, options.output_len, rng, tokenizer) for _ in range(options.num_prompts)]


def synthetic_prompt(input_len: int, output_len: int, rng: np.random.Generator, tokenizer=None) -> Prompt:
    """Random words: `input_len` of them, or with a tokenizer, text of exactly (re-encoding aside) that many tokens."""
    text = " ".join(rng.choice(WORDS, size=input_len).tolist())
    if tokenizer is None:
        return Prompt(text, input_len, output_len)
    text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:input_len])
    return Prompt(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len)


def dataset_prompts(path: Path, num_prompts: int, output_len: int, tokenizer=None) -> list[Prompt]:
    """The first `num_prompts` lines of a JSON-lines file, cycled if it has fewer; lengths in tokens if a tokenizer
    is given, else in words."""
    rows = []
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise BenchError(f"cannot read --dataset {path}: {e}") from e
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            text, n = row["prompt"], int(row.get("output_len", output_len))
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(f"--dataset {path} line {number}: expected {{'prompt': str, 'output_len'?: int}}") from e
        if not isinstance(text, str) or n < 1:
            raise BenchError(f"--dataset {path} line {number}: 'prompt' must be a string and 'output_len' >= 1")
        length = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else len(text.split())
        rows.append(Prompt(text, length, n))
    if not rows:
        raise BenchError(f"--dataset {path} has no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load --tokenizer {directory}: {e}") from e
