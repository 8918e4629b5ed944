"""Two tenants, one at `--ratio` times the other's rate, under fcfs and fair scheduling (offline, same trace).

    loraplex bench fairness [--rate 1.0] [--ratio 10] [--duration 20] [--max-num-seqs 8] [--threads 2]
                            [--json out.json]

Poisson arrivals over `--duration` seconds: tenant "heavy" at ratio x rate requests/s, tenant "light" at rate;
each request has 64 random prompt tokens and 64 output tokens (ignore_eos), adapters drawn alike for both from
two random rank-8 adapters. The engine runs in this process, stepping in real time and taking each request at its
arrival time; both policies replay the same trace on the same engine settings. Reported per policy and tenant:
completed requests, output tokens/s, p50 / p99 latency (arrival to last token) and p50 queue time; plotted.
The random 56M Llama of `loraplex bench engine`, fp32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from adapters.ref import LoRARequest
from bench.engine import build_model
from bench.lora import make_adapters
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

TENANTS = ("heavy", "light")
PROMPT_LEN, OUTPUT_LEN = 64, 64


def trace(rate: float, ratio: float, duration: float, vocab: int, seed: int = 0) -> list[tuple[float, str, list[int]]]:
    """(arrival second, tenant, prompt ids), sorted by arrival: a Poisson process per tenant."""
    rng = random.Random(seed)
    arrivals = []
    for tenant, tenant_rate in (("heavy", rate * ratio), ("light", rate)):
        t = rng.expovariate(tenant_rate)
        while t < duration:
            arrivals.append((t, tenant, [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]))
            t += rng.expovariate(tenant_rate)
    return sorted(arrivals, key=lambda a: a[0])


def replay(engine: LLMEngine, arrivals, loras: list[LoRARequest]) -> list[dict]:
    """Feeds each request at its arrival time and steps until all finish; one record per request."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, detokenize=False)
    records: dict[str, dict] = {}
    start, pending = time.monotonic(), list(enumerate(arrivals))
    while pending or engine.has_unfinished:
        now = time.monotonic() - start
        while pending and pending[0][1][0] <= now:
            i, (at, tenant, prompt) = pending.pop(0)
            request_id = f"{tenant}-{i}"
            engine.add_request(EngineRequest(request_id, prompt, params, lora=loras[i % len(loras)], tenant=tenant))
            records[request_id] = {"tenant": tenant, "arrival": at, "tokens": 0}
        if not engine.has_unfinished:
            time.sleep(min(0.01, pending[0][1][0] - now) if pending else 0)
            continue
        for out in engine.step():
            record = records[out.request_id]
            record["tokens"] += out.num_completion_tokens
            if "queue_s" in out.metrics:
                record.setdefault("queue_s", out.metrics["queue_s"])
            if out.finished:
                record["latency"] = time.monotonic() - start - record["arrival"]
    return list(records.values())


def summarize(records: list[dict], wall: float) -> dict[str, dict]:
    summary = {}
    for tenant in TENANTS:
        rows = [r for r in records if r["tenant"] == tenant]
        latencies = sorted(r["latency"] for r in rows)
        summary[tenant] = {
            "requests": len(rows),
            "output_tok_s": sum(r["tokens"] for r in rows) / wall,
            "p50_latency_s": float(np.percentile(latencies, 50)),
            "p99_latency_s": float(np.percentile(latencies, 99)),
            "p50_queue_s": statistics.median(r.get("queue_s", 0.0) for r in rows),
        }
    return summary


def plot(results: dict[str, dict], path: Path) -> Path:
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    width = 0.35
    for ax, key, title in zip(axes, ("p50_latency_s", "p99_latency_s"), ("p50 latency", "p99 latency")):
        for offset, policy in zip((-width / 2, width / 2), results):
            values = [results[policy][t][key] for t in TENANTS]
            ax.bar(np.arange(len(TENANTS)) + offset, values, width, label=policy)
        ax.set_xticks(np.arange(len(TENANTS)), [f"{t} tenant" for t in TENANTS])
        ax.set(title=title, ylabel="seconds")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench fairness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.0, help="the light tenant's requests/s")
    parser.add_argument("--ratio", type=float, default=10.0, help="the heavy tenant's rate / the light one's")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench-results/fairness.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_model(Path(tmp) / "base")
        model = str(Path(tmp) / "base")
        loras = make_adapters(hf_model, Path(tmp), 2, rank=8)
        config = dict(model=model, device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
        results = {}
        for policy in ("fcfs", "fair"):
            engine = LLMEngine(
                EngineConfig(
                    **config,
                    cpu_threads=args.threads,
                    max_num_seqs=args.max_num_seqs,
                    enable_prefix_caching=False,
                    scheduling_policy=policy,
                )
            )
            for lora in loras:
                engine.add_adapter(lora)
            arrivals = trace(args.rate, args.ratio, args.duration, engine.runner.arch.vocab_size)
            start = time.monotonic()
            records = replay(engine, arrivals, loras)
            results[policy] = summarize(records, time.monotonic() - start)
            del engine
    print(f"\n{'policy':<8}{'tenant':<8}{'requests':>9}{'tok/s':>9}{'p50 s':>9}{'p99 s':>9}{'p50 queue s':>13}")
    for policy, tenants in results.items():
        for tenant, row in tenants.items():
            print(
                f"{policy:<8}{tenant:<8}{row['requests']:>9}{row['output_tok_s']:>9.1f}{row['p50_latency_s']:>9.2f}"
                f"{row['p99_latency_s']:>9.2f}{row['p50_queue_s']:>13.2f}"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    print(f"saved {args.json} and {plot(results, args.json.with_suffix('.png'))}")
    return results


if __name__ == "__main__":
    main()
