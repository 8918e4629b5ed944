"""Fair scheduling end to end: the tenant of each request comes from its API key, its weight from the registry.

With `--scheduling-policy fair` and two seats, tenant A floods 12 long requests; once all of them are in the
engine (its running and waiting gauges on /metrics), tenant B sends 2 short ones. B's requests take the first
seats that free up, so they start while most of A's flood still waits; /metrics shows each tenant's service and
queue time. Under the default fcfs the same run seats B behind A's whole flood.

The order compared is the order in which requests took a seat (a streamed response starts with its first
token), not the order in which they finished: B's requests reach the engine some time after they are sent, and
on a loaded machine a few more of A's requests may be seated meanwhile under either policy; what tells the
policies apart is whether A's requests are still seated after B's."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FLOOD, LONG, SHORT = 12, 300, 4  # A's flood: 1,800 steps of the two seats


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


def wait_until_in_engine(server, count: int, finished: threading.Semaphore, timeout_s: float = 60) -> None:
    """Until `count` requests are running, waiting or done in the engine (its gauges on /metrics): on a loaded
    machine a flood's last requests may reach the engine well after the first."""
    done = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        while finished.acquire(blocking=False):
            done += 1
        text = httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=30).text
        gauges = {
            name: float(value)
            for name, value in (line.split() for line in text.splitlines() if line.startswith("loraplex_seqs_"))
        }
        if gauges.get("loraplex_seqs_running", 0) + gauges.get("loraplex_seqs_waiting", 0) + done >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never all reached the engine")


def flood_then_short(server) -> tuple[list[str], str, str]:
    """The order in which requests took a seat after B's were sent ("A" / "B"), and the two tenants' names."""
    a_name, a_key = tenant(server)
    b_name, b_key = tenant(server, weight=2.0)
    seated: list[str] = []
    finished = threading.Semaphore(0)
    lock = threading.Lock()

    def call(client: openai.OpenAI, label: str, max_tokens: int) -> None:
        stream = client.completions.create(
            model=BASE, prompt="Alice", max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
        )
        with lock:  # the response's headers come with its first token: the request holds a seat
            seated.append(label)
        assert sum(len(chunk.choices) for chunk in stream) >= 1
        finished.release()

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)

    flood = [threading.Thread(target=call, args=(client(a_key), "A", LONG)) for _ in range(FLOOD)]
    short = [threading.Thread(target=call, args=(client(b_key), "B", SHORT)) for _ in range(2)]
    for thread in flood:
        thread.start()
    wait_until_in_engine(server, FLOOD, finished)  # every one of A's requests is queued or running
    with lock:
        seated_before_b = len(seated)
    for thread in short:
        thread.start()
    for thread in flood + short:
        thread.join(timeout=120)
    assert len(seated) == FLOOD + 2
    assert seated_before_b <= FLOOD - 6, seated  # most of the flood was still queued when B was sent
    return seated[seated_before_b:], a_name, b_name


def test_fair_serves_the_short_tenant_before_the_flood_and_fcfs_does_not(tiny, tmp_path):
    with serve(tiny, tmp_path, "fair") as server:
        fair, a_name, b_name = flood_then_short(server)
        text = httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=30).text
    with serve(tiny, tmp_path, "fcfs") as server:
        fcfs, _, _ = flood_then_short(server)
    seated_after_b = lambda order: order[max(i for i, label in enumerate(order) if label == "B") :].count("A")  # noqa: E731
    assert seated_after_b(fair) >= 3, fair  # B jumped the queue: A's flood was still waiting behind it
    assert seated_after_b(fcfs) == 0, fcfs  # B waited for every one of A's requests sent before it
    for name in (a_name, b_name):
        assert f'loraplex_tenant_service_tokens_total{{tenant="{name}"}}' in text
        assert f'loraplex_queue_time_seconds_count{{tenant="{name}"}}' in text
