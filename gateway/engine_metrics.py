"""The engine's side of `/metrics`: an `EngineSnapshot` taken on the engine thread between steps (so its numbers
agree with each other), and the collector that renders the latest snapshot as Prometheus families."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from adapters.cache import AdapterCacheStats
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
SNAPSHOT_TIMEOUT_S = 2.0  # past this (a very long step) the numbers are read from the event loop instead


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    seqs_running: int
    seqs_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # blocks held by no sequence (prefix-cached ones included)
    adapters_on_device: int
    adapters_on_host: int
    adapters_pinned: int
    max_loras: int
    max_cpu_loras: int
    steps: int
    preemptions: int
    adapter_stats: AdapterCacheStats = field(default_factory=AdapterCacheStats)

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        cache, blocks = engine.adapter_cache, engine.block_manager
        return cls(
            seqs_running=len(engine.scheduler.running),
            seqs_waiting=len(engine.scheduler.waiting),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            adapters_on_device=cache.num_resident if cache else 0,
            adapters_on_host=cache.num_on_host if cache else 0,
            adapters_pinned=cache.num_pinned if cache else 0,
            max_loras=cache.max_loras if cache else 0,
            max_cpu_loras=cache.max_cpu_loras if cache else 0,
            steps=engine.stats.num_steps,
            preemptions=engine.scheduler.num_preemptions,
            adapter_stats=copy.copy(cache.stats) if cache else AdapterCacheStats(),
        )


async def snapshot(engine: AsyncEngine) -> EngineSnapshot:
    """On the engine thread between steps; read directly when the thread is gone or busy past the timeout
    (racy then, but only ints and lengths)."""
    if engine.is_alive:
        try:
            return await asyncio.wait_for(
                engine.run_on_engine(lambda: EngineSnapshot.of(engine.engine)), SNAPSHOT_TIMEOUT_S
            )
        except TimeoutError:
            logger.warning("engine snapshot timed out; reading the engine's numbers from the event loop")
    return EngineSnapshot.of(engine.engine)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class EngineCollector(Collector):
    """Renders `snapshot` (set just before each scrape is encoded); nothing before the first scrape."""

    def __init__(self):
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        a = s.adapter_stats
        yield _gauge("loraplex_seqs_running", "Sequences in the running batch.", s.seqs_running)
        yield _gauge("loraplex_seqs_waiting", "Sequences waiting to be scheduled.", s.seqs_waiting)
        yield _gauge(
            "loraplex_kv_blocks_used", "KV cache blocks held by sequences.", s.kv_blocks_total - s.kv_blocks_free
        )
        yield _gauge("loraplex_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield _gauge("loraplex_adapters_on_device", "Adapters resident in device rows.", s.adapters_on_device)
        yield _gauge("loraplex_adapters_on_host", "Adapters held in host memory.", s.adapters_on_host)
        yield _gauge("loraplex_adapters_pinned", "Device adapter rows pinned by running sequences.", s.adapters_pinned)
        yield _gauge("loraplex_adapter_device_slots", "Device adapter rows (max_loras).", s.max_loras)
        yield _gauge("loraplex_adapter_host_slots", "Host adapter slots (max_cpu_loras).", s.max_cpu_loras)
        yield SummaryMetricFamily(
            "loraplex_adapter_load_seconds",
            "Adapter loads from disk to host memory (count) and their total duration (sum).",
            count_value=a.loads,
            sum_value=a.load_seconds,
        )
        yield _counter("loraplex_adapter_load_failures", "Adapter loads that failed.", a.failures)
        yield _counter(
            "loraplex_adapter_activations", "Adapter copies from host memory to a device row.", a.activations
        )
        evictions = CounterMetricFamily("loraplex_adapter_evictions", "Adapters evicted, by tier.", labels=["tier"])
        evictions.add_metric(["device"], a.device_evictions)
        evictions.add_metric(["host"], a.host_evictions)
        yield evictions
        yield _counter("loraplex_engine_steps", "Engine steps run.", s.steps)
        yield _counter(
            "loraplex_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", s.preemptions
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())
