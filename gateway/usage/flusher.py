"""`UsageFlusher`: the background task that moves usage counters into the registry every few seconds."""

from __future__ import annotations

import asyncio
import logging

from gateway.usage.store import UsageStore
from registry.usage import UsageRollups

logger = logging.getLogger(__name__)


class UsageFlusher:
    """Flushes `store` every `interval_s` seconds and a last time (final) at `close`; errors are logged, and
    the counters they concern stay pending for the next round."""

    def __init__(self, store: UsageStore, rollups: UsageRollups, interval_s: float = 10.0):
        self.store = store
        self.rollups = rollups
        self.interval_s = interval_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-flusher")

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
                return
            except TimeoutError:
                await self.flush()

    async def flush(self, final: bool = False) -> None:
        try:
            await self.store.flush(self.rollups, final=final)
        except Exception:
            logger.exception("usage: flush to the registry failed; the counters stay pending")

    async def close(self) -> None:
        """Stops the loop (letting a flush under way finish: cancelling one mid-commit could count twice), then
        flushes once more, final: a local buffer Redis never took goes to the database."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush(final=True)
