"""Chat templates: which one a request uses, and rendering messages into the prompt text.

Order: the request's own `chat_template` (vLLM's extra), then the adapter directory's (`chat_template.jinja`
or `tokenizer_config.json`'s `chat_template`), then `--chat-template`, then the base tokenizer's.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.errors import APIError
from gateway.time_budget import BudgetExceeded, run_with_budget

if TYPE_CHECKING:
    from gateway.protocol import ChatMessage


def read_template(value: str) -> str:
    """`--chat-template` is a file path or the template itself."""
    path = Path(value).expanduser()
    return path.read_text() if len(value) < 4096 and path.is_file() else value


@lru_cache(maxsize=1024)
def adapter_template(adapter_path: str) -> str | None:
    """An adapter directory's own template, if it ships one (a changed file is picked up by a re-register,
    which gives a new path or a new version)."""
    directory = Path(adapter_path)
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = directory / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template or None
    return None


class ChatFields(Protocol):
    """What a request body says about its chat's rendering (chat completions, /tokenize)."""

    chat_template: str | None
    add_generation_prompt: bool
    chat_template_kwargs: dict[str, Any] | None
    checked_tools: list[dict[str, Any]] | None  # the tools the template is told of (gateway/tool_calls.py)


class ChatTemplates:
    """Renders off the event loop within `timeout_s`; a request's own template only with `trust_request_template`
    (vLLM's `--trust-request-chat-template`): a template is code, and the server's owner decides who may send it."""

    def __init__(
        self, tokenizer, server_template: str | None, trust_request_template: bool = False, timeout_s: float = 5.0
    ):
        self.tokenizer = tokenizer
        self.server_template = read_template(server_template) if server_template else None
        self.trust_request_template, self.timeout_s = trust_request_template, timeout_s

    def choose(self, adapter_path: str | None, request_template: str | None) -> str:
        if request_template and not self.trust_request_template:
            raise APIError(
                400,
                "a per-request chat_template is not accepted by this server (start it with "
                "--trust-request-chat-template to allow it)",
                param="chat_template",
            )
        template = (
            request_template
            or (adapter_template(adapter_path) if adapter_path else None)
            or self.server_template
            or getattr(self.tokenizer, "chat_template", None)
        )
        if not template:
            raise APIError(
                400,
                "this model has no chat template: start the server with --chat-template, or use /v1/completions",
                param="messages",
            )
        return template

    async def render_request(self, messages: list[ChatMessage], adapter_path: str | None, request: ChatFields) -> str:
        """`messages` rendered as `request` asks (its chat_template, add_generation_prompt, chat_template_kwargs,
        tools)."""
        return await self.render(
            [m.template_input() for m in messages],
            adapter_path,
            request.chat_template,
            request.add_generation_prompt,
            request.chat_template_kwargs,
            request.checked_tools,
        )

    async def render(
        self,
        messages: list[dict[str, Any]],
        adapter_path: str | None,
        request_template: str | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        template = self.choose(adapter_path, request_template)

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(extra or {}),
            )

        try:
            return await run_with_budget(render, self.timeout_s, name="chat-template")
        except BudgetExceeded:
            raise APIError(
                400, f"the chat template took longer than {self.timeout_s:g} s to render", param="messages"
            ) from None
        except Exception as e:  # a template error is the request's (or the template's) problem, named
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
