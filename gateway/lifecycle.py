"""The server's life after start: the graceful drain on SIGTERM / SIGINT, and the watch on the engine thread.

Drain: on a stop signal uvicorn stops accepting connections and gives running requests
`--timeout-graceful-shutdown` seconds. A little before that runs out (the cut), every stream still open ends
with an SSE error event and `[DONE]` instead of a bare connection close, and every non-streamed request still
waiting gets a 503; their engine requests are aborted and their usage counted. So uvicorn never has to cancel a
task, and the process exits 0.

Engine watch: if the engine thread stops (an engine-wide fault), the process cannot serve anything again; it
says so in one line and exits with status 1 so that its supervisor (systemd, Kubernetes, compose) restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from engine.interface import AsyncEngine
from gateway.errors import APIError, error_body
from gateway.openai_format import SSE_DONE, sse

logger = logging.getLogger(__name__)
ENGINE_WATCH_INTERVAL_S = 0.5
CUT_MARGIN_S = 1.0  # the cut comes this long (at most a fifth of the timeout) before uvicorn's own deadline


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry on another replica",
        code="server_shutting_down",
        headers={"Retry-After": "1"},
    )


class Drain:
    def __init__(self):
        self.cut = asyncio.Event()  # set at the cut: what still runs is ended, with an error the client sees
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def begin(self, timeout_s: float) -> None:
        """Starts the drain clock; safe to call from a signal handler."""
        if self.draining or self._loop is None:
            return
        self.draining = True
        delay = max(timeout_s - min(CUT_MARGIN_S, timeout_s / 5), 0.0)
        self._loop.call_soon_threadsafe(self._loop.call_later, delay, self._cut)

    def _cut(self) -> None:
        logger.warning("drain timeout reached: ending the requests still running with an error")
        self.cut.set()

    async def guard_stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Passes a response's SSE chunks through; at the cut, ends it with an error event and [DONE] (checked
        between chunks: a stream that is generating gets its next tokens within `stream_interval` steps)."""
        try:
            async for chunk in chunks:
                yield chunk
                if self.cut.is_set() and chunk != SSE_DONE:
                    error = shutting_down()
                    yield sse(error_body(error.status_code, error.message, code=error.code))
                    yield SSE_DONE
                    return
        finally:
            await chunks.aclose()  # aborts the engine requests behind an unfinished stream


async def watch_engine(engine: AsyncEngine, on_stopped: Callable[[], None]) -> None:
    """Calls `on_stopped` once, when the engine thread is found dead."""
    while engine.is_alive:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.critical("the engine thread has stopped: this process cannot serve any more; exiting with status 1")
    on_stopped()
