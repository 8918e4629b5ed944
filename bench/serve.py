"""`loraplex bench serve`: drive a running OpenAI-compatible server (loraplex, vLLM, ...) over HTTP and report.

    loraplex bench serve --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --adapters 1,8,32 --popularity zipf:1.2 --input-len 128 --output-len 64

Streams every request; requests arrive as a Poisson process (all at once with --request-rate inf); each picks
one of the first K adapters that GET /v1/models lists for the base model (K = 0: the base model itself), by
the popularity law. Prints a table per K, writes a JSON result and PNG plots (latency CDFs; with several K,
throughput and latency against K).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

from bench import BenchError, plots
from bench.client import ENDPOINTS, Target, base_and_adapters, list_models
from bench.metrics import summarize
from bench.report import print_run, print_runs_by_count, write_result
from bench.runner import RunLimits, run_requests
from bench.workload import POPULARITY_LAWS, WorkloadOptions, build_requests, parse_popularity

SECRET_OPTIONS = ("api_key", "admin_key")  # never written to the result JSON


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """The target, the workload, the limits and the outputs: shared by `bench serve` and `bench sweep`."""
    target = parser.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root URL (%(default)s)")
    target.add_argument("--api-key", help="sent as Authorization: Bearer")
    target.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS), help="(%(default)s)")
    target.add_argument("--base-model", help="the base model's name; default: the first listed with parent null")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=int, default=100, help="requests per run (%(default)s)")
    workload.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; or inf (%(default)s)")
    workload.add_argument("--popularity", default="uniform", help=" | ".join(POPULARITY_LAWS) + " (%(default)s)")
    workload.add_argument("--input-len", type=int, default=128, help="synthetic: words or tokens (%(default)s)")
    workload.add_argument("--output-len", type=int, default=64, help="max_tokens, with ignore_eos (%(default)s)")
    workload.add_argument("--dataset", type=Path, help='JSON lines {"prompt": ..., "output_len"?: n}')
    workload.add_argument("--tokenizer", type=Path, help="a tokenizer directory: exact synthetic prompt lengths")
    workload.add_argument("--seed", type=int, default=0, help="(%(default)s)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--timeout", type=float, default=300.0, help="seconds per request (%(default)s)")
    limits.add_argument("--max-duration", type=float, default=1800.0, help="seconds per run, at most (%(default)s)")
    limits.add_argument("--max-concurrency", type=int, help="requests in flight at once; default unbounded")
    limits.add_argument("--disable-tqdm", action="store_true")
    output = parser.add_argument_group("output")
    output.add_argument("--result-dir", type=Path, default=Path("."), help="(%(default)s)")
    output.add_argument("--no-plots", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex bench serve",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--adapters", help="K, or several (1,8,32): use the first K listed adapters; default all")
    parser.add_argument("--adapter-names", help="comma-separated adapter names to use instead of /v1/models' list")
    add_common_options(parser)
    parser.add_argument("--result-json", type=Path, help="default: bench-serve-<timestamp>.json in --result-dir")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except BenchError as e:
        raise SystemExit(f"loraplex bench serve: {e}") from None


def serve(args: argparse.Namespace) -> dict:
    target, workload, limits = check_common_options(args)
    base, listed = base_and_adapters(list_models(target), args.base_model)
    pool = [n.strip() for n in args.adapter_names.split(",") if n.strip()] if args.adapter_names else listed
    counts = parse_counts(args.adapters) if args.adapters else [len(pool)]
    if max(counts) > len(pool):
        source = "--adapter-names gives" if args.adapter_names else f"{target.url}/v1/models lists"
        shown = ", ".join(pool[:8]) + (", ..." if len(pool) > 8 else "")
        raise BenchError(f"--adapters {max(counts)} needs {max(counts)} adapters, but {source} {len(pool)}: [{shown}]")
    runs = [run_once(workload, target, limits, base, pool[:k], i) for i, k in enumerate(counts)]
    path = args.result_json or Path(f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path = args.result_dir / path if not path.is_absolute() else path
    pngs = [] if args.no_plots else draw_plots(runs, path.parent, f"{path.stem}_")
    if len(runs) > 1:
        print_runs_by_count(runs)
    config = result_config(args, base)
    write_result(path, config, runs, pngs)
    print(f"saved {path}" + "".join(f"\nsaved {p}" for p in pngs))
    return {"config": config, "runs": runs, "plots": [str(p) for p in pngs], "result_json": path}


def check_common_options(args: argparse.Namespace) -> tuple[Target, WorkloadOptions, RunLimits]:
    parse_popularity(args.popularity)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.timeout > 0 and args.max_duration > 0) or (args.max_concurrency or 1) < 1:
        raise BenchError("--timeout, --max-duration and --max-concurrency must be positive")
    target = Target(args.url, args.api_key, args.endpoint, args.timeout)
    workload = WorkloadOptions(
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        popularity=args.popularity,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    return target, workload, RunLimits(args.max_concurrency, args.max_duration, not args.disable_tqdm)


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise BenchError(f"expected adapter counts like 1,8,32 (each >= 0), got {text!r}")
    return counts


def run_once(
    workload: WorkloadOptions, target: Target, limits: RunLimits, base: str, adapters: list[str], run_index: int = 0
) -> dict:
    """One run with these adapters (none: the base model); its summary and per-request records, table printed."""
    specs = build_requests(workload, base, adapters, run_index)
    label = f"K={len(adapters)}"
    records, duration = run_requests(specs, target, RunLimits(**{**asdict(limits), "label": label}))
    requests = [{**asdict(r), "tpot_s": r.tpot_s} for r in records]
    run = {"num_adapters": len(adapters), "adapters": adapters, "base_model": base, **summarize(records, duration)}
    print_run(run)
    return {**run, "requests": requests}


def draw_plots(runs: list[dict], directory: Path, prefix: str = "", vs_adapters: bool = False) -> list[Path]:
    """Latency CDFs; throughput and latency against K too when there are several runs (or `vs_adapters`)."""
    pngs = [plots.latency_cdfs(runs, directory / f"{prefix}latency_cdf.png")]
    if vs_adapters or len(runs) > 1:
        pngs.append(plots.throughput_vs_adapters(runs, directory / f"{prefix}throughput_vs_adapters.png"))
        pngs.append(plots.latency_vs_adapters(runs, directory / f"{prefix}latency_vs_adapters.png"))
    return pngs


def result_config(args: argparse.Namespace, base: str) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in SECRET_OPTIONS}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate  # JSON has no inf
    return {**config, "base_model": base}


if __name__ == "__main__":
    main()
