"""The CPU thread team follows the cores other processes leave free (engine/cpu_threads.py)."""

from __future__ import annotations

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
    """Busy-time counters that advance as the test says: `others` cores busy elsewhere, `own` in this process."""

    def __init__(self):
        self.now, self.machine, self.own, self.reads = 0.0, 0.0, 0.0, 0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.machine += (others + own) * seconds
        self.own += own * seconds

    def read(self) -> tuple[float, float]:
        self.reads += 1
        return self.machine, self.own


def governor(machine: FakeMachine, max_threads: int, cores: int) -> ThreadGovernor:
    return ThreadGovernor(max_threads, interval_s=1.0, cores=cores, read_busy=machine.read, clock=lambda: machine.now)


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
    with background_load(cores):
        # within a few intervals (a VM's host may hold the spinners back in one); busy too meanwhile: an interval
        # this process spent idle is not used
        threads, deadline = team.threads, time.monotonic() + 5.0
        while (threads != 1 or team.others_busy < 0.5 * cores) and time.monotonic() < deadline:
            threads = team.tick()
        assert threads == 1
        assert team.others_busy >= 0.5 * cores
    machine_after, own_after = busy_seconds()
    assert machine_after - machine_before >= own_after - own_before >= 0


def test_the_engine_governs_its_team_unless_told_not_to(model_dir):
    adaptive = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads=2)
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
