"""Generation: the engine requests behind one HTTP request (one per prompt, each with its n samples).

It merges their delta streams, keeps the usage (prompt, completion and cached prompt tokens) and the token
timing, aborts everything still running when the client goes away or an error ends the request, and reports
usage and metrics once, at the end, whatever the ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request

from engine.interface import (
    AdapterError,
    AsyncEngine,
    EngineRequest,
    EngineStopped,
    RequestOutput,
    SequenceFailed,
    StructuredOutputError,
)
from gateway.errors import APIError
from gateway.metrics import Latency, RequestMetrics

logger = logging.getLogger(__name__)

INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"  # the error code of a schema, regex or grammar that fails


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


UsageCallback = Callable[[Usage, bool], Awaitable[None]]  # (usage, completed) once per generation


def engine_error(error: Exception) -> APIError:
    """A request's failure inside the engine, as the client sees it."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, AdapterError):
        return APIError(422, str(error), param="model", code="adapter_load_failed")
    if isinstance(error, EngineStopped):
        return APIError(503, f"the engine has stopped: {error}", code="engine_stopped")
    if isinstance(error, SequenceFailed):  # this request's numbers went bad; the others ran on
        logger.error("request failed in the engine: %s", error)
        return APIError(500, f"the engine failed this request: {error}", code="sequence_failed")
    if isinstance(error, StructuredOutputError):  # the field that asked for it: `OpenAIServing._generation`
        return APIError(400, str(error), param="structured_outputs", code=INVALID_STRUCTURED_OUTPUT)
    if isinstance(error, ValueError):
        message = str(error)
        param = "max_tokens" if "context length" in message else "prompt"
        return APIError(400, message, param=param)
    logger.exception("request failed in the engine", exc_info=error)
    return APIError(500, f"the engine failed this request: {type(error).__name__}: {error}")


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        requests: list[EngineRequest],
        on_done: UsageCallback | None = None,
        metrics: RequestMetrics | None = None,
    ):
        self.engine, self.requests, self.on_done, self.metrics = engine, requests, on_done, metrics
        self.usage = Usage(prompt_tokens=sum(len(r.prompt_token_ids) for r in requests))
        self.latency = Latency()
        self.failed = False
        self._cached = [0] * len(requests)
        self._finished = [False] * len(requests)
        self._reported = False

    async def validate(self) -> None:
        """The engine's own checks (prompt length, vocabulary), on the engine thread, before anything starts."""
        results = await asyncio.gather(*(self.engine.validate(r) for r in self.requests), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise engine_error(result) from None
            if isinstance(result, BaseException):
                raise result

    @property
    def completed(self) -> bool:
        return all(self._finished)

    @property
    def outcome(self) -> str:
        return "completed" if self.completed else "failed" if self.failed else "aborted"

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) as the engine makes them; usage reported when the iteration ends. One prompt's
        deltas come straight from its engine stream (no merging generator in between: each layer costs the event
        loop time per streamed token)."""
        single = len(self.requests) == 1
        source = self.engine.generate(self.requests[0]) if single else self._merged()
        try:
            async for item in source:
                i, out = (0, item) if single else item
                self.usage.completion_tokens += out.num_completion_tokens
                self._cached[i] = out.num_cached_tokens
                self._finished[i] = out.finished
                self.latency.on_delta(i, out)
                yield i, out
        except Exception as e:
            self.failed = True
            raise engine_error(e) from None
        finally:
            try:
                with contextlib.suppress(EngineStopped):  # an unfinished engine stream aborts its request, if it can
                    await source.aclose()
            finally:  # reported even when a cancellation reaches the abort
                self.usage.cached_tokens = sum(self._cached)
                await self.report()

    async def report(self) -> None:
        if self._reported:
            return
        self._reported = True
        if self.metrics is not None:
            self.metrics.observe(self.usage, self.outcome, self.latency)
        if self.on_done is not None:
            await asyncio.shield(self.on_done(self.usage, self.completed))

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several prompts' engine streams as one, each delta with its prompt's index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request: EngineRequest) -> None:
            try:
                async for out in self.engine.generate(request):
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each cancelled stream aborts its request


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable):
    """Awaits `work` unless the client disconnects first (then it is cancelled, aborting its engine requests and
    raising ClientDisconnected) or a server drain reaches its cut (then a 503)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watchers = {asyncio.ensure_future(listen())}
    drain = getattr(request.app.state, "drain", None)
    if drain is not None:
        watchers.add(asyncio.ensure_future(drain.cut.wait()))
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for future in (task, *watchers):
            future.cancel()
        raise
    for watcher in watchers:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if drain is not None and drain.cut.is_set():
            raise APIError(503, "the server is shutting down; retry on another replica", code="server_shutting_down")
        raise ClientDisconnected
    return task.result()
