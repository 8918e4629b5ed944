"""The engine's side of `/metrics`: the `EngineSnapshot` that `AsyncEngine.stats()` takes on the engine thread
between steps (so its numbers agree with each other), and the collector that renders it as Prometheus families."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from engine.interface import AsyncEngine, EngineSnapshot

NO_TENANT = "_none"  # the tenant label when auth is off (tenant names start with a letter or digit)

logger = logging.getLogger(__name__)
SNAPSHOT_TIMEOUT_S = 2.0  # past this (a very long step) the scrape shows the previous snapshot


async def snapshot(engine: AsyncEngine) -> EngineSnapshot | None:
    """The engine's state now; None when the engine thread is busy past the timeout."""
    try:
        return await asyncio.wait_for(engine.stats(), SNAPSHOT_TIMEOUT_S)
    except TimeoutError:
        logger.warning("engine snapshot timed out; /metrics shows the previous one")
        return None


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class EngineCollector(Collector):
    """Renders `snapshot` (set just before each scrape is encoded); nothing before the first snapshot."""

    def __init__(self):
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield _gauge("loraplex_seqs_running", "Sequences in the running batch.", s.seqs_running)
        yield _gauge("loraplex_seqs_waiting", "Sequences waiting to be scheduled.", s.seqs_waiting)
        yield _gauge("loraplex_kv_blocks_used", "KV cache blocks held by sequences.", s.kv_blocks_used)
        yield _gauge("loraplex_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield _gauge("loraplex_adapters_on_device", "Adapters resident in device rows.", len(s.adapters_on_device))
        yield _gauge("loraplex_adapters_on_host", "Adapters held in host memory.", len(s.adapters_on_host))
        yield _gauge(
            "loraplex_adapters_pinned", "Device adapter rows pinned by running requests.", s.adapter_rows_pinned
        )
        if s.cpu_threads:
            yield _gauge(
                "loraplex_cpu_threads", "CPU: the engine's thread team, sized to the free cores.", s.cpu_threads
            )
        yield _gauge("loraplex_adapter_device_slots", "Device adapter rows (max_loras).", s.max_loras)
        yield _gauge("loraplex_adapter_host_slots", "Host adapter slots (max_cpu_loras).", s.max_cpu_loras)
        yield SummaryMetricFamily(
            "loraplex_adapter_load_seconds",
            "Adapter loads from disk to host memory (count) and their total duration (sum).",
            count_value=s.adapter_loads,
            sum_value=s.adapter_load_seconds,
        )
        yield _counter("loraplex_adapter_load_failures", "Adapter loads that failed.", s.adapter_load_failures)
        yield _counter(
            "loraplex_adapter_activations", "Adapter copies from host memory to a device row.", s.adapter_activations
        )
        service = CounterMetricFamily(
            "loraplex_tenant_service_tokens",
            "Service each tenant received from the engine, in weighted tokens computed (prompt x1, decode x2: the "
            "fair policy's virtual token counters before the tenant's weight).",
            labels=["tenant"],
        )
        for tenant, tokens in sorted(s.tenant_service.items()):
            service.add_metric([tenant or NO_TENANT], tokens)
        yield service
        evictions = CounterMetricFamily("loraplex_adapter_evictions", "Adapters evicted, by tier.", labels=["tier"])
        evictions.add_metric(["device"], s.adapter_device_evictions)
        evictions.add_metric(["host"], s.adapter_host_evictions)
        yield evictions
        yield _counter("loraplex_engine_steps", "Engine steps run.", s.steps)
        yield _counter(
            "loraplex_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", s.preemptions
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())
