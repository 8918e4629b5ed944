"""IncrementalDetokenizer: owns one sequence's output text — token ids in, text deltas out, stop strings cut.

vLLM's prefix_offset / read_offset scheme: each push decodes only a window of recent tokens,
ids[prefix_offset:], and releases what it adds to the decode of ids[prefix_offset:read_offset]. The
window starts in the last prompt tokens so that tokenizers which drop a leading space at the start of
a decode (SentencePiece) keep the first output token's space. Text ending in an incomplete UTF-8
character ("\ufffd") waits for the tokens that complete it, and while streaming the last
(longest stop string - 1) characters wait too, so no delta ever holds part of a stop string.

With a fast (Rust) tokenizer whose decode transformers passes through unchanged, the window is decoded by the
tokenizers library's own incremental decoder (`DecodeStream`, as vLLM's fast detokenizer does): the same scheme
in one Rust call per token: about 3 us a token here instead of 13.3 for two `decode` calls through transformers
(W1's 32k BPE vocabulary, AMD Zen 4). A server's engine thread does this for every streamed token between its
steps. The offsets are kept in step with it, so the flush at finish, and any tokenizer this does not fit, take
the window path above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
INCOMPLETE_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, right for multi-byte characters split over
    tokens, and finds stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # released so far; after a stop match, everything before the stop string
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched
        self._held_chars = max(map(len, self.stop), default=1) - 1
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # the window starts in the prompt
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._decoded = ""  # the output text settled by the offsets; self.text is a prefix of it
        self._backend = rust_decoder(tokenizer)
        self._stream: DecodeStream | None = None
        # its decode state mirrors the offsets: it starts on the same prompt window, unless that window ends
        # inside a character (DecodeStream then keeps no prefix and would release the window's text as output)
        if self._backend is not None and not self._decode(self._token_ids).endswith(INCOMPLETE_CHAR):
            self._stream = DecodeStream(self._token_ids, skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Appends new token ids; returns the newly released text ("" once stopped)."""
        if self.stopped:
            return ""
        searched = len(self._decoded)
        if self._stream is not None:
            self._step_stream(token_ids)
        else:
            self._token_ids.extend(token_ids)
            self._decode_window(final=False)
        return self._release(searched, final=False)

    def _step_stream(self, token_ids: Sequence[int]) -> None:
        """The window step of `_decode_window` by DecodeStream, a token at a time, the offsets moved with it."""
        for token_id in token_ids:
            self._token_ids.append(token_id)
            new_text = self._stream.step(self._backend, token_id)
            if new_text:
                self._decoded += new_text
                self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)

    def flush(self) -> str:
        """At finish: releases the held-back text, still cut before a stop string."""
        if self.stopped:
            return ""
        searched = len(self._decoded)
        self._decode_window(final=True)
        return self._release(searched, final=True)

    def _decode_window(self, final: bool) -> None:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text):
            return  # nothing new yet (a skipped special token, or bytes still short of a character)
        if window_text.endswith(INCOMPLETE_CHAR) and not final:
            return  # wait for the rest of the character
        self._decoded += window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, searched: int, final: bool) -> str:
        """Releases settled text up to a stop string, or up to the held-back tail while streaming.
        searched: how much of _decoded earlier calls already searched for stop strings."""
        end = len(self._decoded) if final else max(len(self.text), len(self._decoded) - self._held_chars)
        match = self._find_stop(max(0, searched - self._held_chars))
        if match is not None:
            end, self.stop_string = match
            self.stopped = True
        delta = self._decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(where, which) for the earliest stop string in _decoded[start:], None if none is there.
        A new match ends past the text searched before, so it starts at most (longest - 1) chars back."""
        hits = [(at, s) for s in self.stop if (at := self._decoded.find(s, start)) != -1]
        return min(hits, default=None)


def rust_decoder(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer behind `tokenizer` when its `decode` is that tokenizer's own, unchanged: a
    transformers fast tokenizer that neither overrides decoding nor cleans up spaces after it. None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return backend
