"""`loraplex bench latency`: the server against the offline engine on the same requests, and TTFT / TPOT by
concurrency, through a real `loraplex serve` on 127.0.0.1.

    loraplex bench latency [--threads 2] [--adapters 8] [--concurrency 1,16,64] [--stream-interval 1] [--tiny]
                           [--result-dir bench-results]

The W1 workload of `bench peer` (the random 56M Llama, K random rank-8 adapters, 64 requests of 128 prompt token
ids and 64 output tokens, greedy, ignore_eos, adapters drawn uniformly). The offline engine runs the requests
(python -m bench.offline_driver) before the server and again after it, the median of all its runs counting; in
between one `loraplex serve` (no auth, its own SQLite registry, the same engine options) gets the same kind of
requests (fresh prompt ids each time, so no run hits the prefix cache) streamed over HTTP, at each concurrency in
turn, after a warm-up request per adapter; the highest concurrency runs --runs times too, and its median run
counts. Server / offline there is the gateway's whole overhead: HTTP, tokens to text, SSE, accounting, and
requests arriving over time instead of all at once. Each run at the highest concurrency also follows one offline
run of its own (the server idle meanwhile), and the median of those pairs' ratios is printed beside the first: on a
host whose speed drifts by 20% within minutes the runs before and after the server can miss what the server met.
Those pairs also compare CPU time per output token: the offline engine's (its process, every thread), the server's
(its process: engine, event loop, tokenizer, accounting) and the benchmark client's (this process), so that what
the gateway costs shows apart from what the client, sharing the cores, takes from it, and engine steps a run (the
offline engine's count, the server's from its /metrics): more steps mean smaller batches, the same steps dearer ones.
With --tiny the random Llama is cut to one layer of width 64: its engine costs next to nothing, so the server's
CPU a token (its event loop's, the gateway's Python and socket writes) is the gateway's own, apart from the engine's.
Prints a table, writes latency.json and latency_vs_concurrency.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import BenchError, plots
from bench.client import Target
from bench.idle_check import warn_if_busy
from bench.metrics import summarize
from bench.peer import add_model_options, prepare_model, run_driver
from bench.peer_workload import PeerWorkload
from bench.runner import RunLimits, run_requests
from bench.server_process import ServeProcess
from bench.workload import RequestSpec
from engine.cpu_threads import stat_cpu_s


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex bench latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="the engine's cpu threads, both ways (%(default)s)")
    parser.add_argument("--concurrency", default="1,16,64", help="requests in flight, one run each (%(default)s)")
    add_model_options(parser)  # --adapters 0: the base model
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="offline, and at the top concurrency (%(default)s)")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval: steps per SSE chunk (%(default)s)",
    )
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(
            f"loraplex bench latency: --concurrency takes numbers like 1,16,64, not {args.concurrency!r}"
        ) from None
    if not levels or levels[0] < 1:
        raise SystemExit("loraplex bench latency: every --concurrency must be at least 1")
    try:
        return measure(args, levels)
    except BenchError as e:
        raise SystemExit(f"loraplex bench latency: {e}") from None


def measure(args: argparse.Namespace, levels: list[int]) -> dict:
    workload = PeerWorkload(args.num_prompts, args.input_len, args.output_len, args.runs)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loraplex-latency-") as tmp:
        model, adapters, rank = prepare_model(args, Path(tmp))
        workload_file = workload.write(Path(tmp) / "workload.json", model, adapters, rank)
        body = json.loads(workload_file.read_text())
        pair_file = replace(workload, runs=1).write(Path(tmp) / "pair-workload.json", model, adapters, rank)
        busy_before = warn_if_busy()
        before = run_offline(workload_file, args.threads, bool(adapters))
        pairs: list[tuple[dict, dict]] = []  # (offline run, server run) back to back at the top level
        names = [name for name, _ in adapters]
        served = "bench-base"
        serve_args = [
            "--model", str(model), "--served-model-name", served, "--disable-auth",
            "--database-url", f"sqlite:///{Path(tmp) / 'registry.db'}", "--device", "cpu", "--dtype", "float32",
            "--cpu-threads", str(args.threads), "--max-num-seqs", str(body["max_num_seqs"]),
            "--max-model-len", str(body["max_model_len"]), "--stream-interval", str(args.stream_interval),
        ]  # fmt: skip
        if adapters:
            serve_args += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(rank), "--lora-modules"]
            serve_args += [f"{name}={path}" for name, path in adapters]
        runs = []
        with ServeProcess(serve_args, args.result_dir / "latency-server.log") as server:
            target = Target(url=server.url, endpoint="completions")
            model_of = (lambda a: names[a]) if names else (lambda a: served)
            warmup = [spec(i, ids, model_of(a), 4) for i, (ids, a) in enumerate(body["warmup"])]
            run_requests(warmup, target, RunLimits(show_progress=False))
            vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            for level in levels:  # fresh prompts each time, like the offline runs: no prefix-cache hits
                repeats = []
                for repeat in range(args.runs if level == levels[-1] else 1):
                    fresh = workload.requests(vocab_size, len(adapters), run=1000 * (repeat + 1) + level)
                    specs = [spec(i, ids, model_of(a), args.output_len) for i, (ids, a) in enumerate(fresh)]
                    alone = run_offline(pair_file, args.threads, bool(adapters)) if level == levels[-1] else None
                    repeats.append(serve_run(specs, target, level, server.process.pid))
                    if alone is not None:
                        pairs.append((alone, repeats[-1]))
                repeats.sort(key=lambda run: run["output_throughput"])  # the median run (the upper one of two)
                runs.append({**repeats[len(repeats) // 2], "throughputs": [r["output_throughput"] for r in repeats]})
        offline = both_sides(before, run_offline(workload_file, args.threads, bool(adapters)))
    top = runs[-1]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": args.threads,
        "stream_interval": args.stream_interval,
        "adapters": len(adapters),
        "offline": offline,
        "runs": runs,
        "server_over_offline": top["output_throughput"] / offline["output_tok_s"],
        "paired": paired_figures(pairs),
        "busy_before": busy_before,
    }
    print_table(result)
    (args.result_dir / "latency.json").write_text(json.dumps(result, indent=2))
    png = plots.latency_vs_concurrency(runs, args.result_dir / "latency_vs_concurrency.png")
    print(f"saved {args.result_dir / 'latency.json'}, {png}")
    return result


def serve_run(specs: list[RequestSpec], target: Target, level: int, server_pid: int) -> dict:
    """One run of `specs` through the server, `level` in flight: its summary (per-adapter rows left out), the CPU
    seconds the server and this process (the client) spent meanwhile, and the server's engine steps."""
    steps_before = engine_steps(target.url)
    server_cpu, client_cpu = process_cpu_s(server_pid), time.process_time()
    threads_before = server_thread_cpu_s(server_pid)  # the threads' window inside the process's: their parts fit it
    summary = summarize(*run_requests(specs, target, RunLimits(max_concurrency=level, label=f"c={level}")))
    threads = server_thread_cpu_s(server_pid)
    steps = engine_steps(target.url) - steps_before
    cpu_s = {"server": process_cpu_s(server_pid) - server_cpu, "client": time.process_time() - client_cpu}
    cpu_s.update({f"server_{kind}": seconds - threads_before[kind] for kind, seconds in threads.items()})
    if summary["failed"]:
        raise BenchError(f"{summary['failed']} requests failed at concurrency {level}: {summary['errors']}")
    summary = {k: v for k, v in summary.items() if k != "per_adapter"}
    return {"concurrency": level, **summary, "cpu_s": cpu_s, "steps": steps}


