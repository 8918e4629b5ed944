"""Test-only: the LLMEngine behind an AsyncEngine, for assertions on internals the public surface does not show.

Nothing outside tests/ may do this: the gateway uses AsyncEngine's verbs only. Read it while the engine is idle
(every request finished or aborted), or accept a racy read: the engine thread owns it.
"""

from __future__ import annotations

import threading

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine


def llm_engine(engine: AsyncEngine) -> LLMEngine:
    return engine._engine


def engine_thread(engine: AsyncEngine) -> threading.Thread:
    return engine._thread


def kill_engine_thread(engine: AsyncEngine) -> None:
    """Ends the engine thread as an engine-wide fault would, without the gateway asking (tests of the watch)."""
    from engine.async_engine import _STOP

    engine._inbox.put(_STOP)
    engine._thread.join(timeout=30)


def held_streams(engine: AsyncEngine) -> int:
    """How many streams have deltas held back by `stream_interval` (engine/delta_coalescer.py)."""
    return len(engine._coalescer)
