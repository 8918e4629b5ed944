"""Busy processes beside a benchmark: the "one other busy process on the machine" of a shared server, reproducible.

Each is a separate Python process spinning on one core (a process, not a thread: it competes for the CPU the way
a neighbour does, outside our OpenMP team), all the time or, with `duty` < 1, that share of every 10 ms and asleep
for the rest (a part-time neighbour: an HTTP client, a batch job that waits on I/O). They are stopped, whatever
happens, when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)
# spins for duty * 10 ms and sleeps for the rest of each 10 ms (never, at duty 1)
SPIN = """
import sys, time
busy = float(sys.argv[1]) * 0.01
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    if busy < 0.01:
        time.sleep(0.01 - busy)
"""


@contextlib.contextmanager
def background_load(processes: int, duty: float = 1.0) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy loops for the duration of the block (none for 0), each busy `duty` of the time."""
    if processes < 0:
        raise ValueError(f"background load must be 0 or more processes, got {processes}")
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"background load duty must be in (0, 1], got {duty}")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(duty)]) for _ in range(processes)]
    if spinners:
        logger.info(
            "background load: %d busy process(es), %.0f%% of the time, pids %s",
            processes,
            100 * duty,
            [p.pid for p in spinners],
        )
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