def engine_steps(url: str) -> float:
    """The server's engine steps so far, from its /metrics (which answers loopback clients); NaN where unread."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return float("nan")
    families = {family.name: family for family in text_string_to_metric_families(text)}
    steps = families.get("loraplex_engine_steps")
    return steps.samples[0].value if steps is not None else float("nan")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, every thread (/proc/PID/stat); NaN without /proc."""
    try:
        return stat_cpu_s(Path(f"/proc/{pid}/stat"))
    except OSError:
        return float("nan")


# The AsyncEngine's thread, named in the OS; the OpenMP workers it starts inherit the name (Linux copies a thread's
# name to the threads it creates), so the name covers the engine's whole team.
ENGINE_THREAD = "loraplex-engine"


def server_thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's event loop (its main thread, which runs uvicorn) and of the engine's
    threads (its own, which runs the steps' Python, and its OpenMP team); NaN without /proc."""
    totals = {"event_loop": 0.0, "engine_threads": 0.0}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            name = (task / "comm").read_text().strip()
            kind = "event_loop" if task.name == str(pid) else "engine_threads" if name == ENGINE_THREAD else None
            if kind is not None:
                totals[kind] += thread_cpu_s(task)
    except OSError:  # no /proc, or the server went away
        return {kind: float("nan") for kind in totals}
    return totals


def thread_cpu_s(task: Path) -> float:
    """CPU seconds so far of one thread (/proc/PID/task/TID): its schedstat's nanoseconds on a CPU where the kernel
    keeps them, else its stat's clock ticks. Ticks are 10 ms: an event loop's ~130 ms of CPU in a run at 64 streams on
    a fast CPU read one tick more or less from run to run, 8% of the figure."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return stat_cpu_s(task / "stat")


def paired_figures(pairs: list[tuple[dict, dict]]) -> dict:
    """Each top-concurrency server run against the offline run just before it: throughputs, their ratio's median,
    and the medians of CPU milliseconds per output token (offline engine, server, client)."""
    offline_tok_s = [alone["output_tokens"] / alone["walls_s"][0] for alone, _ in pairs]
    server_tok_s = [served["output_throughput"] for _, served in pairs]

    def per_token(cpu_s: float, tokens: int) -> float:
        return 1e3 * cpu_s / tokens

    return {
        "offline_tok_s": offline_tok_s,
        "server_tok_s": server_tok_s,
        "server_over_offline": statistics.median(s / o for o, s in zip(offline_tok_s, server_tok_s)),
        "offline_cpu_ms_per_token": statistics.median(per_token(a["cpu_s"][0], a["output_tokens"]) for a, _ in pairs),
        "offline_steps": statistics.median(alone["steps"][0] for alone, _ in pairs),
        "server_steps": statistics.median(served["steps"] for _, served in pairs),
        **{
            f"{part}_cpu_ms_per_token": statistics.median(
                per_token(s["cpu_s"][part], s["total_output_tokens"]) for _, s in pairs
            )
            for part in ("server", "client", "server_event_loop", "server_engine_threads")
        },
    }


def spec(index: int, prompt_ids: list[int], model: str, output_len: int) -> RequestSpec:
    return RequestSpec(index, model, prompt_ids, len(prompt_ids), output_len, 0.0)


def run_offline(workload_file: Path, threads: int, with_lora: bool) -> dict:
    command = [sys.executable, "-m", "bench.offline_driver", "--workload", str(workload_file)]
    command += ["--threads", str(threads)] + ([] if with_lora else ["--no-lora"])
    result = run_driver(command, dict(os.environ), "loraplex offline", "lora" if with_lora else "base")
    return {k: result[k] for k in ("output_tokens", "walls_s", "cpu_s", "steps")}


def both_sides(before: dict, after: dict) -> dict:
    """The offline runs before the server and after it, as one median: a machine whose speed drifts (a VM's does,
    by several percent within minutes) moves both sides of the ratio alike."""
    walls = before["walls_s"] + after["walls_s"]
    wall = statistics.median(walls)
    return {"wall_s": wall, "output_tok_s": before["output_tokens"] / wall, "walls_s": walls}


def print_table(result: dict) -> None:
    offline = result["offline"]
    print(f"\noffline engine: {offline['output_tok_s']:.1f} output tok/s (median {offline['wall_s']:.2f} s)")
    print(f"{'concurrency':>11}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}  (ms)")
    for run in result["runs"]:
        ttft, tpot = run["ttft_ms"], run["tpot_ms"]
        print(
            f"{run['concurrency']:>11}{run['output_throughput']:>9.1f}{ttft['p50']:>10.1f}{ttft['p99']:>9.1f}"
            f"{tpot['p50']:>10.2f}{tpot['p99']:>8.2f}"
        )
    top = result["runs"][-1]
    runs = ", ".join(f"{t:.1f}" for t in top["throughputs"])
    print(f"server at concurrency {top['concurrency']} / offline: {result['server_over_offline']:.2f} (runs: {runs})")
    paired = result["paired"]
    pairs = ", ".join(f"{s:.1f}/{o:.1f}" for o, s in zip(paired["offline_tok_s"], paired["server_tok_s"]))
    print(f"each run after an offline run of its own: {paired['server_over_offline']:.2f} (server/offline: {pairs})")
    offline_ms, server_ms = paired["offline_cpu_ms_per_token"], paired["server_cpu_ms_per_token"]
    client_ms = paired["client_cpu_ms_per_token"]
    print(f"CPU per output token (medians of those pairs): offline engine {offline_ms:.2f} ms, server "
          f"{server_ms:.2f} ms ({server_ms / offline_ms - 1:+.0%}), client {client_ms:.2f} ms")  # fmt: skip
    loop_ms, engine_ms = paired["server_event_loop_cpu_ms_per_token"], paired["server_engine_threads_cpu_ms_per_token"]
    print(f"  the server's: event loop {loop_ms:.3f} ms, engine threads {engine_ms:.2f} ms (its own and its "
          f"OpenMP team), other threads {server_ms - loop_ms - engine_ms:.2f} ms")  # fmt: skip
    print(f"engine steps a run (medians of those pairs): offline {paired['offline_steps']:.0f}, server "
          f"{paired['server_steps']:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
