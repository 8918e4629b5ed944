"""Tokenization: vLLM's `POST /tokenize` and `POST /detokenize`, with the served tokenizer and chat templates.

A client counts a prompt's tokens (or a chat's, as its template renders it for the model named) before it sends
it, or turns token ids back into text. Nothing is generated: no engine request, no usage. `model` (optional, the
base by default) is resolved as a generation's is, so an adapter that the caller may not use is the same 404, and
a chat is rendered with that adapter's own template where it has one. A prompt longer than the context is
counted, not refused: telling the caller so is the point (the request body limit bounds the work).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from gateway.adapter_service import AdapterService, ModelChoice
from gateway.chat_templates import ChatTemplates
from gateway.errors import APIError
from gateway.protocol import ChatMessage, refuse_unsupported
from gateway.request_model import RequestModel
from gateway.tool_calls import checked_tools

# field -> (the values that mean "as served", why it is refused), as for the chat endpoint
TOKENIZE_REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    "continue_final_message": ((False,), "a chat is rendered as a new message's prompt"),
}


class TokenizeRequest(RequestModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`): exactly one of the two."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    add_special_tokens: bool | None = None  # a prompt's default: True; a chat's: False (its template writes them)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered into the chat as its completion's template would
    return_token_strs: bool = False

    @property
    def checked_tools(self) -> list[dict[str, Any]] | None:
        return checked_tools(self.tools)

    def check(self) -> None:
        """A 400 naming the field: neither or both of prompt and messages, or a refused field."""
        if self.prompt is None and self.messages is None:
            raise APIError(400, "give either prompt or messages", param="prompt")
        if self.prompt is not None and self.messages is not None:
            raise APIError(400, "give either prompt or messages, not both", param="messages")
        refuse_unsupported(self, TOKENIZE_REFUSED_UNLESS)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class Tokenization:
    def __init__(self, tokenizer, adapters: AdapterService, chat_templates: ChatTemplates, max_model_len: int):
        self.tokenizer, self.adapters, self.chat_templates = tokenizer, adapters, chat_templates
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)

    async def _choose(self, model: str | None, tenant: str | None) -> ModelChoice:
        return await self.adapters.choose(model if model is not None else self.adapters.base_model, None, tenant)

    async def tokenize(self, body: TokenizeRequest, tenant: str | None) -> dict:
        body.check()
        choice = await self._choose(body.model, tenant)
        if body.messages is None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            text = await self.chat_templates.render_request(body.messages, choice.adapter_path, body)
            special = body.add_special_tokens is True

        def encode() -> tuple[list[int], list[str] | None]:
            ids = self.tokenizer.encode(text, add_special_tokens=special)
            return ids, self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

        ids, strs = await asyncio.to_thread(encode)  # megabytes of text take seconds: off the event loop
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest, tenant: str | None) -> dict:
        await self._choose(body.model, tenant)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < self.vocab_size:
                message = f"token {token} at index {i} is not in the vocabulary (ids 0 to {self.vocab_size - 1})"
                raise APIError(400, message, param="tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)}
