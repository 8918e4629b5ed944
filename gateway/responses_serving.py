"""ResponsesServing: `POST /v1/responses`, streamed (named SSE events) and not.

The request is read as the chat turn it asks for (gateway/responses_protocol.py) and run by OpenAIServing's chat
step, so templates, tool calls, the reasoning split, limits, usage and metrics are chat's; the reply is written as
a response (gateway/responses_format.py). Errors before the first token are 4xx naming the Responses field; after
it, an `error` event and `response.failed` end the stream.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from gateway.errors import APIError, error_body
from gateway.generation import until_disconnect
from gateway.openai_format import chat_logprobs, now
from gateway.openai_serving import (
    Caller,
    ChatRun,
    OpenAIServing,
    Primed,
    collect,
    load_headers,
    primed,
    stream_response,
)
from gateway.responses_format import (
    ResponseEvents,
    item_id,
    output_items,
    response_object,
    status_of,
    usage_json,
)
from gateway.responses_protocol import LOGPROBS_INCLUDE, ResponsesRequest, responses_error


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, body: ResponsesRequest, raw: Request, caller: Caller):
        try:
            chat = body.chat_request()
            run = await self.serving.chat_run(chat, caller, "responses", item_id("resp"))
            if body.wants_logprobs and not run.replies.plain:
                raise APIError(
                    400,
                    f"include {LOGPROBS_INCLUDE!r} is served for text replies only (no tools, no reasoning parser)",
                    param="include",
                )
            stream = await primed(run.generation) if body.stream else None
        except APIError as e:
            raise responses_error(e) from None
        created = now()
        settings = body.echoed()

        def head(status: str, output: list, incomplete=None, usage=None, error=None) -> dict[str, Any]:
            return response_object(
                run.request_id, created, run.choice.model, settings, output, status, incomplete, usage, error
            )

        if stream is not None:
            return stream_response(self._events(stream, run, head, body.wants_logprobs), run.generation)
        choice = (await until_disconnect(raw, collect(run.generation, 1))).get(0)
        text, finish_reason = (choice.text, choice.finish_reason) if choice is not None else ("", None)
        message, _ = run.replies.message(text, finish_reason)
        status, incomplete = status_of(finish_reason)
        logprobs = None
        if body.wants_logprobs and choice is not None and choice.logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs, self.serving.token_text)["content"]
        usage = usage_json(run.generation.usage, self._reasoning_tokens(run, message.get("reasoning")))
        response = head(status, output_items(message, status, logprobs), incomplete, usage)
        return JSONResponse(response, headers=load_headers(run.generation))

    def _reasoning_tokens(self, run: ChatRun, reasoning: str | None) -> int:
        """The reasoning's tokens in the usage: its text as the tokenizer reads it (the split is made on text), at
        most the completion's."""
        if not reasoning:
            return 0
        count = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False))
        return min(count, run.generation.usage.completion_tokens)

    async def _events(self, stream: Primed, run: ChatRun, head, wants_logprobs: bool):
        events = ResponseEvents(head)
        reply = run.replies.stream()
        finish_reason = None
        try:
            for event in events.start():
                yield event
            item = stream.first
            while item is not None:
                for delta in item[1].outputs:
                    fields, _ = reply.push(delta.text, delta.finish_reason)
                    logprobs = None
                    if wants_logprobs and delta.logprobs:
                        logprobs = chat_logprobs(delta.logprobs, self.serving.token_text)["content"]
                    for event in events.push(fields or {}, logprobs):
                        yield event
                    finish_reason = delta.finish_reason or finish_reason
                item = await anext(stream.rest, None)
            status, incomplete = status_of(finish_reason)
            usage = usage_json(run.generation.usage, self._reasoning_tokens(run, events.reasoning_text))
            for event in events.finish(status, incomplete, usage):
                yield event
        except APIError as e:
            self.serving.metrics.count_error(e.status_code)
            e = responses_error(e)
            for event in events.fail(error_body(e.status_code, e.message, e.param, e.code)["error"]):
                yield event
        finally:
            await stream.rest.aclose()
