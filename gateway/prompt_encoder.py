"""PromptEncoder: prompt text -> token ids, off the event loop, with over-long prompts refused before the work.

Tokenizing megabytes takes seconds of CPU and holds the GIL in stretches, so it runs on a worker thread; and a
text that cannot fit is refused without tokenizing at all: no token of the vocabulary covers more than
`max_token_chars` characters, so a text of N characters has at least N / max_token_chars tokens.
"""

from __future__ import annotations

import asyncio

from gateway.errors import APIError


class PromptEncoder:
    def __init__(self, tokenizer, max_prompt_tokens: int, max_model_len: int):
        self.tokenizer, self.max_prompt_tokens, self.max_model_len = tokenizer, max_prompt_tokens, max_model_len
        self.max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1) or 1

    def _too_long(self, tokens: int, param: str, at_least: bool = False) -> APIError:
        size = f"at least {tokens}" if at_least else str(tokens)
        if self.max_prompt_tokens >= self.max_model_len:
            limit = f"this model's maximum context length is {self.max_model_len} tokens"
        else:
            limit = f"this server accepts prompts of at most {self.max_prompt_tokens} tokens (--max-prompt-tokens)"
        return APIError(
            400, f"{limit}, and the prompt is {size} tokens long", param=param, code="context_length_exceeded"
        )

    def check_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        if len(token_ids) > self.max_prompt_tokens:
            raise self._too_long(len(token_ids), param)

    async def encode(self, texts: list[str], add_special_tokens: bool = True, param: str = "prompt") -> list[list[int]]:
        """Token ids of each text; a 400 naming `param` when one is longer than the limit."""
        for text in texts:
            least = len(text) // self.max_token_chars
            if least > self.max_prompt_tokens:
                raise self._too_long(least, param, at_least=True)

        if not texts:  # token ids only: no worker thread to wake
            return []

        def encode_all() -> list[list[int]]:
            return [self.tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

        encoded = await asyncio.to_thread(encode_all)
        for ids in encoded:
            self.check_ids(ids, param)
        return encoded
