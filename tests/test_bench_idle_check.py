"""A comparison names the processes already busy on the machine before it starts (a stray worker of an earlier
benchmark spoiled a run once, silently)."""

from __future__ import annotations

import os
import sys
import threading

from bench.background_load import background_load
from bench.idle_check import busy_processes, warn_if_busy
from engine.cpu_threads import TICKS_PER_S


def _stat(pid: int, name: str, busy_ticks: int) -> str:
    return f"{pid} ({name}) S " + " ".join(["0"] * 10) + f" {busy_ticks} 0 " + " ".join(["0"] * 30) + "\n"


def test_a_busy_process_is_named_with_the_cores_it_kept_busy(tmp_path):
    """A fake /proc: a process whose name holds spaces and parentheses (and no command line to read) used half a
    second of CPU during the check; an idle one and this process itself (however busy) are not listed."""
    for pid in (4242, 77, os.getpid()):
        (tmp_path / str(pid)).mkdir()
    (tmp_path / "4242" / "stat").write_text(_stat(4242, "VLLM::Worker (1)", 1000))
    (tmp_path / "77" / "stat").write_text(_stat(77, "idle", 5))
    (tmp_path / "77" / "cmdline").write_bytes(b"idle\0--forever\0")
    (tmp_path / str(os.getpid()) / "stat").write_text(_stat(os.getpid(), "python", 0))

    def spend():
        (tmp_path / "4242" / "stat").write_text(_stat(4242, "VLLM::Worker (1)", 1000 + TICKS_PER_S // 2))
        (tmp_path / str(os.getpid()) / "stat").write_text(_stat(os.getpid(), "python", TICKS_PER_S))

    timer = threading.Timer(0.2, spend)
    timer.start()
    busy = busy_processes(1.0, proc=tmp_path)
    timer.join()
    assert [(b.pid, b.name) for b in busy] == [(4242, "VLLM::Worker (1)")]
    assert abs(busy[0].cores - 0.5) < 1e-9


def test_a_busy_neighbour_is_warned_of_before_the_benchmark(capsys):
    with background_load(1) as (spinner,):
        found = warn_if_busy(0.5)
    spinner_found = [b for b in found if b["pid"] == spinner.pid]
    assert spinner_found and spinner_found[0]["cores"] > 0.3
    assert spinner_found[0]["name"].startswith(sys.executable)  # its command line
    warning = capsys.readouterr().out
    assert warning.startswith("warning: other processes kept") and f"(pid {spinner.pid})" in warning
