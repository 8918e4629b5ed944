"""Busy processes beside a benchmark: the "one other busy process on the machine" of a shared server, reproducible.

Each is a separate Python process spinning on one core (a process, not a thread: it competes for the CPU the way
a neighbour does, outside our OpenMP team), all the time or, with `duty` < 1, that share of every 10 ms and asleep
for the rest (a part-time neighbour: an HTTP client, a batch job that waits on I/O). Each runs in a session of its
own, as another service would, at `nice` 0 (the same priority as the benchmark's drivers) or lower: 10 is a batch
job's usual priority. Where the kernel groups processes by session for scheduling (autogroup:
/proc/sys/kernel/sched_autogroup_enabled), a group's weight comes from its own nice value rather than its
processes', so each spinner sets both. They are stopped, whatever happens, when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)
MAX_NICE = 19  # the lowest priority; below 0 (a higher priority than ours) would need privileges
# lowers its priority to nice argv[2] (its session's scheduling group's too, where the kernel has one), then spins
# for duty * 10 ms and sleeps for the rest of each 10 ms (never, at duty 1)
SPIN = """
import os, sys, time
busy, nice = float(sys.argv[1]) * 0.01, int(sys.argv[2])
if nice:
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup here: the process's own nice is what the scheduler weighs
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    if busy < 0.01:
        time.sleep(0.01 - busy)
"""


def check_background_load(processes: int, duty: float = 1.0, nice: int = 0) -> None:
    """Raises ValueError naming the first setting of a background load that cannot be run."""
    if processes < 0:
        raise ValueError(f"background load must be 0 or more processes, got {processes}")
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"background load duty must be in (0, 1], got {duty}")
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"background load nice must be in [0, {MAX_NICE}] (above ours needs privileges), got {nice}")


@contextlib.contextmanager
def background_load(processes: int, duty: float = 1.0, nice: int = 0) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy loops for the duration of the block (none for 0), each busy `duty` of the time, at `nice`."""
    check_background_load(processes, duty, nice)
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN, str(duty), str(nice)], start_new_session=True)
        for _ in range(processes)
    ]
    if spinners:
        logger.info(
            "background load: %d busy process(es), %.0f%% of the time, at nice %d, pids %s",
            processes,
            100 * duty,
            nice,
            [p.pid for p in spinners],
        )
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
