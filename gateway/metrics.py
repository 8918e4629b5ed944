"""GatewayMetrics: the Prometheus metrics `/metrics` exposes, in a registry of their own (not the process-global
one: several servers may share a process).

Gateway side, counted as requests end: `/v1` requests and their tokens by (tenant, adapter), time to first
token, time per output token, request latency, and every HTTP error by status code. Engine side: gauges and
counters read from an `EngineSnapshot` at scrape time (see gateway/engine_metrics.py).

Labels: `tenant` is the tenant's name, `_none` when auth is off; `adapter` is the adapter's name, `_base` for
the base model (registry names start with a letter or digit, so neither can collide with a real one).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder

from engine.interface import EngineSnapshot, RequestOutput
from gateway.engine_metrics import NO_TENANT, EngineCollector

if TYPE_CHECKING:
    from gateway.generation import Usage

BASE_ADAPTER = "_base"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
ADAPTER_TIERS = ("device", "host", "disk")  # warmest first
ADAPTER_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class Latency:
    """Token timing of one generation: its start, its first token, and each sequence's first and last token."""

    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    queue_s: float | None = None  # the longest engine queue time of its prompts (admission to first step)
    adapter_load_s: float = 0.0  # the longest wait for its adapter to reach a device row
    adapter_tier: str | None = None  # where its adapter was on arrival: device, host or disk
    # (prompt index, sample index) -> [first token time, last token time, tokens after the first delta]
    _seqs: dict[tuple[int, int], list] = field(default_factory=dict)

    def on_delta(self, prompt_index: int, out: RequestOutput) -> None:
        now = time.monotonic()
        if "queue_s" in out.metrics:
            self.queue_s = max(self.queue_s or 0.0, out.metrics["queue_s"])
            self.adapter_load_s = max(self.adapter_load_s, out.metrics["adapter_load_s"])
        if out.adapter_tier is not None:  # the coldest of its prompts' tiers
            self.adapter_tier = max(filter(None, (self.adapter_tier, out.adapter_tier)), key=ADAPTER_TIERS.index)
        for delta in out.outputs:
            if not delta.token_ids:
                continue
            if self.first_token is None:
                self.first_token = now
            seq = self._seqs.get((prompt_index, delta.index))
            if seq is None:
                self._seqs[(prompt_index, delta.index)] = [now, now, 0]
            else:
                seq[1], seq[2] = now, seq[2] + len(delta.token_ids)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def tpots(self) -> list[float]:
        """Per sequence with more than one token: seconds per token after its first."""
        return [(last - first) / n for first, last, n in self._seqs.values() if n > 0]


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        by_request = ["tenant", "adapter"]
        self.requests = Counter(
            "loraplex_requests",
            "Generation requests that ended, by tenant, adapter, endpoint and outcome (completed | aborted | failed).",
            [*by_request, "endpoint", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of ended requests.", by_request, registry=self.registry
        )
        self.completion_tokens = Counter(
            "loraplex_completion_tokens", "Completion tokens generated.", by_request, registry=self.registry
        )
        self.cached_tokens = Counter(
            "loraplex_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            by_request,
            registry=self.registry,
        )
        self.errors = Counter(
            "loraplex_http_errors",
            "Error answers by HTTP status code (mid-stream errors included).",
            ["code"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "From the start of a request's generation (after admission and tokenization) to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds",
            "Per sequence: seconds per output token after its first.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "loraplex_request_latency_seconds",
            "From the start of a request's generation to its end.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "loraplex_queue_time_seconds",
            "Per request, by tenant: from reaching the engine to its first scheduled step (adapter loads included).",
            ["tenant"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.adapter_load = Histogram(
            "loraplex_adapter_load_delay_seconds",
            "Per request with an adapter: how long its adapter's load held it back, by the tier the adapter was in "
            "when the request came (device: 0; host: copied to a row; disk: read, validated, copied).",
            ["tier"],
            buckets=ADAPTER_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.engine = EngineCollector()
        self.registry.register(self.engine)

    def request(self, tenant: str | None, adapter: str, endpoint: str) -> RequestMetrics:
        return RequestMetrics(self, tenant or NO_TENANT, adapter or BASE_ADAPTER, endpoint)

    def count_error(self, status_code: int) -> None:
        self.errors.labels(code=str(status_code)).inc()

    def render(self, snapshot: EngineSnapshot | None, accept: str | None) -> tuple[bytes, str]:
        """(body, content type): the text format, or OpenMetrics when `accept` asks for it. A None snapshot (the
        engine was too busy to answer) leaves the previous one in place."""
        encoder, content_type = choose_encoder(accept or "")
        if snapshot is not None:
            self.engine.snapshot = snapshot  # no await between this and the encoding: scrapes cannot interleave
        return encoder(self.registry), content_type


@dataclass(slots=True)
class RequestMetrics:
    """One request's labels bound to the gateway's metrics; its generation calls `observe` once, at the end."""

    metrics: GatewayMetrics
    tenant: str
    adapter: str
    endpoint: str  # "completions" | "chat" | "responses"

    def observe(self, usage: Usage, outcome: str, latency: Latency) -> None:
        m, labels = self.metrics, (self.tenant, self.adapter)
        m.requests.labels(*labels, self.endpoint, outcome).inc()
        m.prompt_tokens.labels(*labels).inc(usage.prompt_tokens)
        m.completion_tokens.labels(*labels).inc(usage.completion_tokens)
        m.cached_tokens.labels(*labels).inc(usage.cached_tokens)
        if latency.ttft is not None:
            m.ttft.observe(latency.ttft)
        for tpot in latency.tpots():
            m.tpot.observe(tpot)
        m.latency.observe(time.monotonic() - latency.start)
        if latency.queue_s is not None:
            m.queue_time.labels(self.tenant).observe(latency.queue_s)
        if latency.adapter_tier is not None:
            m.adapter_load.labels(latency.adapter_tier).observe(latency.adapter_load_s)


class ErrorCounter:
    """ASGI middleware: counts every HTTP answer with status >= 400 by code, unhandled exceptions as 500s."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = getattr(scope["app"].state, "gateway", None)
        metrics: GatewayMetrics | None = getattr(state, "metrics", None)
        if metrics is None:
            await self.app(scope, receive, send)
            return
        started = False

        def counted_send(message) -> Awaitable[None]:  # send's own awaitable: no coroutine of its own per chunk
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    metrics.count_error(message["status"])
            return send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception:
            if not started:
                metrics.count_error(500)  # Starlette's outer error middleware answers it
            raise
