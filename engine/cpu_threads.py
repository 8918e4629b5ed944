"""The engine's OpenMP team on CPU, sized to the cores other processes leave free (between 1 and the configured
cpu_threads), re-checked about once a second between steps.

Why: a team larger than the free cores stalls at every parallel region while one of its threads waits for a core
(on 2 cores with one busy neighbour a team of 2 ran 5-7x slower than a team of 1). The team is never bound to
cores, so the kernel can move it away from a neighbour; it grows back when the neighbour goes.

Load is read from /proc/stat (every process's busy time) minus /proc/self/stat (this process's: the engine and, in
`loraplex serve`, the gateway beside it), over the last interval; an interval this process spent mostly idle is
not used (a neighbour that ran while the server waited for requests is no reason to start the next burst with
fewer threads). Nor does a neighbour shrink the team unless the team's threads waited for a core meanwhile (their
schedstat run delay): one that ran on a core the engine left unused (loading its model, a spell of Python) took
nothing from it, and one of lower priority yields most of that core the moment the team needs it. At one thread the
neighbour keeps the core left to it however little it weighs, so a shrunk team tries its full size again now and
then, briefly, and keeps it where its threads do not wait (PROBE_S). Elsewhere (no /proc) the team stays as
configured.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
IDLE_BELOW_CORES = 0.5  # an interval in which this process kept less than this busy on average: it was idle
# How much of a core other processes must be seen using (beyond whole cores) to take that core from the team. Measured
# on 2 cores (W1 LoRA workload, a team of 2 against a team of 1): a neighbour running all the time shows as only
# ~0.64 of a core while the team contends with it (the kernel shares 2 cores among 3 threads) and a team of 1 is then
# 1.2-1.3x faster; one busy 70% of its time shows as 0.42 and a team of 2 stays 1.1x faster, at 50% (0.34) 1.2x,
# at 30% (0.22) 1.5x. A part-time neighbour (an HTTP client, the benchmark's own) must not halve the team.
NEIGHBOUR_TAKES_CORE_AT = 0.55
# Cores' worth of time the process's threads must have spent waiting for a CPU over the interval for a neighbour to
# shrink the team. Measured on 2 cores (W1 LoRA, a team of 2 held at two beside one busy process): the engine loading
# its model beside it, 0.00-0.02; the process at nice 10, 0.20-0.21 (Zen 3 and Zen 4), where the team keeps 1.79
# cores and runs 1.5x as fast as a team of 1; at nice 5, 0.60-0.66 (1.35 cores; a team of 1: 1.2x as fast); at the
# same priority ~1.0 (a team of 1: 7x as fast).
CONTENDED_WAIT_CORES = 0.35
# A team shrunk for a neighbour cannot see whether the neighbour would yield the core back: at one thread nobody
# waits, and a neighbour of lower priority fills the core left to it. So now and then the team tries its full size
# for PROBE_S and keeps it if its threads did not wait (the neighbour yields), else shrinks again at once and tries
# twice as late next time: after PROBE_FIRST_INTERVALS intervals, then 2x, up to PROBE_MAX_INTERVALS. A failed try
# costs PROBE_S and the step in flight when it ends, run by the full team beside a neighbour of the same priority
# (a decode step there ~8x slower than at one thread): ~0.5 s a try on W1; paired runs showed no cost (Zen 3).
PROBE_S = 0.25
PROBE_FIRST_INTERVALS = 16
PROBE_MAX_INTERVALS = 128
SIZES_KEPT = 256  # the team sizes a governor remembers (a server beside a part-time neighbour may resize for months)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds every process has been busy, CPU seconds this process has used), both since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]  # cpu user nice system idle iowait ...
    ticks = [int(f) for f in fields]
    machine_busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # all but idle and iowait
    return machine_busy / TICKS_PER_S, stat_cpu_s(Path("/proc/self/stat"))


def waiting_seconds() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (each one's schedstat run delay),
    summed over its threads now (a thread that ended drops out: an interval in which one ended may read less than
    its threads waited, never more). Raises OSError where the kernel keeps no schedstat."""
    total = int(Path("/proc/self/schedstat").read_text().split()[1])  # the main thread's, and the check it exists
    for task in os.scandir("/proc/self/task"):
        if task.name == str(os.getpid()):
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended meanwhile
            total += int(Path(task.path, "schedstat").read_text().split()[1])
    return total / 1e9


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a /proc stat file: /proc/PID/stat (every thread of the process) or
    /proc/PID/task/TID/stat (one thread). Raises OSError where it cannot be read."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime: the stat's 14th and 15th fields


PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes


