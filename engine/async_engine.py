"""AsyncEngine: the LLMEngine on its own thread, fed and drained from asyncio without ever blocking it.

The engine thread owns the LLMEngine: it takes new requests and aborts from a thread-safe inbox between
steps, runs steps while there is work, and hands each delta to the request's asyncio queue through
`call_soon_threadsafe`. The event loop only ever waits on queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import EngineRequest

logger = logging.getLogger(__name__)

_STOP = object()
IDLE_POLL_S = 0.002


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Completes a caller's future unless the caller stopped waiting (its work, e.g. an abort, still ran)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled by the caller
        pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (callable, Future) run on the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._errored: BaseException | None = None
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        idle = False  # the last step had nothing to run (say, every waiting request's adapter is loading)
        while True:
            try:
                while True:
                    if not self.engine.has_unfinished:
                        item = self._inbox.get()
                    else:
                        item = self._inbox.get(timeout=IDLE_POLL_S) if idle else self._inbox.get_nowait()
                    idle = False
                    if item is _STOP:
                        return
                    fn, future = item
                    try:
                        _settle(future, result=fn())
                    except Exception as e:  # a bad request fails alone
                        _settle(future, error=e)
            except queue.Empty:
                pass
            try:
                outputs = self.engine.step()
            except Exception as e:
                logger.exception("engine step failed; failing every running request")
                self._fail_all(e)
                continue
            idle = not self.engine.last_step_ran
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id) if not out.finished else self._streams.pop(out.request_id, None)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out.error if out.error is not None else out)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.groups):
            self.engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, error)

    def _call(self, fn) -> Future:
        future: Future = Future()
        self._inbox.put((fn, future))
        return future

    # ---- the asyncio side ----------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas as steps produce them; the last one has `finished=True`. Leaving the
        iteration early (a client that went away) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (loop, q)
        try:
            await asyncio.wrap_future(self._call(lambda: self.engine.add_request(request)))
        except BaseException:
            self._streams.pop(request.request_id, None)
            self._call(lambda: self.engine.abort(request.request_id))  # if it was added before we were cancelled
            raise
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; when this returns its blocks are free."""
        self._streams.pop(request_id, None)
        await asyncio.wrap_future(self._call(lambda: self.engine.abort(request_id)))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def run_on_engine(self, fn):
        """Runs `fn()` on the engine thread between steps (for stats and admin reads) and returns its value."""
        return await asyncio.wrap_future(self._call(fn))

    def shutdown(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)
        self.engine.shutdown()
