"""OpenAIServing: `/v1/completions` and `/v1/chat/completions`, streaming (SSE) and not (and the chat turn that
`/v1/responses` runs: gateway/responses_serving.py).

Each call: choose the model (base or adapter, visible to the tenant) → tokenize (chat: render the template)
→ build one EngineRequest per prompt → run a `Generation` → format OpenAI's response or chunks. Errors that
happen before the first token are proper 4xx responses: a stream is primed with its first delta before the
response starts.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from engine.interface import (
    AsyncEngine,
    CompletionOutput,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from gateway.accounting import Ticket
from gateway.adapter_service import AdapterService, ModelChoice
from gateway.chat_replies import ChatReplies
from gateway.chat_templates import ChatTemplates
from gateway.errors import APIError, error_body
from gateway.generation import INVALID_STRUCTURED_OUTPUT, Generation, UsageCallback, until_disconnect
from gateway.metrics import GatewayMetrics
from gateway.openai_format import (
    SSE_DONE,
    TextChunks,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    sse,
    vllm_prompt_logprobs,
)
from gateway.prompt_encoder import PromptEncoder
from gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.reasoning import REASONING_PARSERS, tags_are_special
from gateway.request_limits import RequestLimits

ADAPTER_LOAD_HEADER = "x-loraplex-adapter-load-ms"
ADAPTER_TIER_HEADER = "x-loraplex-adapter-tier"


@dataclass(slots=True)
class Caller:
    """Who is asking (None when auth is off) and the admission ticket that accounts for the request."""

    tenant: str | None = None
    ticket: Ticket | None = None

    @property
    def tenant_weight(self) -> float:
        return self.ticket.weight if self.ticket is not None else 1.0

    def on_done(self, choice: ModelChoice) -> UsageCallback | None:
        if self.ticket is None:
            return None
        ticket = self.ticket
        return lambda usage, completed: ticket.done(choice.adapter_name, usage)


def load_headers(generation: Generation) -> dict[str, str]:
    """How long the adapter's load held the request back (0 for the base model or a resident adapter), and the
    tier the adapter came from; known once the first delta arrived."""
    latency = generation.latency
    headers = {ADAPTER_LOAD_HEADER: str(round(latency.adapter_load_s * 1000))}
    if latency.adapter_tier is not None:
        headers[ADAPTER_TIER_HEADER] = latency.adapter_tier
    return headers


@dataclass(slots=True)
class _Choice:
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list | None = None  # its prompt's (params.prompt_logprobs), shared by the prompt's n choices


@dataclass(slots=True)
class Primed:
    """A started stream: its first delta (None if it ended without one) and the rest. The chunk loops read the two
    in turn (`await anext(rest, None)`) rather than through a generator that joins them: every layer of generators
    costs the event loop time per streamed token."""

    first: tuple[int, RequestOutput] | None
    rest: AsyncGenerator[tuple[int, RequestOutput], None]


@dataclass(slots=True)
class ChatRun:
    """A chat turn ready to run: its id, model, started-to-be generation and how its choices read."""

    request_id: str
    choice: ModelChoice
    generation: Generation
    replies: ChatReplies


@dataclass(slots=True)
class Echo:
    """What a completion choice shows of its prompt (`OpenAIServing._prompt_part`)."""

    text: str = ""  # the prompt's text, with echo
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens' entries, with echo and logprobs
    extra: dict = field(default_factory=dict)  # vLLM's prompt_logprobs, where asked


def _text_only(delta: CompletionOutput) -> bool:
    """A delta whose chunk holds its text alone (no logprobs, no finish reason): TextChunks writes it."""
    return delta.logprobs is None and delta.finish_reason is None


def _is_empty(delta: CompletionOutput) -> bool:
    """A delta with nothing to send (text held back, say for a stop string): no chunk is streamed for it."""
    return not delta.text and delta.finish_reason is None and not delta.logprobs


async def primed(generation: Generation) -> Primed:
    """Starts the generation and waits for its first delta, so that an early failure is a plain 4xx."""
    stream = generation.stream()
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise
    return Primed(first, stream)


def _collect(choices: dict[int, _Choice], index: int, delta) -> None:
    choice = choices.setdefault(index, _Choice(token_ids=[]))
    choice.text += delta.text
    choice.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + delta.logprobs
    if delta.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason


async def collect(generation: Generation, n: int) -> dict[int, _Choice]:
    """Runs the generation to its end: each choice's text, tokens, logprobs and finish, by index (prompt i's
    sample j at i * n + j)."""
    choices: dict[int, _Choice] = {}
    async for i, out in generation.stream():
        for delta in out.outputs:
            _collect(choices, i * n + delta.index, delta)
        if out.prompt_logprobs is not None:
            for index in range(i * n, (i + 1) * n):
                choices.setdefault(index, _Choice(token_ids=[])).prompt_logprobs = out.prompt_logprobs
    return choices


def stream_response(chunks: AsyncIterator[str], generation: Generation) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", **load_headers(generation)}  # known: the stream was primed
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        adapters: AdapterService,
        chat_templates: ChatTemplates,
        metrics: GatewayMetrics,
        limits: RequestLimits,
    ):
        self.engine, self.adapters, self.chat_templates, self.metrics = engine, adapters, chat_templates, metrics
        self.limits = limits
        self.tokenizer = engine.tokenizer
        self.prompts = PromptEncoder(self.tokenizer, limits.max_prompt_tokens, engine.max_model_len)
        self.token_text = TokenText(self.tokenizer)
        self.think_tags_special = tags_are_special(self.tokenizer)  # then a reasoning split keeps special tokens

    # ---- shared --------------------------------------------------------------------------------------
    async def _choose(self, body: SamplingFields, caller: Caller) -> ModelChoice:
        lora_name = body.lora_request.lora_name if body.lora_request else None
        return await self.adapters.choose(body.model, lora_name, caller.tenant)

    async def _generation(
        self,
        endpoint: str,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        choice: ModelChoice,
        caller: Caller,
        structured_field: str | None = None,
    ) -> Generation:
        """The engine's requests for the prompts, validated (a 400 naming `structured_field`, the body's field that
        asked for the structured output, where it does not compile)."""
        requests = [
            EngineRequest(
                request_id=f"{request_id}-{i}",
                prompt_token_ids=ids,
                sampling=copy.copy(params),
                lora=choice.lora,
                tenant=caller.tenant,
                tenant_weight=caller.tenant_weight,
                prompt=text,
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        metrics = self.metrics.request(caller.tenant, choice.adapter_name, endpoint)
        generation = Generation(self.engine, requests, caller.on_done(choice), metrics)
        try:
            await generation.validate()
        except APIError as e:
            if e.code != INVALID_STRUCTURED_OUTPUT or structured_field is None:
                raise
            raise APIError(400, e.message, param=structured_field, code=e.code) from None
        return generation

    @staticmethod
    def _whole_response(
        head: dict, generation: Generation, choices: dict[int, _Choice], content: Callable[[int, _Choice], dict]
    ) -> JSONResponse:
        """A response that is not streamed: `head`, each choice's `content` (its text and logprobs, as the
        endpoint writes them, from its index and what it collected) between its index and finish reason, and the
        usage."""
        body = [
            {"index": index, **content(index, c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for index, c in sorted(choices.items())
        ]
        return JSONResponse(
            {**head, "choices": body, "usage": generation.usage.to_dict()}, headers=load_headers(generation)
        )

    async def _error_chunk(self, error: APIError) -> str:
        """A failure after the response started: its status goes in the body (and the error metrics)."""
        self.metrics.count_error(error.status_code)
        return sse(error_body(error.status_code, error.message, error.param, error.code))

    # ---- completions ---------------------------------------------------------------------------------
    async def _completion_prompts(self, prompt, n: int) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        self.limits.check_sequence_count(len(prompt), n)
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await self.prompts.encode(texts))
        prompts = [(p, next(encoded)) if isinstance(p, str) else (None, list(p)) for p in prompt]
        for _, ids in prompts:
            self.prompts.check_ids(ids)
        return prompts

    async def completions(self, body: CompletionRequest, raw: Request, caller: Caller):
        self.limits.check_n(body.n)
        params = body.sampling_params(body.max_tokens, body.logprobs, body.requested_prompt_logprobs)
        choice = await self._choose(body, caller)
        request_id = new_id("cmpl")
        prompts = await self._completion_prompts(body.prompt, body.n)
        generation = await self._generation(
            "completions", request_id, prompts, params, choice, caller, body.structured_field
        )
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": choice.model}
        if body.stream:
            stream = await primed(generation)
            chunks = self._completion_chunks(stream, generation, head, body, prompts)
            return stream_response(chunks, generation)
        choices = await until_disconnect(raw, collect(generation, body.n))

        def content(index: int, c: _Choice) -> dict:
            echo = self._prompt_part(body, prompts[index // body.n], c.prompt_logprobs)
            logprobs = None
            if c.logprobs is not None:
                logprobs = completion_logprobs(echo.logprobs + c.logprobs, self.token_text)
            return {"text": echo.text + c.text, "logprobs": logprobs, **echo.extra}

        return self._whole_response(head, generation, choices, content)

    def _prompt_part(self, body: CompletionRequest, prompt: tuple[str | None, list[int]], prompt_logprobs) -> Echo:
        """What a choice shows of its prompt: with echo its text and (with logprobs) its tokens' entries before the
        choice's own, the first without a logprob; vLLM's `prompt_logprobs` where asked."""
        text, ids = prompt
        echo = Echo()
        if body.echo:
            echo.text = text if text is not None else self.tokenizer.decode(ids)
            if body.logprobs is not None and prompt_logprobs is not None:
                echo.logprobs = [TokenLogprob(ids[0], None), *prompt_logprobs[1:]]
        if body.prompt_logprobs is not None and prompt_logprobs is not None:
            echo.extra["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs, self.token_text)
        return echo

    async def _completion_chunks(
        self,
        primed: Primed,
        generation: Generation,
        head: dict,
        body: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
    ):
        def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            return {**head, "choices": [choice]}

        continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        text_chunk = TextChunks(chunk)
        offsets: dict[int, int] = {}
        shows_prompt = body.echo or body.prompt_logprobs is not None  # a chunk of its own, before the choice's first
        prompt_logprobs: dict[int, list] = {}  # prompt -> its logprobs, in the delta of its first tokens
        try:
            item = primed.first
            while item is not None:
                i, out = item
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for delta in out.outputs:
                    index = i * body.n + delta.index
                    if shows_prompt and index not in offsets:
                        echo = self._prompt_part(body, prompts[i], prompt_logprobs.get(i))
                        logprobs = completion_logprobs(echo.logprobs, self.token_text) if echo.logprobs else None
                        data = chunk(index, echo.text, logprobs)
                        data["choices"][0].update(echo.extra)
                        if continuous_usage:
                            data["usage"] = generation.usage.to_dict()
                        offsets[index] = len(echo.text)
                        yield sse(data)
                    if _is_empty(delta):
                        continue
                    offset = offsets.get(index, 0)
                    offsets[index] = offset + len(delta.text)
                    if _text_only(delta) and not continuous_usage:
                        yield text_chunk(index, delta.text)
                        continue
                    logprobs = None
                    if delta.logprobs is not None:
                        logprobs = completion_logprobs(delta.logprobs, self.token_text, offset)
                    data = chunk(index, delta.text, logprobs, delta.finish_reason, delta.stop_reason)
                    if continuous_usage:
                        data["usage"] = generation.usage.to_dict()
                    yield sse(data)
                item = await anext(primed.rest, None)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": generation.usage.to_dict()})
        except APIError as e:
            yield await self._error_chunk(e)
        finally:
            await primed.rest.aclose()
        yield SSE_DONE

    # ---- chat ----------------------------------------------------------------------------------------
    async def chat_run(self, body: ChatCompletionRequest, caller: Caller, endpoint: str, request_id: str) -> ChatRun:
        """A chat turn's generation, validated, and how its choices read (chat completions and responses)."""
        self.limits.check_n(body.n)
        body.resolve_tool_calling(self.limits.tool_call_parser, self.limits.tool_call_syntax)
        params = body.sampling_params(body.requested_max_tokens, body.requested_logprobs, body.prompt_logprobs)
        choice = await self._choose(body, caller)
        text = await self.chat_templates.render_request(body.messages, choice.adapter_path, body)
        # the template wrote the special tokens
        (ids,) = await self.prompts.encode([text], add_special_tokens=False, param="messages")
        replies = self._replies(body, text)
        if replies.reasoning is not None:
            if params.structured_outputs is not None:  # the form after the reasoning
                first = replies.reasoning.reasoning_first(text)
                params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_first=first)
            if self.think_tags_special:
                params.skip_special_tokens = False
        generation = await self._generation(
            endpoint, request_id, [(text, ids)], params, choice, caller, body.structured_field
        )
        return ChatRun(request_id, choice, generation, replies)

    async def chat(self, body: ChatCompletionRequest, raw: Request, caller: Caller):
        run = await self.chat_run(body, caller, "chat", new_id("chatcmpl"))
        request_id, choice, generation, replies = run.request_id, run.choice, run.generation, run.replies
        if body.stream:
            head = {"id": request_id, "object": "chat.completion.chunk", "created": now(), "model": choice.model}
            stream = await primed(generation)
            return stream_response(self._chat_chunks(stream, generation, head, body, replies), generation)
        choices = await until_disconnect(raw, collect(generation, body.n))
        head = {"id": request_id, "object": "chat.completion", "created": now(), "model": choice.model}
        if body.prompt_logprobs is not None and choices:
            head["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs or [], self.token_text)
        messages = {}
        for index, c in choices.items():
            messages[index], c.finish_reason = replies.message(c.text, c.finish_reason)
        return self._whole_response(
            head,
            generation,
            choices,
            lambda index, c: {
                "message": messages[index],
                "logprobs": chat_logprobs(c.logprobs, self.token_text) if c.logprobs is not None else None,
            },
        )

    def _replies(self, body: ChatCompletionRequest, prompt: str) -> ChatReplies:
        """How the choices read: the tool calls body asks for, the reasoning split where the server has a parser."""
        parser = self.limits.reasoning_parser
        reasoning = REASONING_PARSERS[parser] if parser is not None else None
        return ChatReplies(body.calling, reasoning, prompt, body.include_reasoning)

    async def _chat_chunks(
        self, primed: Primed, generation: Generation, head: dict, body: ChatCompletionRequest, replies: ChatReplies
    ):
        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
            return {
                **head,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            }

        continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        text_chunk = TextChunks(lambda index, text: chunk(index, {"content": text}))

        def event(index: int, delta: dict, finish_reason=None, logprobs=None, **top) -> str:
            data = {**chunk(index, delta, finish_reason, logprobs), **top}
            if continuous_usage:
                data["usage"] = generation.usage.to_dict()
            return sse(data)

        reply_streams = None if replies.plain else {index: replies.stream() for index in range(body.n)}
        try:
            prompt_logprobs = primed.first[1].prompt_logprobs if primed.first is not None else None
            for index in range(body.n):
                top = {}
                if index == 0 and prompt_logprobs is not None:  # vLLM's, with the chat's first chunk
                    top["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs, self.token_text)
                yield event(index, {"role": "assistant", "content": ""}, **top)
            item = primed.first
            while item is not None:
                for delta in item[1].outputs:
                    if _is_empty(delta):
                        continue
                    if reply_streams is not None:
                        fields, finish_reason = reply_streams[delta.index].push(delta.text, delta.finish_reason)
                        logprobs = None
                        if delta.logprobs is not None:
                            logprobs = chat_logprobs(delta.logprobs, self.token_text)
                        if fields is not None or finish_reason is not None or logprobs is not None:
                            yield event(delta.index, fields or {}, finish_reason, logprobs)
                        continue
                    if _text_only(delta) and not continuous_usage:
                        yield text_chunk(delta.index, delta.text)  # not empty: it has text
                        continue
                    logprobs = chat_logprobs(delta.logprobs, self.token_text) if delta.logprobs is not None else None
                    content = {"content": delta.text} if delta.text else {}
                    yield event(delta.index, content, delta.finish_reason, logprobs)
                item = await anext(primed.rest, None)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": generation.usage.to_dict()})
        except APIError as e:
            yield await self._error_chunk(e)
        finally:
            await primed.rest.aclose()
        yield SSE_DONE
