"""Takes the objects a process holds once its engine is built (torch, transformers, the model's modules: about half
a million) out of the garbage collector's sight, once per process.

Python's full collection walks every tracked object: with that heap it held the GIL for 80-260 ms, a few times a
minute in a busy server, and each time the engine thread stood still (the step's Python parts need the GIL). After
`gc.freeze()` a full collection walks only what was made since (requests, sequences, chunks). A collection first,
so that startup's garbage is freed rather than kept; objects made later are collected as before. vLLM's engine core
does the same.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)
_frozen = False


def freeze_startup_heap() -> None:
    global _frozen
    if _frozen:
        return
    _frozen = True
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit, collectable again: extension types that check for leaks find none
    logger.debug(
        "froze %d startup objects out of the collector's walks (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1000,
    )
