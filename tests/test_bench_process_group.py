"""A benchmark's child processes leave nothing behind: a driver's own children die with it (vLLM's engine core and
worker outlived a killed driver once), and SIGTERM lets a benchmark's `finally` blocks run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import BenchError
from bench.peer import run_driver
from bench.process_group import exit_on_sigterm
from loraplex import cli

REPO_ROOT = Path(__file__).resolve().parent.parent

# a driver that starts a long-lived child of its own (as vLLM's starts its engine core), its output and errors
# shared with the driver's or not, prints its result line and exits with the status given
DRIVER = textwrap.dedent(
    """
    import json, subprocess, sys
    status, stdio = int(sys.argv[1]), None if sys.argv[2] == "shared" else subprocess.DEVNULL
    child = subprocess.Popen(["sleep", "300"], stdout=stdio, stderr=stdio)
    print(json.dumps({"walls_s": [1.0], "output_tokens": 64, "child_pid": child.pid}), flush=True)
    sys.exit(status)
    """
)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """No such process, or a zombie (dead, waiting for init to reap it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_children_a_driver_leaves_behind_die_with_it():
    result = run_driver([sys.executable, "-c", DRIVER, "0", "own"], dict(os.environ), "peer", "base")
    assert result["output_tokens"] == 64 and result["wall_s"] == 1.0
    assert _gone(result["child_pid"])


def test_a_failing_drivers_children_die_with_it_even_holding_its_output_open():
    start = time.monotonic()
    with pytest.raises(BenchError, match="exit 3") as error:
        run_driver([sys.executable, "-c", DRIVER, "3", "shared"], dict(os.environ), "peer", "base")
    assert time.monotonic() - start < 60  # not waiting for the child to close the driver's output
    child_pid = json.loads(str(error.value).splitlines()[-1])["child_pid"]  # the error ends with its output
    assert _gone(child_pid)


def test_sigterm_runs_a_benchmarks_finally_blocks(tmp_path):
    marker = tmp_path / "cleaned"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        from bench.process_group import exit_on_sigterm
        exit_on_sigterm()
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            pathlib.Path({str(marker)!r}).write_text("stopped its children")
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "stopped its children"


def test_every_bench_command_takes_sigterm_as_an_exit(monkeypatch):
    installed: list = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append((signum, handler)))
    with pytest.raises(SystemExit):  # --help: each benchmark prints its own options and exits
        cli.main(["bench", "peer", "--help"])
    assert [signum for signum, _ in installed] == [signal.SIGTERM]
    with pytest.raises(SystemExit) as exit_info:
        installed[0][1](signal.SIGTERM, None)
    assert exit_info.value.code == 143
    installed.clear()
    exit_on_sigterm()
    assert [signum for signum, _ in installed] == [signal.SIGTERM]
