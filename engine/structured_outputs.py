"""Structured outputs: owns compiling a request's StructuredOutputsParams into a grammar with llguidance, against the
engine's tokenizer, and each sequence's GrammarMatcher, which names the tokens its next step may take and follows
the tokens it takes.

A step with constrained rows builds a TokenMask (`allowed_tokens`, llguidance's bit words: ~10 us a row, more on the
first visit of a grammar state). Greedy rows hand it to the screened head, whose kernels never take a refused token
as a candidate; other rows hand it to the sampler, which sets the refused tokens' logits to -inf (`TokenMask.apply`)
before anything else, so random rows too pick among what the grammar allows, and the logprobs reported are those of
the masked logits (as vLLM reports them). A sequence ends ("stop") once its grammar is complete and admits no further
token. llguidance's index of the vocabulary (each token's bytes) is built once, on first use: 0.3-0.6 s for a 49K
vocabulary on a 2-core Xeon.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from engine.sampling_params import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)

BITS = 32  # tokens per word of llguidance's bitmask (int32)
ANY_JSON_OBJECT = '{"type": "object"}'


# The reasoning before a form (StructuredOutputsParams.reasoning_first): any text up to and with the first </think>,
# then any whitespace; a regex of llguidance's Lark, whose `&` and `~` intersect and negate.
REASONING_LEXEME = r"/(?s:.*)<\/think>[ \t\r\n]*/ & ~/(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)/"
REASONING_START = {"required": "start: REASONING @form", "optional": 'start: ("<think>" REASONING)? @form'}


def grammar_text(params: StructuredOutputsParams) -> str:
    """params as an llguidance grammar (unchecked); raises ValueError where llguidance cannot read it at all."""
    form = form_grammar(params)
    if params.reasoning_first is None:
        return form
    # llguidance's top-level grammar: a list of grammars, the first the start, which may name the others (@name)
    grammars = json.loads(form)["grammars"] if form.lstrip().startswith("{") else [{"lark_grammar": form}]
    grammars[0]["name"] = "form"
    start = f"{REASONING_START[params.reasoning_first]}\nREASONING: {REASONING_LEXEME}"
    return json.dumps({"grammars": [{"lark_grammar": start}, *grammars]})


def form_grammar(params: StructuredOutputsParams) -> str:
    """The grammar of params' form alone: llguidance's JSON top-level grammar, or Lark text."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = ANY_JSON_OBJECT if kind == "json_object" else params.json
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        compact = {"whitespace_flexible": False} if params.disable_any_whitespace else None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF (converted to Lark)


class GrammarCompiler:
    """Compiles and checks requests' grammars (any thread), and makes their sequences' matchers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._checked = functools.lru_cache(maxsize=256)(self._check)  # grammar text -> its error ("" when none)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                started = time.perf_counter()
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                    )
                except ValueError as e:
                    raise StructuredOutputError(f"structured outputs need a fast tokenizer: {e}") from None
                logger.info(
                    "structured outputs: llguidance indexed the %d-token vocabulary in %.2f s",
                    self.vocab_size,
                    time.perf_counter() - started,
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """params' grammar, checked against the tokenizer; raises StructuredOutputError naming what does not compile
        (a schema keyword, the regex's position, the grammar's line)."""
        what = {"json": "JSON schema", "json_object": "JSON object", "choice": "choice", "grammar": "grammar"}
        name = what.get(params.kind, params.kind)
        try:
            grammar = grammar_text(params)
            error = self._checked(grammar)
        except StructuredOutputError:
            raise
        except Exception as e:  # llguidance's own exceptions (ValueError, RuntimeError): the request's input
            raise StructuredOutputError(f"invalid {name} for structured outputs: {e}") from None
        if error:
            raise StructuredOutputError(f"invalid {name} for structured outputs: {error.strip()}")
        return grammar

    def _check(self, grammar: str) -> str:
        return llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A matcher at the start of a grammar `compile` returned."""
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0))  # errors: get_error


class GrammarMatcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens the next step may take into bitmask[row] ([W] int32 on the host, bit t % 32 of word
        t // 32 set where token t is allowed)."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token; raises ValueError when the grammar refuses it."""
        if not self._matcher.consume_token(token_id):
            error = self._matcher.get_error().split("\n")[0] or "the token is not allowed here"  # then a state dump
            raise ValueError(f"token id {token_id} breaks the structured output's grammar: {error}")

    def copy(self) -> GrammarMatcher:
        """A matcher at this one's place (a fork's: 3 us, where a new one takes ~1 ms for a 30-property schema)."""
        return GrammarMatcher(self._matcher.deep_copy())

    @property
    def is_done(self) -> bool:
        """The grammar is complete and admits no further token: the sequence ends here."""
        return self._matcher.is_stopped()


@dataclass(slots=True)
class TokenMask:
    """What the grammars (and bans) of a step's constrained rows refuse: rows [C] (indices into the step's sampling
    rows, in order) and words [C, W] int32 on the host, llguidance's layout (bit t % 32 of word t // 32 set where
    the row may take token t), which the screened head's kernel reads as they are; `refused` unpacks them."""

    rows: list[int]
    words: torch.Tensor
    vocab_size: int
    device: torch.device
    _refused: torch.Tensor | None = None

    @property
    def refused(self) -> torch.Tensor:
        """[C, V] bool on the device: True where the row may not take the token."""
        if self._refused is None:
            # little-endian: token t is bit t % 8 of byte t // 8; unpacking bytes moves a quarter of what words do
            bytes_ = self.words.view(torch.uint8).unsqueeze(-1)  # [C, 4W, 1]
            refused = (bytes_ & BIT_VALUES) == 0  # [C, 4W, 8]
            self._refused = refused.view(len(self.rows), -1)[:, : self.vocab_size].to(self.device)
        return self._refused

    def refuses_everything(self) -> bool:
        """Whether some row allows no token at all."""
        tail = self.vocab_size % BITS
        last = self.words[:, -1] & ((1 << tail) - 1) if tail else self.words[:, -1]
        return bool(((self.words[:, :-1] == 0).all(dim=1) & (last == 0)).any())

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with -inf where a row's grammar refuses the token (a new tensor; logits are left as they
        are)."""
        if len(self.rows) == logits.shape[0]:
            return logits.masked_fill(self.refused, -math.inf)
        masked = logits.clone()  # [B, V]
        masked[self.rows] = masked[self.rows].masked_fill_(self.refused, -math.inf)
        return masked


BIT_VALUES = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)  # [8]: bit b of a byte


def allowed_tokens(
    matchers: list[GrammarMatcher | None],
    vocab_size: int,
    device: torch.device,
    bans: list[set[int]] | None = None,
) -> TokenMask | None:
    """The TokenMask of the rows that have a matcher, or tokens banned (bans[i]: row i's, e.g. min_tokens' stop
    tokens, refused too); None when no row has either."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None or (bans is not None and bans[i])]
    if not rows:
        return None
    words = torch.full((len(rows), (vocab_size + BITS - 1) // BITS), -1, dtype=torch.int32)  # [C, W]: all allowed
    for j, i in enumerate(rows):
        if matchers[i] is not None:
            matchers[i].fill(words, j)
        for t in bans[i] if bans is not None else ():
            if 0 <= t < vocab_size:
                words[j, t // BITS] = int(words[j, t // BITS]) & ~(1 << (t % BITS))  # two's complement: stays int32
    return TokenMask(rows, words, vocab_size, device)
