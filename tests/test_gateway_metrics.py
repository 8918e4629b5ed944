"""`/metrics` parses with prometheus_client's own parsers and its counters move by exactly what the test sent:
requests and tokens by adapter, errors by status code, latency histograms, and the engine's gauges."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for

SCRAPER = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /metrics needs a key once one is set

EXACT = {"ignore_eos": True}
MANY = 480  # tokens: far more than a stream the test leaves after its first chunk
NO_TENANT, BASE_ADAPTER = "_none", "_base"

Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    root, _, adapters = build_tiny(tmp_path_factory.mktemp("metrics"), tokenizer, {"sql": 4, "poem": 8})
    with ServerThread(settings_for(root, adapters)) as running:
        yield running


@pytest.fixture
def api(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(server) -> Samples:
    response = httpx.get(f"{server.url}/metrics", headers=SCRAPER, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_move_by_what_was_sent(server, api):
    before = scrape(server)
    completions = [
        api.completions.create(model="sql", prompt=f"request {i}", max_tokens=5, extra_body=EXACT).usage
        for i in range(3)
    ]
    chats = []
    for i in range(2):
        stream = api.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
        )
        chats.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="sql", prompt="x", temperature=-1)
    assert httpx.get(f"{server.url}/no/such/route").status_code == 404
    after = scrape(server)

    sql = {"tenant": NO_TENANT, "adapter": "sql"}
    base = {"tenant": NO_TENANT, "adapter": BASE_ADAPTER}
    assert delta(before, after, "loraplex_requests_total", **sql, endpoint="completions", outcome="completed") == 3
    assert delta(before, after, "loraplex_requests_total", **base, endpoint="chat", outcome="completed") == 2
    for usages, labels in ((completions, sql), (chats, base)):
        want_prompt = sum(u.prompt_tokens for u in usages)
        want_completion = sum(u.completion_tokens for u in usages)
        assert delta(before, after, "loraplex_prompt_tokens_total", **labels) == want_prompt
        assert delta(before, after, "loraplex_completion_tokens_total", **labels) == want_completion
    assert sum(u.completion_tokens for u in completions) == 15
    assert delta(before, after, "loraplex_http_errors_total", code="404") == 2
    assert delta(before, after, "loraplex_http_errors_total", code="400") == 1
    for histogram in ("time_to_first_token", "time_per_output_token", "request_latency"):
        assert delta(before, after, f"loraplex_{histogram}_seconds_count") == 5, histogram
        assert delta(before, after, f"loraplex_{histogram}_seconds_sum") > 0, histogram
    assert value(after, "loraplex_time_to_first_token_seconds_bucket", le="+Inf") == value(
        after, "loraplex_time_to_first_token_seconds_count"
    )


def test_engine_gauges_when_idle(server, api):
    api.completions.create(model="poem", prompt="hi", max_tokens=2, extra_body=EXACT)
    samples = scrape(server)
    assert value(samples, "loraplex_kv_blocks_total") > 0
    assert value(samples, "loraplex_kv_blocks_used") == 0
    assert value(samples, "loraplex_seqs_running") == value(samples, "loraplex_seqs_waiting") == 0
    assert value(samples, "loraplex_adapters_on_device") >= 1
    assert value(samples, "loraplex_adapters_on_host") >= value(samples, "loraplex_adapters_on_device")
    assert value(samples, "loraplex_adapters_pinned") == 0
    assert value(samples, "loraplex_adapter_device_slots") == 2
    assert 1 <= value(samples, "loraplex_cpu_threads") <= (os.cpu_count() or 1)
    assert value(samples, "loraplex_adapter_load_seconds_count") >= 2  # both adapters were read from disk
    assert value(samples, "loraplex_adapter_load_seconds_sum") > 0
    assert value(samples, "loraplex_adapter_load_failures_total") == 0
    assert value(samples, "loraplex_engine_steps_total") > 0
    for tier in ("device", "host"):
        assert ("loraplex_adapter_evictions_total", frozenset({("tier", tier)})) in samples


def test_a_stream_the_client_leaves_counts_as_aborted(server, api):
    labels = {"tenant": NO_TENANT, "adapter": "poem", "endpoint": "completions", "outcome": "aborted"}
    before = scrape(server)
    stream = api.completions.create(model="poem", prompt="go on", max_tokens=MANY, stream=True, extra_body=EXACT)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while delta(before, after := scrape(server), "loraplex_requests_total", **labels) == 0:
        assert time.monotonic() < deadline, "the aborted request was never counted"
        time.sleep(0.05)
    assert delta(before, after, "loraplex_requests_total", **labels) == 1
    completion = delta(before, after, "loraplex_completion_tokens_total", tenant=NO_TENANT, adapter="poem")
    assert 0 < completion < MANY
    assert value(after, "loraplex_kv_blocks_used") == 0


def test_openmetrics_when_asked(server):
    response = httpx.get(
        f"{server.url}/metrics", headers={**SCRAPER, "Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    names = {family.name for family in openmetrics_families(response.text)}
    assert {"loraplex_requests", "loraplex_time_to_first_token_seconds", "loraplex_kv_blocks_used"} <= names
