"""The CPU thread team follows the cores other processes leave free (engine/cpu_threads.py)."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch

from bench.background_load import background_load
from engine import cpu_threads
from engine.cpu_threads import ThreadGovernor, busy_seconds, usable_cores
from engine.llm import LLM
from tests.hf_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("threads")
    make_model(directory, tokenizer)
    return directory


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """Busy-time counters that advance as the test says: `others` cores busy elsewhere, `own` in this process, and
    `waiting` cores' worth of time its threads spent waiting for a CPU (by default, as a team contending does)."""

    def __init__(self):
        self.now, self.machine, self.own, self.waiting, self.reads = 0.0, 0.0, 0.0, 0.0, 0

    def run(self, seconds: float, others: float, own: float, waiting: float = 1.0) -> None:
        self.now += seconds
        self.machine += (others + own) * seconds
        self.own += own * seconds
        self.waiting += waiting * seconds

    def read(self) -> tuple[float, float]:
        self.reads += 1
        return self.machine, self.own

    def read_waiting(self) -> float:
        return self.waiting


def governor(machine: FakeMachine, max_threads: int, cores: int) -> ThreadGovernor:
    return ThreadGovernor(
        max_threads,
        interval_s=1.0,
        cores=cores,
        read_busy=machine.read,
        clock=lambda: machine.now,
        read_waiting=machine.read_waiting,
    )


def test_the_team_shrinks_to_the_free_cores_and_grows_back_when_the_neighbour_goes():
    machine = FakeMachine()
    team = governor(machine, max_threads=4, cores=4)
    assert team.threads == torch.get_num_threads() == 4
    for others, expected in [(0.1, 4), (2.0, 2), (1.4, 3), (1.6, 2), (3.9, 1), (8.0, 1), (0.0, 4)]:
        machine.run(1.0, others=others, own=4.0 - min(others, 3.0))
        assert team.tick() == expected, others
        assert torch.get_num_threads() == expected
        assert team.others_busy == pytest.approx(others)


def test_the_first_shrink_says_once_what_gives_the_cores_back(caplog):
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    with caplog.at_level("INFO", logger="engine.cpu_threads"):
        for others in (0.0, 1.0, 0.0, 1.0):  # shrinks, grows back, shrinks again
            machine.run(1.0, others=others, own=2.0 - others)
            team.tick()
    assert [r.getMessage() for r in caplog.records if "cpu threads: 2 -> 1" in r.getMessage()] != []
    hints = [r.getMessage() for r in caplog.records if "CPU weight" in r.getMessage()]
    assert len(hints) == 1 and "nice" in hints[0], hints


def test_the_team_is_never_larger_than_configured_and_the_load_is_read_once_per_interval():
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=8)
    reads = machine.reads
    machine.run(0.4, others=0.0, own=2.0)
    assert team.tick() == 2 and machine.reads == reads  # within the interval: nothing read
    machine.run(0.7, others=0.0, own=2.0)
    assert team.tick() == 2 and machine.reads == reads + 1


def test_a_neighbour_seen_while_the_engine_sat_idle_does_not_shrink_the_team():
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    machine.run(30.0, others=2.0, own=0.01)  # a server waiting for requests while a batch job ran beside it
    assert team.tick() == 2 and torch.get_num_threads() == 2
    machine.run(1.0, others=0.0, own=2.0)  # the next burst, the job gone: the interval from the last tick decides
    assert team.tick() == 2 and team.others_busy == pytest.approx(0.0)
    machine.run(1.0, others=1.0, own=1.0)  # a neighbour while it works still takes its core
    assert team.tick() == 1


def test_a_part_time_neighbour_keeps_the_team_and_a_full_time_one_takes_its_core():
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    # what a team of 2 sees beside a process busy 30%, 50% and 70% of its time (measured): the team stays
    for part_time in (0.22, 0.34, 0.42):
        machine.run(1.0, others=part_time, own=2.0 - part_time)
        assert team.tick() == 2, part_time
    machine.run(1.0, others=0.64, own=1.36)  # a process busy all the time, seen while contending with the team
    assert team.tick() == 1
    machine.run(1.0, others=0.9, own=1.0)  # seen by the team of 1: it still takes its core
    assert team.tick() == 1
    machine.run(1.0, others=0.3, own=1.0)  # it went part-time: the team grows back
    assert team.tick() == 2


