"""OpenAI wire formats shared by completions and chat: SSE framing, ids, and logprobs in both layouts."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable

from engine.interface import TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
_JSON = json.JSONEncoder(separators=(",", ":"))  # one for every chunk: json.dumps with options builds one a call
_TEXT_SLOT = "\x00loraplex:text\x00"  # stands for a chunk's text in TextChunks' templates
_ENCODED_TEXT_SLOT = _JSON.encode(_TEXT_SLOT)


def sse(data: dict) -> str:
    return f"data: {_JSON.encode(data)}\n\n"


class TextChunks:
    """A stream's SSE chunks that carry only text (no logprobs, finish reason or usage), from one template per
    choice index: `make(index, text)`, the chunk's dict, is encoded once with a slot for the text and split around
    it, so each chunk JSON-encodes only its text, not the whole dict (json.dumps took 13% of the event loop's time
    at 64 streams). Byte for byte `sse(make(index, text))`."""

    def __init__(self, make: Callable[[int, str], dict]):
        self._make = make
        self._templates: dict[int, tuple[str, str]] = {}  # index -> (before the text, after it)

    def __call__(self, index: int, text: str) -> str:
        template = self._templates.get(index)
        if template is None:
            before, after = sse(self._make(index, _TEXT_SLOT)).split(_ENCODED_TEXT_SLOT)
            template = self._templates[index] = (before, after)
        return template[0] + _JSON.encode(text) + template[1]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte in a token's piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenText:
    """Token id -> its text and its bytes, for logprobs (cached: the same ids recur). A token that is only part of
    a UTF-8 character (byte-level vocabularies have many) is written as OpenAI does, `bytes:\\xe2\\x80`, so that
    two such tokens never show as the same text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes, str]] = {}  # id -> (shown text, bytes, decoded text)

    def __call__(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def decoded(self, token_id: int) -> str:
        return self._entry(token_id)[2]

    def lookup(self, token_id: int) -> tuple[str, bytes]:
        return self._entry(token_id)[:2]

    def _entry(self, token_id: int) -> tuple[str, bytes, str]:
        entry = self._cache.get(token_id)
        if entry is None:
            decoded = self.tokenizer.decode([token_id])
            raw = self._raw_bytes(token_id, decoded)
            text = decoded
            if "\ufffd" in decoded and raw.decode("utf-8", errors="replace") != raw.decode("utf-8", errors="ignore"):
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, raw, decoded)
        return entry

    def _raw_bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if match := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            if piece and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()


def completion_logprobs(logprobs: list[TokenLogprob], token_text: TokenText, text_offset: int = 0) -> dict:
    """The legacy completions layout: parallel lists tokens / token_logprobs / top_logprobs / text_offset. An entry
    whose logprob is None (an echoed prompt's first token) has None in token_logprobs and top_logprobs."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        decoded = token_text.decoded(lp.token_id)
        token_logprobs.append(lp.logprob)
        tops = None
        if lp.logprob is not None:
            tops = {token_text(t): v for t, v in (lp.top_logprobs or {}).items()}
            tops.setdefault(text, lp.logprob)
        top.append(tops)
        offsets.append(text_offset)
        text_offset += len(decoded)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(prompt_logprobs: list[TokenLogprob | None], token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the token itself and the best ones (ranked 1, 2, ... best first)."""
    layout: list[dict | None] = []
    for lp in prompt_logprobs:
        if lp is None:
            layout.append(None)
            continue
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": token_text.decoded(t)}
            for rank, (t, v) in enumerate((lp.top_logprobs or {}).items(), start=1)
        }
        entry.setdefault(
            str(lp.token_id), {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text.decoded(lp.token_id)}
        )
        layout.append(entry)
    return layout


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> dict:
    """The chat layout: one entry per token with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text, raw = token_text.lookup(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in (lp.top_logprobs or {}).items()]
        content.append(item)
    return {"content": content}
