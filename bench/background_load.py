"""Busy processes beside a benchmark: the "one other busy process on the machine" of a shared server, reproducible.

Each is a separate Python process spinning on one core (a process, not a thread: it competes for the CPU the way
a neighbour does, outside our OpenMP team). They are stopped, whatever happens, when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)
SPIN = "while True: pass"


@contextlib.contextmanager
def background_load(processes: int) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy loops for the duration of the block (none for 0)."""
    if processes < 0:
        raise ValueError(f"background load must be 0 or more processes, got {processes}")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(processes)]
    if spinners:
        logger.info("background load: %d busy process(es), pids %s", processes, [p.pid for p in spinners])
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
