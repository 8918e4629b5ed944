"""What a benchmark prints and saves: the terminal table (after `vllm bench serve`'s) and the result JSON.

The JSON: {"config": {...}, "runs": [run, ...], "plots": [png paths]}, a run being the summary of
metrics.summarize plus num_adapters, adapters, base_model and per-request records under "requests".
"""

from __future__ import annotations

import json
from pathlib import Path

WIDTH = 60
MAX_ADAPTER_ROWS = 20  # the busiest; the JSON has them all


def print_run(run: dict) -> None:
    def line(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else ("-" if value is None else str(value))
        print(f"{label:<44}{text:>16}")

    title = f" Serving Benchmark Result (K={run['num_adapters']}) "
    print(f"{title:=^{WIDTH}}")
    line("Successful requests:", run["completed"])
    line("Failed requests:", run["failed"])
    line("Benchmark duration (s):", run["duration_s"])
    line("Total input tokens:", run["total_input_tokens"])
    line("Total generated tokens:", run["total_output_tokens"])
    line("Request throughput (req/s):", run["request_throughput"])
    line("Output token throughput (tok/s):", run["output_throughput"])
    line("Total token throughput (tok/s):", run["total_token_throughput"])
    for key, title, short in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("e2e_ms", "End-to-end Latency", "E2E"),
    ):
        print(f"{f' {title} ':-^{WIDTH}}")
        for stat, name in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            line(f"{name} {short} (ms):", run[key][stat])
    print(f"{' Per adapter ':-^{WIDTH}}")
    print(f"{'model':<24}{'reqs':>6}{'failed':>7}{'TTFT ms':>9}{'E2E ms':>9}{'out tok':>9}")
    for model, row in list(run["per_adapter"].items())[:MAX_ADAPTER_ROWS]:
        ttft, e2e = (f"{v:.1f}" if v is not None else "-" for v in (row["mean_ttft_ms"], row["mean_e2e_ms"]))
        print(f"{model[:23]:<24}{row['requests']:>6}{row['failed']:>7}{ttft:>9}{e2e:>9}{row['output_tokens']:>9}")
    if len(run["per_adapter"]) > MAX_ADAPTER_ROWS:
        print(f"... and {len(run['per_adapter']) - MAX_ADAPTER_ROWS} more adapters (see the JSON)")
    for error in run["errors"]:
        print(f"error x{error['count']}: {error['error'][:200]}")
    print("=" * WIDTH)


def print_runs_by_count(runs: list[dict]) -> None:
    """One line per run: the number of adapters against throughput and latency."""
    print(f"{'K':>6}{'ok':>7}{'failed':>7}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p99':>10}")
    for run in runs:
        ttft, e2e = run["ttft_ms"], run["e2e_ms"]
        cells = [ttft["p50"], ttft["p99"], e2e["p99"]]
        ms = "".join(f"{v:>10.1f}" if v is not None else f"{'-':>10}" for v in cells)
        print(
            f"{run['num_adapters']:>6}{run['completed']:>7}{run['failed']:>7}"
            f"{run['request_throughput']:>9.2f}{run['output_throughput']:>11.1f}{ms}"
        )


def write_result(path: Path, config: dict, runs: list[dict], plots: list[Path]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "runs": runs, "plots": [str(p) for p in plots]}
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