def test_a_neighbour_on_a_core_the_team_left_unused_does_not_shrink_it():
    """The engine loading its model on one thread beside a busy process: the process has the other core, but took
    nothing the team waited for (one of lower priority would yield it to the team's first step), so the team stays;
    once the team's threads wait for it, it takes its core, and at one thread nobody waits any more."""
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    machine.run(3.0, others=1.0, own=1.0, waiting=0.01)  # loading: measured 0.00-0.02 of a core waiting
    assert team.tick() == 2 and team.others_busy == pytest.approx(1.0)
    machine.run(1.0, others=0.2, own=1.8, waiting=0.2)  # a neighbour at nice 10 beside the team: it yields
    assert team.tick() == 2
    machine.run(1.0, others=0.6, own=1.4, waiting=0.3)  # the same, busier while the team sat in Python: still yields
    assert team.tick() == 2
    machine.run(1.0, others=0.65, own=1.35, waiting=0.63)  # at nice 5 (measured): a team of one is faster
    assert team.tick() == 1
    machine.run(1.0, others=0.0, own=2.0, waiting=0.0)
    assert team.tick() == 2
    machine.run(1.0, others=0.64, own=1.36, waiting=1.0)  # one of the same priority: the team waits for it
    assert team.tick() == 1
    machine.run(1.0, others=1.0, own=1.0, waiting=0.0)  # the team of one waits for nothing, and stays one
    assert team.tick() == 1
    machine.run(1.0, others=0.0, own=2.0, waiting=0.0)  # the neighbour gone: the team grows back
    assert team.tick() == 2


def shrink_beside_a_neighbour_of_the_same_priority(machine: FakeMachine, team: ThreadGovernor) -> None:
    machine.run(1.0, others=0.64, own=1.36, waiting=1.0)
    assert team.tick() == 1


def test_a_shrunk_team_tries_its_full_size_again_and_keeps_it_beside_a_neighbour_that_yields(caplog):
    """At one thread a neighbour of lower priority fills the core left to it, and nobody waits: only a try at two
    threads shows that it yields the core."""
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    shrink_beside_a_neighbour_of_the_same_priority(machine, team)
    for _ in range(cpu_threads.PROBE_FIRST_INTERVALS - 1):  # the neighbour, reniced to 10, fills the free core
        machine.run(1.0, others=1.0, own=1.0, waiting=0.0)
        assert team.tick() == 1
    machine.run(1.0, others=1.0, own=1.0, waiting=0.0)
    assert team.tick() == 2 and torch.get_num_threads() == 2 and team.probes == 1  # the try
    machine.run(cpu_threads.PROBE_S / 2, others=0.2, own=1.8, waiting=0.2)
    assert team.tick() == 2  # not decided before PROBE_S
    with caplog.at_level("INFO", logger="engine.cpu_threads"):
        machine.run(cpu_threads.PROBE_S / 2, others=0.2, own=1.8, waiting=0.2)  # measured at nice 10: 0.20-0.21
        assert team.tick() == 2
    assert any("1 -> 2 (tried again" in r.getMessage() for r in caplog.records)
    for _ in range(3 * cpu_threads.PROBE_MAX_INTERVALS):  # kept: the usual one-second intervals, no more tries
        machine.run(1.0, others=0.2, own=1.8, waiting=0.2)
        assert team.tick() == 2
    assert team.probes == 1 and list(team.sizes) == [2, 1, 2] and team.resizes == 2


def test_a_try_beside_a_neighbour_of_the_same_priority_shrinks_at_once_and_the_next_comes_twice_as_late():
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    shrink_beside_a_neighbour_of_the_same_priority(machine, team)
    tries = []
    for second in range(1, 1000):
        machine.run(1.0, others=1.0, own=1.0, waiting=0.0)
        if team.tick() == 2:  # a try: the neighbour takes its share back, and the team's threads wait for it
            tries.append(second)
            machine.run(cpu_threads.PROBE_S, others=0.64, own=1.36, waiting=1.0)
            assert team.tick() == 1 and torch.get_num_threads() == 1
    waits = [b - a for a, b in zip([0, *tries], tries)]
    first, most = cpu_threads.PROBE_FIRST_INTERVALS, cpu_threads.PROBE_MAX_INTERVALS
    assert waits[:4] == [first, 2 * first, 4 * first, 8 * first] and most == 8 * first
    assert set(waits[3:]) == {most}  # at most one try every PROBE_MAX_INTERVALS
    assert team.probes == len(tries) and team.resizes == 1 + 2 * len(tries)
    assert list(team.sizes) == [2, 1] + [2, 1] * len(tries)


