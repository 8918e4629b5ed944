"""`loraplex bench peer`: the shared workload file, the busy neighbours, loraplex's driver on a real tiny model, and
vLLM's driver against a recording stand-in (vLLM is never installed here; the real comparison is a benchmark)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import BenchError, offline_driver, peer
from bench.background_load import background_load
from bench.peer_workload import PeerWorkload
from tests.hf_models import base_with_adapters

REPO = Path(__file__).resolve().parent.parent
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"
SMALL = PeerWorkload(num_prompts=5, input_len=12, output_len=4, runs=2, seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    base, loras = base_with_adapters(tmp_path_factory.mktemp("peer"), tokenizer, count=3)
    return base, [(lora.adapter_id, lora.path) for lora in loras]


@pytest.fixture
def workload_file(model, tmp_path) -> Path:
    base, adapters = model
    return SMALL.write(tmp_path / "workload.json", base, adapters, max_lora_rank=8)


def test_the_workload_file_is_deterministic_with_fresh_prompts_each_run(model, workload_file, tmp_path):
    base, adapters = model
    body = json.loads(workload_file.read_text())
    again = json.loads(SMALL.write(tmp_path / "again.json", base, adapters, 8).read_text())
    assert body == again
    first, second = body["runs"]
    assert [ids for ids, _ in first] != [ids for ids, _ in second]  # no run hits the other's prefix cache
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    for run in body["runs"]:
        assert len(run) == 5 and all(len(ids) == 12 and min(ids) >= 4 and max(ids) < vocab for ids, _ in run)
        assert {a for _, a in run} <= {0, 1, 2}
    assert sorted(a for _, a in body["warmup"]) == [0, 1, 2]  # every adapter loaded before the clock starts
    assert body["max_model_len"] == 12 + 4 + 16 and body["output_len"] == 4
    assert body["max_loras"] == body["max_cpu_loras"] == 3  # a row per adapter unless told
    assert body["dtype"] == "float32"


def test_fewer_rows_than_adapters_and_the_dtype_reach_both_drivers(model, tmp_path):
    base, adapters = model
    rows = PeerWorkload(
        num_prompts=5, input_len=12, output_len=4, runs=1, seed=3, max_loras=1, max_cpu_loras=2, dtype="bfloat16"
    )
    workload_file = rows.write(tmp_path / "rows.json", base, adapters, 8)
    body = json.loads(workload_file.read_text())
    assert (body["max_loras"], body["max_cpu_loras"], body["dtype"]) == (1, 2, "bfloat16")
    result = offline_driver.main(["--workload", str(workload_file), "--threads", "1"])
    assert result["output_tokens"] == 5 * 4
    assert len(result["cpu_s"]) == len(result["walls_s"]) == 1 and result["cpu_s"][0] > 0
    log = tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONPATH": str(FAKE_VLLM), "FAKE_VLLM_LOG": str(log)}
    command = [sys.executable, str(REPO / "bench" / "vllm_driver.py"), "--workload", str(workload_file)]
    subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    init = json.loads(log.read_text().splitlines()[0])
    assert (init["body"]["max_loras"], init["body"]["max_cpu_loras"], init["body"]["dtype"]) == (1, 2, "bfloat16")


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_background_load_keeps_busy_processes_running_and_stops_them():
    with background_load(2) as spinners:
        time.sleep(0.5)
        before = [_cpu_ticks(p.pid) for p in spinners]
        time.sleep(0.5)
        after = [_cpu_ticks(p.pid) for p in spinners]
        assert all(b > a for a, b in zip(before, after)), (before, after)
    assert all(p.poll() is not None for p in spinners)
    with pytest.raises(ValueError, match="0 or more"), background_load(-1):
        pass
    with pytest.raises(ValueError, match="duty"), background_load(1, duty=0.0):
        pass
    for nice in (-1, 20):
        with pytest.raises(ValueError, match=rf"nice must be in \[0, 19\].*got {nice}"), background_load(1, nice=nice):
            pass


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_background_load_at_a_lower_priority_runs_niced_in_a_session_of_its_own():
    """A neighbour is another service: a session of its own, at the priority asked, and where the kernel schedules
    sessions as groups (autogroup) the group's too (else the group would weigh as much as ours whatever its nice)."""
    with background_load(1, nice=10) as (spinner,):
        deadline = time.monotonic() + 10
        while _nice(spinner.pid) != 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _nice(spinner.pid) == 10
        assert os.getsid(spinner.pid) == spinner.pid != os.getsid(0)
        autogroup = Path(f"/proc/{spinner.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "10", autogroup.read_text()
    with background_load(1) as (spinner,):
        time.sleep(0.3)
        assert _nice(spinner.pid) == os.nice(0)  # by default, the priority of the benchmark's drivers
        assert os.getsid(spinner.pid) == spinner.pid


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # the stat's 19th field


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_part_time_background_load_keeps_its_share_of_a_core():
    with background_load(1, duty=0.3) as spinners:
        time.sleep(0.5)
        before, start = _cpu_ticks(spinners[0].pid), time.monotonic()
        time.sleep(2.0)
        busy = (_cpu_ticks(spinners[0].pid) - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - start)
    assert 0.1 < busy < 0.6, busy  # 0.3 of a core, give or take a busy machine's scheduling
    assert spinners[0].poll() is not None


def test_loraplex_driver_runs_every_run_with_its_adapters(workload_file, capsys):
    result = offline_driver.main(["--workload", str(workload_file), "--threads", "1"])
    assert result["mode"] == "lora" and result["threads"] == 1
    assert len(result["walls_s"]) == 2 and all(w > 0 for w in result["walls_s"])
    assert result["output_tokens"] == 5 * 4
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["team_sizes"] == [[1], [1]]  # each timed run's team sizes (a team of one never resizes)
    base_only = offline_driver.main(["--workload", str(workload_file), "--threads", "1", "--no-lora"])
    assert base_only["mode"] == "base" and base_only["output_tokens"] == 20


def test_vllm_driver_asks_vllm_for_the_same_requests_adapters_and_threads(workload_file, tmp_path):
    log = tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONPATH": str(FAKE_VLLM), "FAKE_VLLM_LOG": str(log)}
    command = [sys.executable, str(REPO / "bench" / "vllm_driver.py"), "--workload", str(workload_file)]
    out = subprocess.run([*command, "--threads-bind", "0-1"], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mode"] == "lora" and len(result["walls_s"]) == 2 and result["output_tokens"] == 20
    events = [json.loads(line) for line in log.read_text().splitlines()]
    init, _warmup, *runs = events
    body = json.loads(workload_file.read_text())
    assert init["body"]["enable_lora"] and init["body"]["max_loras"] == 3 and init["body"]["dtype"] == "float32"
    assert init["env_bind"] == "0-1"
    for event, run in zip(runs, body["runs"]):
        assert event["body"]["prompts"] == [ids for ids, _ in run]
        assert event["body"]["adapters"] == [body["adapters"][a][0] for _, a in run]
        assert event["body"]["params"]["ignore_eos"] and event["body"]["params"]["max_tokens"] == 4
    log.unlink()
    subprocess.run([*command, "--no-lora"], env=env, capture_output=True, text=True, check=True)
    init, *generates = [json.loads(line) for line in log.read_text().splitlines()]
    assert "enable_lora" not in init["body"] and all(g["body"]["adapters"] is None for g in generates)


def peer_argv(model, tmp_path: Path, monkeypatch) -> list[str]:
    """`bench peer` options for the tiny model and its adapters, one run of 3 short requests, against the recording
    stand-in for vLLM in a venv made here."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(FAKE_VLLM))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm.log"))
    base, adapters = model
    argv = ["--model", str(base), *(f"--lora={n}={p}" for n, p in adapters), "--vllm-venv", str(venv)]
    return [*argv, "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--runs", "1", "--threads", "1"]


def test_a_driver_run_whose_team_was_resized_says_so(monkeypatch, capsys):
    result = {"walls_s": [2.0, 3.0], "output_tokens": 64, "team_sizes": [[2], [2, 1, 2]]}
    done = subprocess.CompletedProcess([], 0, json.dumps(result) + "\n", "")
    monkeypatch.setattr(peer, "run_in_group", lambda *a, **k: done)
    peer.run_driver(["driver"], {}, "loraplex", "lora")
    assert "cpu threads by run: 2, 2 -> 1 -> 2" in capsys.readouterr().out
    monkeypatch.setattr(
        peer,
        "run_in_group",
        lambda *a, **k: subprocess.CompletedProcess(
            [], 0, '{"walls_s": [1.0], "output_tokens": 8, "team_sizes": [[2]]}', ""
        ),
    )
    peer.run_driver(["driver"], {}, "loraplex", "lora")
    assert "cpu threads" not in capsys.readouterr().out  # unchanged: nothing to say


def test_peer_compares_both_systems_mode_by_mode_as_ratios(model, tmp_path, monkeypatch):
    argv = peer_argv(model, tmp_path, monkeypatch)
    drivers = []  # (system, mode) of each driver process, in the order they ran
    run_driver = peer.run_driver
    monkeypatch.setattr(peer, "run_driver", lambda *a: drivers.append(a[2:]) or run_driver(*a))
    summary = peer.main([*argv, "--pairs", "1", "--json", str(tmp_path / "peer.json")])
    rows = {(r["system_name"], r["mode"]): r for r in summary["results"]}
    assert set(rows) == {("loraplex", "base"), ("vllm", "base"), ("loraplex", "lora"), ("vllm", "lora")}
    assert all(r["output_tokens"] == 9 for r in rows.values())
    expected = rows["loraplex", "lora"]["output_tok_s"] / rows["vllm", "lora"]["output_tok_s"]
    assert summary["ratios"]["loraplex/vllm lora"] == pytest.approx(expected)
    assert set(summary["ratios"]) == {
        "loraplex/vllm base",
        "loraplex/vllm lora",
        "loraplex lora/base",
        "vllm lora/base",
        "loraplex lora/base (paired)",
    }
    # the pair follows the mode-by-mode runs: loraplex only, base and LoRA back to back, each its own process
    assert drivers[4:] == [("loraplex", "base"), ("loraplex", "lora")]
    [pair] = summary["pairs"]
    assert set(pair) == {"base", "lora"} and min(pair.values()) > 0
    assert summary["ratios"]["loraplex lora/base (paired)"] == pytest.approx(pair["lora"] / pair["base"])
    assert json.loads((tmp_path / "peer.json").read_text())["ratios"] == summary["ratios"]


def test_versus_idle_runs_each_system_idle_first_then_beside_the_load_and_prints_loaded_over_idle(
    model, tmp_path, monkeypatch, capsys
):
    argv = peer_argv(model, tmp_path, monkeypatch)
    loaded = []  # whether the busy processes ran while each driver did
    background = peer.background_load
    busy = threading.Event()

    @contextlib.contextmanager
    def watched_load(*args):
        with background(*args) as spinners:
            busy.set()
            yield spinners
        busy.clear()

    run_driver = peer.run_driver
    monkeypatch.setattr(peer, "background_load", watched_load)
    monkeypatch.setattr(peer, "run_driver", lambda *a: loaded.append((a[2], a[3], busy.is_set())) or run_driver(*a))
    summary = peer.main([*argv, "--background-load", "1", "--versus-idle", "--modes", "lora"])
    runs = [("loraplex", "lora"), ("vllm", "lora")]
    assert loaded == [(*run, False) for run in runs] + [(*run, True) for run in runs]
    idle = {(r["system_name"], r["mode"]): r["output_tok_s"] for r in summary["idle_results"]}
    for r in summary["results"]:
        key = (r["system_name"], r["mode"])
        assert summary["ratios"][f"{key[0]} loaded/idle {key[1]}"] == pytest.approx(r["output_tok_s"] / idle[key])
    assert len(summary["results"]) == 2 and capsys.readouterr().out.count("  idle") == 2
    with pytest.raises(SystemExit, match="--versus-idle compares runs beside --background-load"):
        peer.main([*argv, "--versus-idle"])


def test_pairs_take_turns_going_first_and_their_median_ratio_counts(monkeypatch, tmp_path):
    speeds = iter([100.0, 90.0, 80.0, 100.0, 100.0, 50.0])  # tok/s of each run, in the order the runs start
    started = []

    def run_loraplex(workload_file, mode, threads, fixed_threads):
        started.append(mode)
        return {"output_tok_s": next(speeds)}

    monkeypatch.setattr(peer, "run_loraplex", run_loraplex)
    args = peer.build_parser().parse_args(["--pairs", "3", "--threads", "1"])
    pairs = peer.run_pairs(tmp_path / "pair-workload.json", args)
    assert started == ["base", "lora", "lora", "base", "base", "lora"]
    assert pairs == [{"base": 100.0, "lora": 90.0}, {"base": 100.0, "lora": 80.0}, {"base": 100.0, "lora": 50.0}]
    summary = peer.summarize([], args, PeerWorkload(1, 1, 1, 1), pairs)
    assert summary["ratios"] == {"loraplex lora/base (paired)": pytest.approx(0.8)}  # of 0.9, 0.8 and 0.5


def test_turns_alternate_which_system_goes_first_and_their_median_ratio_counts(monkeypatch, tmp_path, capsys):
    speeds = iter([120.0, 100.0, 80.0, 100.0, 130.0, 100.0, 90.0, 30.0])  # tok/s of each run, in the order they start
    started = []

    def run_loraplex(workload_file, mode, threads, fixed_threads):
        started.append(("loraplex", mode))
        return {"output_tok_s": next(speeds)}

    def run_vllm(python, args, workload_file, mode):
        started.append(("vllm", mode))
        return {"output_tok_s": next(speeds)}

    monkeypatch.setattr(peer, "run_loraplex", run_loraplex)
    monkeypatch.setattr(peer, "run_vllm", run_vllm)
    args = peer.build_parser().parse_args(["--turns", "2", "--threads", "1"])
    turns = peer.run_turns(["base", "lora"], tmp_path / "pair-workload.json", args, Path("python"))
    first_loraplex, first_vllm = ["loraplex", "vllm"], ["vllm", "loraplex"]
    assert started == [(system, mode) for mode in ("base", "lora") for system in first_loraplex + first_vllm]
    assert turns == [
        {"mode": "base", "loraplex": 120.0, "vllm": 100.0},
        {"mode": "base", "loraplex": 100.0, "vllm": 80.0},
        {"mode": "lora", "loraplex": 130.0, "vllm": 100.0},
        {"mode": "lora", "loraplex": 30.0, "vllm": 90.0},
    ]
    summary = peer.summarize([], args, PeerWorkload(1, 1, 1, 1), turns=turns)
    assert summary["ratios"] == {
        "loraplex/vllm base (taking turns)": pytest.approx((1.2 + 1.25) / 2),
        "loraplex/vllm lora (taking turns)": pytest.approx((1.3 + 1 / 3) / 2),
    }
    peer.print_summary(summary)
    assert "loraplex/vllm base (taking turns): the median of loraplex/vllm tok/s 120.0/100.0, 100.0/80.0" in (
        capsys.readouterr().out
    )


def test_peer_with_turns_runs_both_systems_once_more_per_round_after_the_mode_runs(model, tmp_path, monkeypatch):
    argv = peer_argv(model, tmp_path, monkeypatch)
    drivers = []
    run_driver = peer.run_driver
    monkeypatch.setattr(peer, "run_driver", lambda *a: drivers.append(a[2:]) or run_driver(*a))
    summary = peer.main([*argv, "--modes", "base", "--turns", "2", "--json", str(tmp_path / "peer.json")])
    assert drivers == [("loraplex", "base"), ("vllm", "base")] * 2 + [("vllm", "base"), ("loraplex", "base")]
    assert [turn["mode"] for turn in summary["turns"]] == ["base", "base"]
    assert all(turn["loraplex"] > 0 and turn["vllm"] > 0 for turn in summary["turns"])
    assert "loraplex/vllm base (taking turns)" in summary["ratios"]
    with pytest.raises(SystemExit, match="--turns has loraplex and vLLM take turns"):
        peer.main([*argv, "--turns", "2", "--skip-loraplex"])


def test_peer_names_a_venv_without_vllm_and_bad_modes(tmp_path):
    with pytest.raises(BenchError, match="no bin/python"):
        peer.vllm_interpreter(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    with pytest.raises(BenchError, match="vllm does not import"):
        peer.vllm_interpreter(tmp_path)
    with pytest.raises(SystemExit, match="--modes takes base and lora"):
        peer.main(["--modes", "fast"])
    with pytest.raises(SystemExit, match="--pairs and --turns must be 0 or more, got -1 and 0"):
        peer.main(["--pairs", "-1"])
    with pytest.raises(SystemExit, match="--turns has loraplex and vLLM take turns: it needs --vllm-venv"):
        peer.main(["--turns", "2"])
    with pytest.raises(SystemExit, match=r"background load nice must be in .* got 25"):
        peer.main(["--background-load", "1", "--background-nice", "25"])


def test_server_thread_cpu_reads_the_main_and_the_engine_threads():
    import threading

    from bench import latency
    from engine.cpu_threads import name_os_thread

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burned, release = threading.Barrier(3), threading.Event()

    def worker() -> None:  # started by the named thread, as its OpenMP workers are: it inherits the name
        burn(0.1)
        burned.wait(30)
        release.wait(30)  # alive until read: /proc lists only live threads

    def engine_work() -> None:
        name_os_thread(latency.ENGINE_THREAD)  # as the AsyncEngine's thread does
        child = threading.Thread(target=worker)
        child.start()
        burn(0.1)
        burned.wait(30)
        release.wait(30)
        child.join()

    before = latency.server_thread_cpu_s(os.getpid())
    engine = threading.Thread(target=engine_work, name=latency.ENGINE_THREAD)
    engine.start()
    burn(0.15)  # this test runs on the process's main thread: a server's event loop
    burned.wait(30)
    after = latency.server_thread_cpu_s(os.getpid())
    release.set()
    engine.join()
    assert after["event_loop"] - before["event_loop"] >= 0.1
    assert after["engine_threads"] - before["engine_threads"] >= 0.15  # both named threads
    assert all(v != v for v in latency.server_thread_cpu_s(2**22 + 12345).values())  # no such process: NaN


def test_latency_runs_the_server_and_the_offline_engine_on_the_same_requests(model, tmp_path):
    from bench import latency

    base, adapters = model
    argv = ["--model", str(base), *(f"--lora={n}={p}" for n, p in adapters), "--threads", "1"]
    argv += ["--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--runs", "2", "--concurrency", "2,1"]
    result = latency.main([*argv, "--result-dir", str(tmp_path)])
    assert [run["concurrency"] for run in result["runs"]] == [1, 2]
    assert len(result["runs"][0]["throughputs"]) == 1  # the top concurrency alone runs --runs times
    top = result["runs"][-1]
    assert len(top["throughputs"]) == 2 and top["output_throughput"] == max(top["throughputs"])  # the upper median
    for run in result["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 4 * 6
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["tpot_ms"]["p50"] > 0
    assert result["offline"]["output_tok_s"] > 0 and len(result["offline"]["walls_s"]) == 4  # 2 runs before, 2 after
    expected = result["runs"][-1]["output_throughput"] / result["offline"]["output_tok_s"]
    assert result["server_over_offline"] == pytest.approx(expected)
    assert all(run["cpu_s"]["server"] > 0 and run["cpu_s"]["client"] > 0 for run in result["runs"])
    paired = result["paired"]  # CPU per output token: the server's and the client's, against the offline engine's
    assert len(paired["server_tok_s"]) == 2 and paired["server_over_offline"] > 0
    assert all(paired[f"{side}_cpu_ms_per_token"] > 0 for side in ("offline", "server", "client"))
    # engine steps a run: offline, the four prompts in one step, then five decode steps; the server's from /metrics
    assert paired["offline_steps"] == 6 and all(run["steps"] >= 4 * 6 / run["concurrency"] for run in result["runs"])
    for run in result["runs"]:  # the event loop's and the engine thread's shares of the server's CPU
        parts = run["cpu_s"]["server_event_loop"] + run["cpu_s"]["server_engine_threads"]
        assert 0 <= parts <= run["cpu_s"]["server"] + 0.05  # each counter read rounds down to a clock tick
    assert json.loads((tmp_path / "latency.json").read_text())["runs"][0]["concurrency"] == 1
    assert (tmp_path / "latency_vs_concurrency.png").stat().st_size > 0


def test_replicas_compares_adapter_routing_with_round_robin_on_the_same_requests(model, tmp_path):
    pytest.importorskip("ray.serve", reason="the Ray Serve mode needs the ray extra")
    from bench import replicas

    base, adapters = model
    argv = ["--model", str(base), *(f"--lora={n}={p}" for n, p in adapters), "--max-loras", "1"]
    argv += ["--num-prompts", "12", "--input-len", "8", "--output-len", "4", "--concurrency", "4"]
    result = replicas.main([*argv, "--result-dir", str(tmp_path)])
    assert [run["routing"] for run in result["runs"]] == ["adapter", "round-robin"]
    for run in result["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0 and run["total_output_tokens"] == 12 * 4
        # the replicas' own counters, differenced over the run: some loads, and at most two reads per request (Ray's
        # loader reads it; when Ray's one-slot LRU evicts it for another adapter before the request is admitted, the
        # engine reads it once more)
        assert 0 < run["adapter_loads_per_1000"] <= 2000 and 0 < run["activations_per_1000"] <= 2000
        assert run["ttft_ms"]["p50"] > 0
    assert json.loads((tmp_path / "replicas.json").read_text())["replicas"] == 2
    assert (tmp_path / "replica_routing.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--routing takes"):
        replicas.main([*argv, "--routing", "random"])


def test_tiny_is_the_random_llama_cut_to_one_layer_and_not_for_a_given_model(tmp_path):
    """`--tiny` (peer, latency, replicas): the random Llama with one layer of width 64 and the same vocabulary, its
    random adapters fitted to it; it cuts the random model only, so with --model it is refused, named."""
    import argparse

    from bench.engine import MODEL_56M

    parser = argparse.ArgumentParser()
    peer.add_model_options(parser)
    model, adapters, rank = peer.prepare_model(parser.parse_args(["--tiny", "--adapters", "2"]), tmp_path)
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (1, 64)
    assert config["vocab_size"] == MODEL_56M["vocab_size"]
    assert len(adapters) == 2 and rank == 8
    assert all(peer.adapter_rank(Path(path)) == 8 for _, path in adapters)
    default = peer.prepare_model(parser.parse_args(["--adapters", "0"]), tmp_path / "default")[0]
    assert json.loads((default / "config.json").read_text())["num_hidden_layers"] == MODEL_56M["num_hidden_layers"]
    with pytest.raises(BenchError, match="--tiny"):
        peer.prepare_model(parser.parse_args(["--tiny", "--model", str(model)]), tmp_path)


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="the kernel keeps no schedstat")
def test_a_threads_cpu_is_read_to_the_nanosecond_where_the_kernel_keeps_it():
    """13 ms burned by a thread (read once it waits, so its count is settled) read as 13 ms, not as one or two 10 ms
    clock ticks."""
    from bench import latency

    native_id, burned, release = [], threading.Event(), threading.Event()

    def worker() -> None:
        native_id.append(threading.get_native_id())
        end = time.thread_time() + 0.013
        while time.thread_time() < end:
            pass
        burned.set()
        release.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    assert burned.wait(30)
    task = Path(f"/proc/{os.getpid()}/task/{native_id[0]}")
    for _ in range(3000):  # until it sleeps in release.wait: its count is brought up to date when it leaves the CPU
        if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "S":
            break
        time.sleep(0.001)
    try:
        assert 0.013 <= latency.thread_cpu_s(task) < 0.016
    finally:
        release.set()
        thread.join()


def test_a_regex_holds_both_drivers_outputs_for_exactly_output_len_tokens(model, tmp_path):
    """`bench peer --regex`: loraplex's driver generates output_len tokens a request, all under the regex (read back
    from the engine's own text), and vLLM's is asked for the same regex with its EOS banned as long."""
    base, adapters = model
    held = PeerWorkload(num_prompts=5, input_len=12, output_len=6, runs=1, seed=3, regex="[a-c]+")
    workload_file = held.write(tmp_path / "regex.json", base, adapters, 8)
    assert json.loads(workload_file.read_text())["regex"] == "[a-c]+"
    result = offline_driver.main(["--workload", str(workload_file), "--threads", "1"])
    assert result["output_tokens"] == 5 * 6
    log = tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONPATH": str(FAKE_VLLM), "FAKE_VLLM_LOG": str(log)}
    command = [sys.executable, str(REPO / "bench" / "vllm_driver.py"), "--workload", str(workload_file)]
    subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    params = json.loads(log.read_text().splitlines()[-1])["body"]["params"]
    assert params["structured_outputs"] == {"regex": "[a-c]+"} and params["min_tokens"] == params["max_tokens"] == 6


def test_the_loraplex_driver_under_a_regex_writes_what_it_admits(model, tmp_path):
    """The driver's params, run with text on: every output is the regex's, output_len tokens long."""
    import re

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

    base, _ = model
    llm = LLM(model=str(base), device="cpu", cpu_threads=1)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=6, structured_outputs=StructuredOutputsParams(regex="[a-c]+")
    )
    outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
    assert all(len(o.outputs[0].token_ids) == 6 and re.fullmatch("[a-c]+", o.outputs[0].text) for o in outs)
