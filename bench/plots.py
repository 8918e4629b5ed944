"""The benchmark's PNGs: latency CDFs per run, throughput and latency against K adapters.

Plain matplotlib Figures rendered by Agg: no pyplot, so no global backend or figure state is touched.
The K axis is symlog, so K = 0 (base only) sits beside 1, 8, 32, ...
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator


def latency_cdfs(runs: list[dict], path: Path) -> Path:
    """TTFT and E2E CDFs, one curve per run."""
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for ax, key, title in zip(axes, ("ttft_s", "e2e_s"), ("Time to first token", "End-to-end latency")):
        for run in runs:
            ms = np.sort([r[key] * 1000.0 for r in run["requests"] if r["ok"]])
            if len(ms):
                ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=f"K={run['num_adapters']}")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return _save(fig, path)


def throughput_vs_adapters(runs: list[dict], path: Path, title: str = "Throughput vs number of adapters") -> Path:
    """Output tokens/s (left axis) and requests/s (right axis) against K."""
    ks = [run["num_adapters"] for run in runs]
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    ax.plot(ks, [run["output_throughput"] for run in runs], "o-", color="tab:blue", label="output tokens/s")
    ax.set(title=title, xlabel="number of adapters (K)", ylabel="output tokens / s", ylim=(0, None))
    right = ax.twinx()
    right.plot(ks, [run["request_throughput"] for run in runs], "s--", color="tab:orange", label="requests/s")
    right.set(ylabel="requests / s", ylim=(0, None))
    _k_axis(ax, ks)
    fig.legend(loc="lower left", bbox_to_anchor=(0.12, 0.14))
    return _save(fig, path)


def latency_vs_adapters(runs: list[dict], path: Path) -> Path:
    """p50 and p99 of TTFT and E2E against K."""
    panels = (("ttft_ms", "Time to first token"), ("e2e_ms", "End-to-end latency"))
    return _p50_p99(runs, [run["num_adapters"] for run in runs], panels, "number of adapters (K)", path)


def _k_axis(ax, ks: list[int]) -> None:
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.xaxis.set_minor_locator(NullLocator())
    low, high = min(ks), max(ks)
    ax.set_xlim(low - 0.5 if low < 1 else low / 1.5, high * 1.5)  # no empty decades before the first K
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def latency_vs_concurrency(runs: list[dict], path: Path) -> Path:
    """p50 and p99 of TTFT and TPOT against the number of requests in flight."""
    panels = (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token"))
    return _p50_p99(runs, [run["concurrency"] for run in runs], panels, "concurrent requests", path)


def _p50_p99(runs: list[dict], xs: list[int], panels: tuple[tuple[str, str], ...], xlabel: str, path: Path) -> Path:
    """One panel per (latency key, title): its p50 and p99 against xs (one per run), log-like x axis."""
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, len(panels))
    for ax, (key, title) in zip(axes, panels):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            values = [run[key][stat] if run[key][stat] is not None else np.nan for run in runs]
            ax.plot(xs, values, style, label=stat)
        ax.set(title=title, xlabel=xlabel, ylabel="ms", ylim=(0, None))
        _k_axis(ax, xs)
        ax.legend()
    return _save(fig, path)


def replica_routing(runs: list[dict], path: Path) -> Path:
    """One bar per routing in three panels: adapter loads and activations per 1,000 requests, output tokens/s,
    TTFT p50 and p99."""
    labels = [run["routing"] for run in runs]
    x = np.arange(len(runs))
    fig = Figure(figsize=(12, 4))
    loads, throughput, ttft = fig.subplots(1, 3)
    loads.bar(x - 0.2, [run["adapter_loads_per_1000"] for run in runs], 0.4, label="loads (disk → host)")
    loads.bar(x + 0.2, [run["activations_per_1000"] for run in runs], 0.4, label="activations (host → device)")
    loads.set(title="Adapter loads per 1,000 requests", ylabel="per 1,000 requests")
    loads.legend(loc="upper left")
    throughput.bar(x, [run["output_throughput"] for run in runs], 0.5, color="tab:green")
    throughput.set(title="Throughput", ylabel="output tokens / s")
    ttft.bar(x - 0.2, [run["ttft_ms"]["p50"] for run in runs], 0.4, label="p50")
    ttft.bar(x + 0.2, [run["ttft_ms"]["p99"] for run in runs], 0.4, label="p99")
    ttft.set(title="Time to first token", ylabel="ms")
    ttft.legend()
    for ax in (loads, throughput, ttft):
        ax.set_xticks(x, labels)
    return _save(fig, path)
