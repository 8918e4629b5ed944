"""Adapters deleted and registered again through the admin API while n=4 requests on them run, with fewer
device rows than adapters: the server keeps serving, every request completes or fails with a clear 404, and
once all are done no KV block and no adapter row is held."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.gateway_server import ADMIN_KEY, ServerThread, build_tiny, settings_for

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADAPTERS = ("a", "b", "c")  # a and b are deleted and registered again over and over; c never
PROMPT = " ".join(["Alice was beginning to get very tired of sitting by her sister on the bank"] * 4)
REQUESTS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    root, _, adapters = build_tiny(tmp_path_factory.mktemp("churn"), tokenizer, dict.fromkeys(ADAPTERS, 8))
    # 16 tokens a step: each prompt's prefill spans several steps, so deletions land between a request's
    # admission and the fork of its 4 samples at the end of its prefill
    settings = settings_for(root, adapters, max_loras=2, max_num_seqs=8, max_num_batched_tokens=16)
    with ServerThread(settings) as running:
        yield running, adapters


def churn(url: str, adapters: dict[str, str], stop: threading.Event, statuses: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            for name in ("a", "b"):
                statuses.append(http.delete(f"/admin/adapters/{name}", headers=ADMIN).status_code)
                body = {"name": name, "path": adapters[name]}
                statuses.append(http.post("/admin/adapters", headers=ADMIN, json=body).status_code)


async def complete(http: httpx.AsyncClient, i: int) -> tuple[str, httpx.Response]:
    model = ADAPTERS[i % len(ADAPTERS)]
    body = {"model": model, "prompt": PROMPT, "n": 4, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    return model, await http.post("/v1/completions", json=body)


async def complete_all(url: str) -> list[tuple[str, httpx.Response]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await asyncio.gather(*(complete(http, i) for i in range(REQUESTS)))


def test_n4_requests_survive_their_adapters_being_deleted_and_registered_again(server):
    running, adapters = server
    stop, statuses = threading.Event(), []
    churner = threading.Thread(target=churn, args=(running.url, adapters, stop, statuses))
    churner.start()
    try:
        results = asyncio.run(complete_all(running.url))
    finally:
        stop.set()
        churner.join(60)
    assert statuses and set(statuses) <= {200, 201}, statuses  # the admin API answered every time
    served = 0
    for model, response in results:
        if response.status_code == 404:  # the adapter was deleted when the request chose it: a clear error
            assert model != "c" and "does not exist" in response.json()["error"]["message"]
            continue
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        assert all(c["finish_reason"] == "length" for c in choices)
        assert response.json()["usage"]["completion_tokens"] == 4 * 8
        served += 1
    assert served >= REQUESTS // 3  # c's requests at least
    stats = asyncio.run(running.state.engine.stats())
    assert stats.num_requests == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.adapter_rows_pinned == 0
    with httpx.Client(base_url=running.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        for name in ADAPTERS:  # and it serves on, each adapter included
            body = {"model": name, "prompt": "The rabbit", "n": 4, "max_tokens": 3, "ignore_eos": True}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200 and len(response.json()["choices"]) == 4, response.text
