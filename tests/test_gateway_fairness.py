"""Fair scheduling end to end: the tenant of each request comes from its API key, its weight from the registry.

With `--scheduling-policy fair` and two seats, tenant A floods 12 long requests; once they are under way,
tenant B sends 2 short ones. B's requests take the first seats that free up, so they are done while most of
A's flood still waits; /metrics shows each tenant's service and queue time. Under the default fcfs the same
run leaves B behind A's whole flood."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FLOOD, LONG, SHORT = 12, 200, 4  # A's flood: 1,200 steps of the two seats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("fair-gw"), tokenizer, {"sql": 4})


def serve(tiny, tmp_path, policy: str) -> ServerThread:
    root, _, adapters = tiny
    settings = settings_for(
        root,
        adapters,
        database_url=f"sqlite:///{tmp_path / f'{policy}.db'}",
        disable_auth=False,
        scheduling_policy=policy,
        max_num_seqs=2,
    )
    return ServerThread(settings)


def tenant(server, weight: float = 1.0) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as http:
        created = http.post("/admin/tenants", json={"name": name, "weight": weight})
        assert created.status_code == 201 and created.json()["weight"] == weight
        return name, http.post(f"/admin/tenants/{name}/keys").json()["key"]


def flood_then_short(server) -> tuple[list[str], str, str]:
    """The order in which requests finished after B's were sent ("A" / "B"), and the two tenants' names."""
    a_name, a_key = tenant(server)
    b_name, b_key = tenant(server, weight=2.0)
    done: list[str] = []
    lock = threading.Lock()

    def call(key: str, label: str, max_tokens: int) -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
        client.completions.create(model=BASE, prompt="Alice", max_tokens=max_tokens, extra_body={"ignore_eos": True})
        with lock:
            done.append(label)

    flood = [threading.Thread(target=call, args=(a_key, "A", LONG)) for _ in range(FLOOD)]
    for thread in flood:
        thread.start()
    time.sleep(0.5)  # A's flood is queued in the engine
    with lock:
        finished_before_b = len(done)
    short = [threading.Thread(target=call, args=(b_key, "B", SHORT)) for _ in range(2)]
    for thread in short:
        thread.start()
    for thread in flood + short:
        thread.join(timeout=120)
    assert len(done) == FLOOD + 2
    assert finished_before_b <= FLOOD - 4, done  # most of the flood was still to come when B arrived
    return done[finished_before_b:], a_name, b_name


def test_fair_serves_the_short_tenant_before_the_flood_and_fcfs_does_not(tiny, tmp_path):
    with serve(tiny, tmp_path, "fair") as server:
        fair, a_name, b_name = flood_then_short(server)
        text = httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=30).text
    with serve(tiny, tmp_path, "fcfs") as server:
        fcfs, _, _ = flood_then_short(server)
    last_b = lambda order: max(i for i, label in enumerate(order) if label == "B")  # noqa: E731
    assert last_b(fair) <= 2 + 2, fair  # at most the two A requests that held the seats finish first
    assert fcfs.count("A") - fcfs[: last_b(fcfs)].count("A") <= 2, fcfs  # behind all of A but the last seats
    for name in (a_name, b_name):
        assert f'loraplex_tenant_service_tokens_total{{tenant="{name}"}}' in text
        assert f'loraplex_queue_time_seconds_count{{tenant="{name}"}}' in text
