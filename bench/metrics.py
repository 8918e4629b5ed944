"""A run's records summarized: throughputs, TTFT / TPOT / E2E percentiles, a row per adapter, errors by message.

Only completed requests count toward tokens, throughputs and latencies; failed ones are counted and grouped.
Input tokens are the server's usage.prompt_tokens where it gave them, else the workload's own count.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from bench.client import RequestRecord


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p99, max} in milliseconds; all None when there are no values."""
    if not values_s:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    ms = np.asarray(values_s) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
    return {"mean": float(ms.mean()), "p50": p50, "p90": p90, "p99": p99, "max": float(ms.max())}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.input_tokens if r.input_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_second,
        "output_throughput": output_tokens * per_second,
        "total_token_throughput": (input_tokens + output_tokens) * per_second,
        "ttft_ms": latency_stats([r.ttft_s for r in ok]),
        "tpot_ms": latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
        "errors": [{"error": e, "count": n} for e, n in Counter(r.error for r in records if not r.ok).most_common()],
        "per_adapter": per_adapter(records),
    }


def per_adapter(records: list[RequestRecord]) -> dict[str, dict]:
    """model name -> {requests, completed, failed, mean_ttft_ms, mean_e2e_ms, output_tokens}, busiest first."""
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.model].append(r)
    rows = {}
    for model, group in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        ok = [r for r in group if r.ok]
        rows[model] = {
            "requests": len(group),
            "completed": len(ok),
            "failed": len(group) - len(ok),
            "mean_ttft_ms": latency_stats([r.ttft_s for r in ok])["mean"],
            "mean_e2e_ms": latency_stats([r.e2e_s for r in ok])["mean"],
            "output_tokens": sum(r.output_tokens for r in ok),
        }
    return rows