def test_the_team_remembers_its_latest_sizes_and_counts_every_resize():
    """A server beside a neighbour that comes and goes resizes for as long as it runs: the history stays bounded."""
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    for second in range(3 * cpu_threads.SIZES_KEPT):
        others = 1.0 if second % 2 == 0 else 0.0  # here one second, gone the next
        machine.run(1.0, others=others, own=2.0 - others, waiting=others)
        assert team.tick() == (1 if others else 2)
    assert team.resizes == 3 * cpu_threads.SIZES_KEPT
    assert list(team.sizes) == [1, 2] * (cpu_threads.SIZES_KEPT // 2)  # the latest SIZES_KEPT, oldest first


def test_a_restart_leaves_the_start_up_out_of_the_first_interval():
    machine = FakeMachine()
    team = governor(machine, max_threads=2, cores=2)
    machine.run(4.0, others=1.0, own=1.0, waiting=0.5)  # loading the model beside a busy process, waiting at times
    team.restart()
    machine.run(1.0, others=0.2, own=1.8, waiting=0.2)  # the first steps, beside a neighbour that yields
    assert team.tick() == 2 and team.others_busy == pytest.approx(0.2)
    machine.run(4.0, others=0.6, own=1.4, waiting=0.5)
    assert team.tick() == 1  # without the restart that interval would have counted


def test_without_schedstat_any_neighbour_may_shrink_the_team():
    machine = FakeMachine()

    def no_schedstat():
        raise OSError("no schedstat")

    team = ThreadGovernor(2, cores=2, read_busy=machine.read, clock=lambda: machine.now, read_waiting=no_schedstat)
    machine.run(3.0, others=1.0, own=1.0, waiting=0.0)
    assert team.tick() == 1


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="the kernel keeps no schedstat")
def test_waiting_seconds_reads_every_thread_of_the_process():
    stop, data = threading.Event(), bytes(1 << 20)

    def hash_until_stopped():
        while not stop.is_set():
            hashlib.sha256(data).digest()  # hashlib lets go of the GIL: the threads run at once

    before = cpu_threads.waiting_seconds()
    workers = [threading.Thread(target=hash_until_stopped) for _ in range(usable_cores() + 2)]
    for t in workers:  # two more runnable threads than cores: together they wait ~2 cores' worth for a CPU
        t.start()
    time.sleep(1.0)
    waited = cpu_threads.waiting_seconds() - before  # while they run: a thread that ended drops out of the sum
    stop.set()
    for t in workers:
        t.join()
    assert waited > 0.5


def test_without_proc_the_team_stays_as_configured():
    def unreadable():
        raise OSError("no /proc")

    team = ThreadGovernor(3, read_busy=unreadable, clock=lambda: 1e9)
    assert team.tick() == 3 and torch.get_num_threads() == 3


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")
def test_real_busy_neighbours_on_every_core_leave_a_team_of_one():
    cores = usable_cores()
    machine_before, own_before = busy_seconds()
    team = ThreadGovernor(max(2, cores), interval_s=0.5)
    x = torch.randn(192, 192)
    with background_load(cores):
        # within a few intervals (a VM's host may hold the spinners back in one); the team busy meanwhile, as an
        # engine's between its ticks: an interval this process spent idle is not used, nor one its threads spent
        # without waiting for a core
        threads, deadline = team.threads, time.monotonic() + 5.0
        while (threads != 1 or team.others_busy < 0.5 * cores) and time.monotonic() < deadline:
            torch.mm(x, x)
            threads = team.tick()
        assert threads == 1
        assert team.others_busy >= 0.5 * cores
    machine_after, own_after = busy_seconds()
    assert machine_after - machine_before >= own_after - own_before >= 0


def test_the_engine_governs_its_team_unless_told_not_to(model_dir, monkeypatch):
    from engine.model_runner import ModelRunner

    events = []  # the team's first interval starts once the model is built, not before its load
    capture, restart = ModelRunner.capture_decode_graphs, ThreadGovernor.restart
    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", lambda *a: events.append("built") or capture(*a))
    monkeypatch.setattr(ThreadGovernor, "restart", lambda self: events.append("restart") or restart(self))
    adaptive = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads=2)
    assert events == ["built", "restart"]
    assert adaptive.engine.thread_governor is not None and adaptive.engine.thread_governor.max_threads == 2
    assert adaptive.engine.snapshot().cpu_threads == torch.get_num_threads()
    fixed = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads=2, cpu_threads_adapt=False)
    assert fixed.engine.thread_governor is None


def test_a_helper_thread_runs_its_torch_ops_alone_and_the_engine_keeps_its_team():
    if cpu_threads._libgomp_set_num_threads() is None:
        pytest.skip("torch is not built with libgomp here")
    torch.set_num_threads(2)
    seen: list[int] = []

    def helper():
        cpu_threads.run_alone()
        torch.randn(1_000_000).abs().amax()  # large enough to run in parallel if it could
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen == [1] and torch.get_num_threads() == 2  # torch.set_num_threads would have set both to 1


def test_the_adapter_loader_thread_runs_alone(model_dir):
    if cpu_threads._libgomp_set_num_threads() is None:
        pytest.skip("torch is not built with libgomp here")
    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads=2, enable_lora=True, max_loras=1)
    assert llm.engine.adapter_cache._loader.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2
