"""ready_batches: an async stream regrouped into lists of what is ready each time the consumer asks.

An engine replica streams a request's deltas back through Ray Serve, where each item costs far more than a delta
(serialization, an object, a message): one list per pull carries one delta while the consumer keeps up and every
waiting delta when it falls behind, so the stream never lags further than one item behind the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def ready_batches(source: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """Yields non-empty lists of `source`'s items in order; an error of `source` is raised after the items before
    it; leaving early cancels `source` (its cleanup runs before this generator finishes closing)."""
    ready: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                ready.put_nowait(item)
            ready.put_nowait(_END)
        except Exception as e:  # delivered in order, after what came before it
            ready.put_nowait(e)

    pumping = asyncio.create_task(pump())
    try:
        while True:
            waiting = [await ready.get()]
            while not ready.empty():
                waiting.append(ready.get_nowait())
            batch = []
            for item in waiting:
                if item is _END or isinstance(item, Exception):
                    if batch:
                        yield batch
                    if item is _END:
                        return
                    raise item
                batch.append(item)
            yield batch
    finally:
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
