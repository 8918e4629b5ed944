"""Cold adapter loads overlap with running work and are reported.

Engine: while a batch on a resident adapter decodes, a request for an adapter still on disk arrives; its load
starts at once on the loader thread (the disk read is slowed to 1 s, as a slow network volume would be) and the
batch's time per step stays within 2x of before. The late request says how long the load held it and from which
tier it came.

Gateway (a real socket, the openai client): every response carries `x-loraplex-adapter-load-ms` and
`x-loraplex-adapter-tier`; /metrics has the delay histogram by tier, the queue time and service per tenant;
registering with `"preload": true` (and the admin load route) leaves nothing for the first request to wait for.
"""

from __future__ import annotations

import statistics
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for
from tests.hf_models import base_with_adapters

SLOW_READ_S = 1.0
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return base_with_adapters(tmp_path_factory.mktemp("cold"), tokenizer, r=8)


def test_a_cold_load_overlaps_the_running_batch_and_reports_its_delay(model, monkeypatch):
    base, (warm, cold) = model
    config = EngineConfig(
        model=str(base),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=128,
    )
    engine = LLMEngine(config)
    engine.add_adapter(warm)
    cache = engine.adapter_cache
    real_read = cache.read

    def slow_read(lora):
        time.sleep(SLOW_READ_S)  # the disk (I/O releases the GIL, as a real read does)
        return real_read(lora)

    monkeypatch.setattr(cache, "read", slow_read)
    g = torch.Generator().manual_seed(0)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, detokenize=False)
    for i in range(4):
        prompt = torch.randint(3, 512, (12,), generator=g).tolist()
        engine.add_request(EngineRequest(f"warm{i}", prompt, long, lora=warm))

    def timed_step() -> tuple[float, list]:
        start = time.perf_counter()
        outputs = engine.step()
        return time.perf_counter() - start, outputs

    for _ in range(3):
        engine.step()  # prefill and the first decodes
    before = [timed_step()[0] for _ in range(20)]
    late = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
    arrived = time.monotonic()
    engine.add_request(EngineRequest("cold", [5, 6, 7], late, lora=cold))
    during, cold_outputs, warm_outputs = [], [], []
    while not cold_outputs:
        elapsed, outputs = timed_step()
        cold_outputs = [o for o in outputs if o.request_id == "cold"]
        warm_outputs += [o for o in outputs if o.request_id.startswith("warm")]
        if not cold_outputs:
            during.append(elapsed)
    waited = time.monotonic() - arrived
    assert len(during) >= 5, during  # the batch kept stepping while the adapter loaded
    assert statistics.median(during) <= 2 * statistics.median(before), (before, during)
    first = cold_outputs[0]
    assert first.adapter_tier == "disk"
    assert SLOW_READ_S <= first.metrics["adapter_load_s"] <= waited
    assert first.metrics["queue_s"] >= first.metrics["adapter_load_s"]
    assert warm_outputs and all(o.adapter_tier == "host" for o in warm_outputs)  # add_adapter: host memory


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    root, _, adapters = build_tiny(tmp_path_factory.mktemp("cold-gw"), tokenizer, {"sql": 4, "poem": 8, "chat": 4})
    # sql is registered at startup without --preload; poem and chat over the admin API. One device row and one
    # host slot, so adapters go back to disk and every tier is seen.
    paths = {name: adapters.pop(name) for name in ("poem", "chat")}
    settings = settings_for(root, adapters, max_loras=1, max_cpu_loras=1, adapter_root=[str(root / "adapters")])
    with ServerThread(settings) as running:
        running.paths = paths
        yield running


def metric_samples(server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def register(server, name: str, **extra) -> httpx.Response:
    body = {"name": name, "path": server.paths[name], **extra}
    return httpx.post(f"{server.url}/admin/adapters", json=body, headers=ADMIN, timeout=60)


def test_every_response_says_how_long_its_adapter_load_took_and_preloads_leave_nothing_to_wait_for(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def complete(model: str):
        response = api.completions.with_raw_response.create(model=model, prompt="Alice", max_tokens=2)
        return response.headers.get("x-loraplex-adapter-tier"), int(response.headers["x-loraplex-adapter-load-ms"])

    before = metric_samples(server)
    assert complete("sql")[0] == "host"  # validated into host memory at start, not yet on a device row
    assert complete("sql") == ("device", 0)
    assert complete(BASE) == (None, 0)
    with api.completions.with_streaming_response.create(model="sql", prompt="Alice", max_tokens=2, stream=True) as s:
        assert s.headers["x-loraplex-adapter-tier"] == "device" and s.headers["x-loraplex-adapter-load-ms"] == "0"
        assert list(s.iter_lines())
    assert register(server, "chat").json()["tier"] == "host"  # validated into the one host slot: sql leaves it
    assert complete("chat")[0] == "host"  # takes the one device row from sql
    tier, load_ms = complete("sql")  # on neither tier any more: read from disk again
    assert tier == "disk" and load_ms >= 0
    after = metric_samples(server)

    def moved(name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    delays = {t: moved("loraplex_adapter_load_delay_seconds_count", tier=t) for t in ("device", "host", "disk")}
    assert delays == {"device": 2, "host": 2, "disk": 1}, delays
    assert moved("loraplex_adapter_load_delay_seconds_sum", tier="disk") * 1000 >= load_ms - 1
    assert moved("loraplex_queue_time_seconds_count", tenant="_none") == 6  # every generation, base included
    assert moved("loraplex_tenant_service_tokens_total", tenant="_none") > 0

    # preloaded at registration, or by the admin load route: the first request finds a device row
    registered = register(server, "poem", preload=True)
    assert registered.status_code == 201 and registered.json()["tier"] == "device", registered.text
    assert complete("poem") == ("device", 0)
    assert httpx.post(f"{server.url}/admin/adapters/chat/load", headers=ADMIN, timeout=60).json()["tier"] == "device"
    assert complete("chat") == ("device", 0)


def test_under_fair_a_tenant_whose_adapter_is_loading_does_not_hold_up_the_others(model, monkeypatch):
    """Tenant A (the smallest counter, first in line) waits for a cold adapter; tenant B's requests run meanwhile."""
    base, (_, cold) = model
    config = EngineConfig(
        model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
        num_kv_blocks=128, scheduling_policy="fair",
    )  # fmt: skip
    engine = LLMEngine(config)
    cache = engine.adapter_cache
    real_read = cache.read
    monkeypatch.setattr(cache, "read", lambda lora: (time.sleep(SLOW_READ_S), real_read(lora))[1])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    engine.add_request(EngineRequest("a", [5, 6, 7], params, lora=cold, tenant="A"))
    for i in range(3):
        engine.add_request(EngineRequest(f"b{i}", [8, 9, 10], params, tenant="B"))
    finished: list[str] = []
    while engine.has_unfinished:
        finished += [out.request_id for out in engine.step() if out.finished]
        if not engine.last_step_ran:
            time.sleep(0.005)
    assert finished[-1] == "a" and sorted(finished[:3]) == ["b0", "b1", "b2"], finished
