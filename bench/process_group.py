"""Child processes of a benchmark that leave nothing behind: a driver in a process group of its own, killed whole
once it ends, and SIGTERM turned into an exit that runs the benchmark's `finally` blocks.

vLLM's driver starts an engine-core process and a worker of its own; when the driver died or was killed before
them, the two lived on (2026-11-27: a worker kept ~10% of a core busy for minutes, and the next benchmark's
first run read 0.55x of its later ones).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path


def run_in_group(command: list, env: dict, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` in a new session, whose whole process group (the
    command and whatever it started) is killed once the command has ended, failed, timed out or been interrupted.
    Its output goes through files, not pipes: a child left behind holds a pipe open, and reading it to its end
    would wait for that child."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            process.wait(timeout=timeout_s)
        finally:
            kill_group(process)
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group `process` leads (its session's, from `start_new_session`), then reaps it."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone: the command left nothing behind
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, as Ctrl-C raises KeyboardInterrupt: the `finally` blocks
    that stop a server, busy neighbours or a driver's process group run (Python's default dies without them)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
