"""`loraplex bench replicas`: engine replicas on Ray Serve, Ray's multiplexed (adapter-affinity) routing against
round-robin, on the same skewed adapter traffic.

    loraplex bench replicas [--replicas 2] [--adapters 16] [--max-loras 4] [--popularity zipf:1.0]
                            [--num-prompts 400] [--concurrency 16] [--result-dir bench-results]

The random 56M Llama (or --model/--lora) with K random rank-8 adapters; each replica holds at most `--max-loras`
adapters on device rows and in host memory (so an adapter that is not resident must be read again). For each routing
in turn, one `loraplex serve --replicas N --replica-routing R` on a local Ray instance gets the same requests (token
ids, ignore_eos, adapters drawn by `--popularity`) streamed at `--concurrency`; the replicas' own counters
(GET /admin/replicas) give the adapter loads (disk → host memory) and activations (host → a device row) per 1,000
requests. Prints a table, writes replicas.json and replica_routing.png.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench import BenchError, plots
from bench.client import Target
from bench.metrics import summarize
from bench.peer import add_model_options, prepare_model
from bench.runner import RunLimits, run_requests
from bench.server_process import ServeProcess
from bench.workload import RequestSpec, choose_adapters

ADMIN_KEY = "bench-admin"
ROUTINGS = ("adapter", "round-robin")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex bench replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-num-cpus", type=float, default=1.0, help="each replica's CPUs (%(default)s)")
    add_model_options(parser, adapters=16)
    parser.add_argument("--max-loras", type=int, default=4, help="adapters one replica holds (%(default)s)")
    parser.add_argument("--popularity", default="zipf:1.0", help="adapter popularity law (%(default)s)")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (%(default)s)")
    parser.add_argument("--routing", default=",".join(ROUTINGS), help="routings to compare (%(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if not routings or any(r not in ROUTINGS for r in routings):
        raise SystemExit(f"loraplex bench replicas: --routing takes {', '.join(ROUTINGS)}, not {args.routing!r}")
    try:
        return measure(args, routings)
    except BenchError as e:
        raise SystemExit(f"loraplex bench replicas: {e}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests(args: argparse.Namespace, names: list[str], vocab_size: int, run: int) -> list[RequestSpec]:
    """The same adapters for every routing; fresh prompt ids per run (no prefix-cache hits across runs)."""
    picks = choose_adapters(args.popularity, args.num_prompts, len(names), np.random.default_rng(args.seed))
    rng = np.random.default_rng([args.seed, run])
    return [
        RequestSpec(i, names[a], rng.integers(3, vocab_size, args.input_len).tolist(), args.input_len,
                    args.output_len, 0.0)
        for i, a in enumerate(picks)
    ]  # fmt: skip


def replica_counters(url: str) -> dict:
    data = httpx.get(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60).json()
    engines = [r["engine"] for r in data["data"]]
    return {
        "replicas": len(engines),
        "adapter_loads": sum(e["adapter_loads"] for e in engines),
        "adapter_activations": sum(e["adapter_activations"] for e in engines),
    }


def measure(args: argparse.Namespace, routings: list[str]) -> dict:
    args.result_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="loraplex-replicas-") as tmp:
        model, adapters, rank = prepare_model(args, Path(tmp))
        if not adapters:
            raise BenchError("the comparison needs adapters (--adapters K, or --model with --lora)")
        names = [name for name, _ in adapters]
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        for index, routing in enumerate(routings):
            serve_args = [
                "--replicas", str(args.replicas), "--replica-routing", routing, "--port", str(free_port()),
                "--replica-num-cpus", str(args.replica_num_cpus), "--model", str(model),
                "--served-model-name", "bench-base", "--disable-auth", "--admin-key", ADMIN_KEY,
                "--database-url", f"sqlite:///{Path(tmp) / f'registry-{index}.db'}",
                "--adapter-cache-dir", str(Path(tmp) / "replica-cache"),
                "--device", "cpu", "--dtype", "float32", "--max-loras", str(args.max_loras),
                "--max-cpu-loras", str(args.max_loras), "--max-lora-rank", str(rank),
                "--max-model-len", str(args.input_len + args.output_len + 8), "--lora-modules",
                *(f"{name}={path}" for name, path in adapters),
            ]  # fmt: skip
            log = args.result_dir / f"replicas-{routing}-server.log"
            with ServeProcess(serve_args, log, start_timeout_s=600) as server:
                target = Target(url=server.url, endpoint="completions")
                warmup = [RequestSpec(i, name, [5] * 8, 8, 2, 0.0) for i, name in enumerate(names[: args.max_loras])]
                run_requests(warmup, target, RunLimits(show_progress=False))
                before = replica_counters(server.url)
                specs = requests(args, names, vocab_size, run=1)
                limits = RunLimits(max_concurrency=args.concurrency, label=routing)
                records, duration = run_requests(specs, target, limits)
                after = replica_counters(server.url)
            summary = summarize(records, duration)
            if summary["failed"]:
                raise BenchError(f"{summary['failed']} requests failed under {routing}: {summary['errors']}")
            per_1000 = 1000.0 / len(specs)
            runs.append(
                {
                    "routing": routing,
                    "adapter_loads_per_1000": (after["adapter_loads"] - before["adapter_loads"]) * per_1000,
                    "activations_per_1000": (after["adapter_activations"] - before["adapter_activations"]) * per_1000,
                    **{k: v for k, v in summary.items() if k != "per_adapter"},
                }
            )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "replicas": args.replicas,
        "adapters": len(names),
        "max_loras": args.max_loras,
        "popularity": args.popularity,
        "concurrency": args.concurrency,
        "runs": runs,
    }
    print_table(result)
    (args.result_dir / "replicas.json").write_text(json.dumps(result, indent=2))
    png = plots.replica_routing(runs, args.result_dir / "replica_routing.png")
    print(f"saved {args.result_dir / 'replicas.json'}, {png}")
    return result


def print_table(result: dict) -> None:
    print(
        f"\n{result['replicas']} replicas, K={result['adapters']} adapters ({result['popularity']}), "
        f"{result['max_loras']} per replica, concurrency {result['concurrency']}"
    )
    print(f"{'routing':>12}{'loads/1k':>10}{'activ./1k':>11}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}  (ms)")
    for run in result["runs"]:
        ttft = run["ttft_ms"]
        print(
            f"{run['routing']:>12}{run['adapter_loads_per_1000']:>10.1f}{run['activations_per_1000']:>11.1f}"
            f"{run['output_throughput']:>9.1f}{ttft['p50']:>10.1f}{ttft['p99']:>9.1f}"
        )
