"""AsyncEngine: the engine's one door. The LLMEngine runs on its own thread; callers (the gateway) use only the
verbs below, from asyncio, with the plain data of engine/interface.py in and out.

The engine thread owns the LLMEngine: every command (a new request, an abort, an adapter verb, a validation, a
snapshot) goes through its thread-safe inbox and runs between two steps, so nothing the engine thread mutates is
ever touched by another thread. Deltas go back to each request's asyncio queue through `call_soon_threadsafe`
(every step's, or joined over `stream_interval` steps: engine/delta_coalescer.py); the event loop only ever
waits. Reading an adapter from disk, the one slow command, runs on a worker thread and only its result is handed
to the engine thread.

A request that breaks its step fails alone (the LLMEngine isolates it; its stream raises SequenceFailed). A fault
no request can be blamed for stops the engine thread: an EngineFault (the model fails its self-test), or
MAX_FAILED_STEPS steps in a row raising out of the LLMEngine. Then `is_alive` turns False, one line is logged, and
every open stream and every pending or later command fails with EngineStopped.

Verbs: `generate`, `abort`, `validate`; adapters `add_adapter` (disk -> host memory), `remove_adapter` (forget
everywhere), `load_adapter` (-> a device row), `unload_adapter` (device row -> host), `pin_adapter` /
`unpin_adapter`, `tier`, `digest`; `stats()`. Read-only facts: `tokenizer`, `max_model_len`, `is_alive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, TypeVar

from engine.cpu_threads import name_os_thread, run_alone
from engine.delta_coalescer import DeltaCoalescer
from engine.interface_types import (
    AdapterInfo,
    EngineConfig,
    EngineRequest,
    EngineSnapshot,
    LoRARequest,
    RequestOutput,
    Tier,
)
from engine.llm_engine import EngineFault, LLMEngine

if TYPE_CHECKING:
    from adapters.cache import HostAdapter

logger = logging.getLogger(__name__)

_STOP = object()
IDLE_POLL_S = 0.002
MAX_FAILED_STEPS = 3  # steps in a row raising with no request to blame before the engine thread stops
# Python's switch interval bounds how long a thread that wants the GIL waits for another to give it up (5 ms by
# default). The engine thread runs a decode step's layers without the GIL (engine/layers/decode_stack.py) and then
# wants it back while the event loop is sending the last step's deltas: at 0.5 ms the server's decode steps of 64
# sequences (W1, 1 engine thread) took 51-52 ms against 54.6, no change at 2 threads.
GIL_SWITCH_INTERVAL_S = 0.0005
T = TypeVar("T")


class EngineStopped(RuntimeError):
    """The engine thread is not running (shut down, or died): nothing more can be served."""


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Completes a caller's future unless the caller stopped waiting (its work, e.g. an abort, still ran)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled by the caller
        pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine]):
        """Starts the engine thread, which builds the LLMEngine (`build()`: weights, KV pool, kernels) and then runs
        it; returns once it is built, raising what building raised.

        Built there, not on the calling thread: on CPU, the first thread to run a parallel torch op starts an OpenMP
        team that keeps its threads for the life of the process, and once libgomp manages more threads than there
        are cores, every team's threads sleep between parallel regions instead of spinning. A model loaded on the
        gateway's worker thread left such a second team behind: the engine's steps then took 52 ms instead of 35
        (64 sequences of the 56M Llama on 2 cores)."""
        self._engine: LLMEngine  # owned by the engine thread; tests reach it through tests/engine_probe.py only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (callable, Future) run on the engine thread
        # request id -> (its event loop, its queue, its stream interval)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._coalescer = DeltaCoalescer()  # the engine thread's
        self._stopped = threading.Event()
        self._stop_reason = "it was shut down"
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # a shorter one set by the host process stays
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="loraplex-engine", daemon=True)
        self._thread.start()
        built.result()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(lambda: LLMEngine(config))

    # ---- read-only facts -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, for encoding prompts and chat templates (never mutated)."""
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self, build: Callable[[], LLMEngine], built: Future) -> None:
        name_os_thread(self._thread.name)  # top, py-spy and `bench latency`'s CPU by thread tell it apart
        try:
            self._engine = build()
        except BaseException as e:
            self._stop_reason = f"building the engine failed: {e!r}"
            self._stopped.set()
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            self._loop()
        except BaseException as e:
            self._stop_reason = f"it died: {e!r}"
            logger.exception("the engine thread died")
        finally:
            self._stopped.set()
            self._fail_pending()

    def _loop(self) -> None:
        engine = self._engine
        idle = False  # the last step had nothing to run (say, every waiting request's adapter is loading)
        failed_steps = 0  # in a row, raising out of the LLMEngine (which has already failed every request it could)
        while True:
            try:
                while True:
                    if not engine.has_unfinished:
                        item = self._inbox.get()
                    else:
                        item = self._inbox.get(timeout=IDLE_POLL_S) if idle else self._inbox.get_nowait()
                    idle = False
                    if item is _STOP:
                        return
                    fn, future = item
                    try:
                        _settle(future, result=fn())
                    except Exception as e:  # a bad request or adapter fails alone
                        _settle(future, error=e)
            except queue.Empty:
                pass
            try:
                outputs = engine.step()
            except Exception as e:
                failed_steps += 1
                if isinstance(e, EngineFault):
                    self._stop_reason = str(e)
                elif failed_steps < MAX_FAILED_STEPS:
                    logger.warning("a step raised with no request to blame (%d in a row)", failed_steps, exc_info=e)
                    continue
                else:
                    self._stop_reason = f"{failed_steps} steps in a row raised with no request to blame: {e!r}"
                logger.error("engine stopped: %s", self._stop_reason, exc_info=e)
                return
            failed_steps = 0
            idle = not engine.last_step_ran
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands each stream its delta of the step (or of its last `stream_interval` steps, joined): one wake-up per
        event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | Exception]]] = {}
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id) if not out.finished else streams.pop(out.request_id, None)
            if stream is None:
                self._coalescer.drop(out.request_id)
                continue
            loop, q, interval = stream
            for ready in self._coalescer.push(out, interval):
                by_loop.setdefault(loop, []).append((q, ready.error if ready.error is not None else ready))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_stream(self, request_id: str, error: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            loop, q, _ = stream
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody is waiting
                loop.call_soon_threadsafe(q.put_nowait, error)

    def _fail_pending(self) -> None:
        """Once the engine thread has stopped: every command still queued and every open stream fails."""
        stopped = f"the engine thread has stopped: {self._stop_reason}"
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                _settle(item[1], error=EngineStopped(stopped))
        for request_id in list(self._streams):
            self._fail_stream(request_id, EngineStopped(stopped))

    def _call(self, fn: Callable[[], T]) -> Future:
        future: Future = Future()
        self._inbox.put((fn, future))
        if self._stopped.is_set():  # it stopped before it could take the command
            self._fail_pending()
        return future

    async def _submit(self, fn: Callable[[], T]) -> T:
        """Runs `fn()` on the engine thread between two steps and returns its value (or raises its error)."""
        return await asyncio.wrap_future(self._call(fn))

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas as steps produce them; the last one has `finished=True`. Raises ValueError
        (a bad request) or AdapterError (its adapter cannot be loaded). Leaving the iteration early (a client
        that went away) aborts the request. A delta holds the tokens of one step, or of `stream_interval` steps
        (the engine's, or the request's own when larger) after the first."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        interval = max(self._engine.config.stream_interval, request.sampling.stream_interval or 1)
        self._streams[request.request_id] = (loop, q, interval)
        try:
            await self._submit(lambda: self._engine.add_request(request))
        except BaseException:
            self._streams.pop(request.request_id, None)
            self._call(lambda: self._forget(request.request_id))  # if it was added before we were cancelled
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
        """Aborts a request; when this returns its blocks and its adapter row are free."""
        self._streams.pop(request_id, None)
        await self._submit(lambda: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        """On the engine thread: aborts the request and drops the deltas held for its stream."""
        self._coalescer.drop(request_id)
        self._engine.abort(request_id)

    async def validate(self, request: EngineRequest) -> None:
        """Raises ValueError naming what is wrong with the request (prompt, length, vocabulary, id, grammar); adds
        nothing. Runs here, not on the engine thread: it only reads limits fixed at start and tests one id against the
        live requests (a dict lookup), and add_request checks everything again on the engine thread. A round trip would
        wait for the step in progress, so a burst of requests would reach the engine over several steps."""
        if not self.is_alive:
            raise EngineStopped(f"the engine thread has stopped: {self._stop_reason}")
        if request.sampling.structured_outputs is not None:  # compiling a grammar (the first time, indexing the
            await asyncio.to_thread(self._engine.validate, request)  # vocabulary: ~0.5 s) must not hold the loop
        else:
            self._engine.validate(request)

    # ---- adapters ------------------------------------------------------------------------------------
    async def _read(self, lora: LoRARequest) -> HostAdapter | None:
        """Disk -> a host copy on a worker thread (None when it is already in host memory); raises AdapterError."""
        return await asyncio.to_thread(self._read_on_worker, lora)

    def _read_on_worker(self, lora: LoRARequest) -> HostAdapter | None:
        run_alone()  # the worker's torch ops must not start an OpenMP team beside the engine's
        return self._engine.read_adapter(lora)

    async def add_adapter(self, lora: LoRARequest) -> AdapterInfo:
        """Reads and validates the adapter (unless it is in host memory) and keeps it there; raises AdapterError
        naming the problem."""
        host = await self._read(lora)
        return await self._submit(lambda: self._engine.add_adapter(lora, host))

    async def remove_adapter(self, lora: LoRARequest) -> bool:
        """Forgets the adapter in every tier, so its next use reads the directory again; its device row is freed
        now or when the requests running on it end. Returns whether such requests still run."""
        return await self._submit(lambda: self._engine.remove_adapter(lora))

    async def load_adapter(self, lora: LoRARequest) -> Tier:
        """`add_adapter`, then a device row if one is free (no request is displaced); returns the tier reached."""
        host = await self._read(lora)
        return await self._submit(lambda: self._engine.load_adapter(lora, host))

    async def unload_adapter(self, lora: LoRARequest) -> bool:
        """Frees the adapter's device row (and its pin), keeping it in host memory; returns whether requests
        running on it still hold the row (it is freed when they end)."""
        return await self._submit(lambda: self._engine.unload_adapter(lora))

    async def pin_adapter(self, lora: LoRARequest) -> Tier:
        """`load_adapter`, then keeps its device row until `unpin_adapter`; "device" unless every row is pinned."""
        host = await self._read(lora)
        return await self._submit(lambda: self._engine.pin_adapter(lora, host))

    async def unpin_adapter(self, lora: LoRARequest) -> bool:
        """Returns whether it was pinned."""
        return await self._submit(lambda: self._engine.unpin_adapter(lora))

    async def tier(self, lora: LoRARequest) -> Tier:
        """Where the adapter is now: "device", "host", "loading", "failed" or "disk"."""
        return await self._submit(lambda: self._engine.tier(lora))

    async def digest(self, lora: LoRARequest) -> str | None:
        """The content digest of what this engine holds under `lora` (None before it was read). Answers at once,
        without waiting for a step: it reads a record kept under the adapter cache's lock."""
        return self._engine.digest(lora)

    # ---- state ---------------------------------------------------------------------------------------
    async def stats(self) -> EngineSnapshot:
        """Queues, KV blocks, adapters by tier and the engine's counters, taken between two steps."""
        if not self.is_alive:
            return self._engine.snapshot()  # no engine thread to race with
        return await self._submit(self._engine.snapshot)

    def shutdown(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)
        self._engine.shutdown()
