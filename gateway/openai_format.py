"""OpenAI wire formats shared by completions and chat: SSE framing, ids, and logprobs in both layouts."""

from __future__ import annotations

import json
import time
import uuid

from engine.interface import TokenLogprob

SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TokenText:
    """Token id -> its text, for logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(logprobs: list[TokenLogprob], token_text: TokenText, text_offset: int = 0) -> dict:
    """The legacy completions layout: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops = {token_text(t): v for t, v in (lp.top_logprobs or {}).items()}
        tops.setdefault(text, lp.logprob)
        top.append(tops)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> dict:
    """The chat layout: one entry per token with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in (lp.top_logprobs or {}).items()]
        content.append(item)
    return {"content": content}
