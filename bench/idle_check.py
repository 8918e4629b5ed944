"""Before a comparison starts: which other processes are busy on the machine, named, so that a run spoiled by a
neighbour (a stray worker of an earlier benchmark, a build, a test suite) says so before its figures are read.

On 2026-11-27 a vLLM worker left behind by a stopped `bench peer` kept ~10% of a core busy, and the next run's first
figures read 0.55x of its later ones with nothing printed to tell why.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.cpu_threads import stat_cpu_s

NAMED_ABOVE_CORES = 0.02  # a process busier than this over the check is named
WARN_ABOVE_CORES = 0.1  # all of them together: the warning


@dataclass(frozen=True)
class BusyProcess:
    pid: int
    name: str  # its command line, or its name where that cannot be read
    cores: float  # its CPU seconds a second over the check


def busy_processes(seconds: float = 1.0, proc: Path = Path("/proc")) -> list[BusyProcess]:
    """Each other process that kept more than NAMED_ABOVE_CORES busy over the next `seconds`, busiest first; this
    process left out. Empty where /proc cannot be read."""
    before = _cpu_seconds(proc)
    time.sleep(seconds)
    busy = []
    for pid, (name, cpu) in _cpu_seconds(proc).items():
        cores = (cpu - before[pid][1]) / seconds if pid in before else 0.0  # a process born meanwhile: not counted
        if cores > NAMED_ABOVE_CORES:
            busy.append(BusyProcess(pid, _command(proc / str(pid)) or name, cores))
    return sorted(busy, key=lambda b: -b.cores)


def _command(process: Path, limit: int = 80) -> str:
    """Its command line, cut at `limit` characters ("" when unreadable or a kernel thread's)."""
    try:
        words = (process / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    command = " ".join(w.decode(errors="replace") for w in words if w)
    return command if len(command) <= limit else command[: limit - 3] + "..."


def warn_if_busy(seconds: float = 1.0) -> list[dict]:
    """Prints one warning line when other processes together kept WARN_ABOVE_CORES or more busy; returns them all
    as dicts (for a result JSON)."""
    busy = busy_processes(seconds)
    total = sum(b.cores for b in busy)
    if total >= WARN_ABOVE_CORES:
        named = ", ".join(f"{b.name} (pid {b.pid}) {b.cores:.2f}" for b in busy[:5])
        print(
            f"warning: other processes kept {total:.2f} cores busy over {seconds:g} s before this benchmark "
            f"({named}); its figures will read low",
            flush=True,
        )
    return [asdict(b) for b in busy]


def _cpu_seconds(proc: Path) -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) of every process but this one."""
    found = {}
    for stat in proc.glob("[0-9]*/stat"):
        if int(stat.parent.name) == os.getpid():
            continue
        try:
            text = stat.read_text()
            found[int(stat.parent.name)] = (text[text.find("(") + 1 : text.rfind(")")], stat_cpu_s(stat))
        except OSError:  # it ended meanwhile
            continue
    return found