def name_os_thread(name: str) -> None:
    """Gives the calling thread `name` in the OS too (Python 3.11 keeps a thread's name to itself), where top,
    /proc/PID/task/TID/comm, py-spy and perf show it. A no-op where prctl is missing (not Linux)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def run_alone() -> None:
    """Makes the torch ops this thread calls from now on run on it alone, never in an OpenMP team of its own.

    For helper threads beside the engine's (the adapter loader, request workers): a second team is one more
    thread that libgomp manages, and once it manages more threads than there are cores, every team's threads
    sleep at once between parallel regions instead of spinning: each of the engine's short kernels then waits
    for a wake-up (an RMSNorm of 11 us took 60, steps of 18 ms took 25 on 2 cores). torch.set_num_threads cannot
    do this: it sets every thread's count. OpenMP's own per-thread setting can. A no-op where torch is not built
    with libgomp."""
    omp_set_num_threads = _libgomp_set_num_threads()
    if omp_set_num_threads is not None:
        torch.get_num_threads()  # torch's first use in a thread sets its OpenMP count: let it happen before ours
        omp_set_num_threads(1)


@functools.cache
def _libgomp_set_num_threads() -> Callable[[int], None] | None:
    """omp_set_num_threads of the libgomp torch runs on (found among this process's mappings), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split(None, 5)[-1] for line in maps.splitlines() if "libgomp" in line and "/" in line}
    for path in sorted(paths, key=lambda p: "torch" not in p):  # torch's own copy first
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


class ThreadGovernor:
    """Sets torch's intra-op threads to min(max_threads, cores left free by other processes), at least 1."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 1.0,
        cores: int | None = None,
        read_busy: Callable[[], tuple[float, float]] = busy_seconds,
        clock: Callable[[], float] = time.monotonic,
        read_waiting: Callable[[], float] = waiting_seconds,
    ):
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.cores = cores or usable_cores()
        self._read_busy, self._clock, self._read_waiting = read_busy, clock, read_waiting
        self._waiting = self._waiting_now()  # None: no schedstat here, and any neighbour may shrink the team
        self.threads = max_threads
        self.others_busy = 0.0  # cores other processes kept busy over the last interval
        self._hinted = False  # the first shrink says what gives the team its cores back
        self._probing = False  # the team is trying its full size again, for PROBE_S
        self._probe_every = PROBE_FIRST_INTERVALS  # intervals below the full size before the next try
        self._below_for = 0  # intervals the team has spent below its full size since its last try
        self.probes = 0  # tries so far (the ones that kept the full team too)
        self._shrunk_to = max_threads  # the team's size before the try
        self.sizes: deque[int] = deque([max_threads], maxlen=SIZES_KEPT)  # its latest sizes, in order (tries too)
        self.resizes = 0  # changes of size so far: with `sizes`, which sizes a span of steps ran with
        torch.set_num_threads(self.threads)
        try:
            self._last = (self._clock(), *self._read_busy())
        except OSError:
            self._last = None  # no /proc: a fixed team
            logger.info("cpu threads: %d, fixed (no /proc to read the machine's load from)", self.threads)

    def restart(self) -> None:
        """Starts the next interval now: what ran before (the engine loading its model, on fewer threads than its
        team, beside whatever else ran) says nothing of the load its steps will meet."""
        if self._last is not None:
            self._last = (self._clock(), *self._read_busy())
        self._waiting = self._waiting_now()
        self._probing, self._below_for = False, 0

    def tick(self) -> int:
        """Between two steps: resizes the team once per interval; returns the team size."""
        if self._last is None or self.max_threads == 1:
            return self.threads
        now = self._clock()
        if now - self._last[0] < (PROBE_S if self._probing else self.interval_s):
            return self.threads
        machine, own = self._read_busy()
        then, machine_then, own_then = self._last
        self._last = (now, machine, own)
        waiting, waiting_then = self._waiting_now(), self._waiting
        self._waiting = waiting
        if (own - own_then) / (now - then) < IDLE_BELOW_CORES:
            # this process sat idle through most of the interval (a server between bursts): what other processes
            # did then says little of the load its next steps will meet, so the next interval, from now, decides
            return self.threads
        self.others_busy = max(0.0, (machine - machine_then) - (own - own_then)) / (now - then)
        # a neighbour seen using most of a core takes it: the team's thread there would wait for it at every barrier
        free = self.cores - math.floor(self.others_busy + 1 - NEIGHBOUR_TAKES_CORE_AT)
        threads = max(1, min(self.max_threads, free))
        waited = None if waiting is None or waiting_then is None else (waiting - waiting_then) / (now - then)
        if threads < self.threads and waited is not None and waited < CONTENDED_WAIT_CORES:
            threads = self.threads  # the neighbour took nothing the team was waiting for
        if self._probing:
            return self._end_probe(threads)
        if threads < self.max_threads and threads >= self.threads:
            self._below_for += 1
            if self._below_for >= self._probe_every:
                return self._start_probe()
        if threads != self.threads:
            logger.info(
                "cpu threads: %d -> %d (other processes keep %.1f of %d cores busy)",
                self.threads,
                threads,
                self.others_busy,
                self.cores,
            )
            if threads < self.threads and not self._hinted:
                self._hinted = True
                logger.info(
                    "cpu threads: a busy process of the same priority gets as much of the CPU as this one (per "
                    "session or cgroup), whatever the team's size; to keep more, lower its priority (nice) or raise "
                    "this server's CPU weight (systemd CPUWeight=, a Kubernetes CPU request)"
                )
            self._resize(threads)
            self._below_for = 0
            if threads == self.max_threads:
                self._probe_every = PROBE_FIRST_INTERVALS
        return self.threads

    def _start_probe(self) -> int:
        logger.debug("cpu threads: trying %d again for %.2f s", self.max_threads, PROBE_S)
        self._probing, self._below_for, self._shrunk_to = True, 0, self.threads
        self.probes += 1
        return self._resize(self.max_threads)

    def _end_probe(self, threads: int) -> int:
        """The try's verdict: `threads` is what the usual rule chose after PROBE_S at the full team."""
        self._probing = False
        if threads >= self.max_threads:
            self._probe_every = PROBE_FIRST_INTERVALS
            logger.info(
                "cpu threads: %d -> %d (tried again: other processes keep %.1f of %d cores busy, and yield them)",
                self._shrunk_to,
                self.max_threads,
                self.others_busy,
                self.cores,
            )
            return self.threads
        self._probe_every = min(2 * self._probe_every, PROBE_MAX_INTERVALS)
        return self._resize(threads)

    def _resize(self, threads: int) -> int:
        if threads != self.threads:
            self.sizes.append(threads)
            self.resizes += 1
        self.threads = threads
        torch.set_num_threads(threads)
        return threads

    def _waiting_now(self) -> float | None:
        try:
            return self._read_waiting()
        except OSError:
            return None
