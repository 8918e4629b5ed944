"""`loraplex serve --replicas 2` on a local Ray instance (a real subprocess, 2 CPU engine replicas of a tiny model,
a real PostgreSQL registry and a real Redis), through a real socket with the `openai` client: adapter-affinity
routing (shown by the replicas' own stats), adapters reaching replicas through the database, cluster-wide delete
with in-flight requests finishing, a client that goes away, a replica killed with requests on it (retried when
nothing had streamed, a clean error event when something had, usage counted once), usage exact across replicas,
and an adapter whose files are gone from the registry (a 422 naming it; the rest serves on)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from registry.db import sync_url
from tests.gateway_server import ADMIN_KEY, BASE, ServerProcess
from tests.hf_models import make_adapter, make_model
from tests.services import create_database, delete_keys, drop_database, ensure_postgres, ensure_redis, free_port

pytest.importorskip("ray.serve", reason="the Ray Serve mode needs the ray extra (deploy/requirements-dev.txt has it)")

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
EXACT = {"ignore_eos": True}
ADAPTERS = {"a0": 8, "a1": 4, "a2": 8}  # registered at start
LATER = {"doomed": 4, "orphan": 8}  # registered by a test


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ray-cluster")
    hf = make_model(root / "base", tokenizer, "llama", max_position_embeddings=4096)  # long streams to cut short
    adapters = {
        name: make_adapter(hf, root / "adapters" / name, seed=i + 1, r=r)
        for i, (name, r) in enumerate({**ADAPTERS, **LATER}.items())
    }
    database = create_database(ensure_postgres())
    redis_url, prefix = ensure_redis(), f"test-ray-{uuid.uuid4().hex[:8]}:"
    args = [
        *("--replicas", "2", "--port", str(free_port())),
        *("--model", str(root / "base"), "--served-model-name", BASE),
        *(f"--lora-modules={name}={adapters[name]}" for name in ADAPTERS),
        *("--database-url", database, "--redis-url", redis_url, "--redis-key-prefix", prefix),
        *("--admin-key", ADMIN_KEY, "--no-disable-auth", "--adapter-root", str(root / "adapters")),
        *("--device", "cpu", "--kv-cache-memory", "32MiB", "--max-model-len", "4096", "--usage-flush-interval", "0.5"),
        # one sequence at a time per replica: a second request routed to a busy replica waits there, unstreamed
        *("--max-num-seqs", "1", "--max-loras", "2"),
    ]
    env = {"LORAPLEX_ADAPTER_CACHE_DIR": str(root / "replica-cache"), "RAY_DEDUP_LOGS": "0"}
    log = root / "serve.log"
    with ServerProcess(args, log, env=env) as server:
        server.root, server.database = root, database
        yield server
        assert server.stop(signal.SIGTERM) == 0, log.read_text()[-3000:]
    drop_database(database)
    delete_keys(redis_url, prefix)


def admin(cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers=ADMIN, timeout=60)


def replicas(cluster) -> list[dict]:
    with admin(cluster) as http:
        return http.get("/admin/replicas").json()["data"]


def new_key(cluster) -> tuple[str, str]:
    tenant = f"t{uuid.uuid4().hex[:8]}"
    with admin(cluster) as http:
        assert http.post("/admin/tenants", json={"name": tenant}).status_code == 201
        return tenant, http.post(f"/admin/tenants/{tenant}/keys").json()["key"]


def client(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0, timeout=120)


def wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def holders(cluster, adapter_id: str) -> list[str]:
    return [r["replica_id"] for r in replicas(cluster) if adapter_id in r["resident_adapters"]]


def test_requests_for_an_adapter_land_on_the_replica_that_holds_it(cluster):
    _, key = new_key(cluster)
    api = client(cluster, key)
    assert len(replicas(cluster)) == 2
    for adapter in ("a0", "a1"):
        api.completions.create(model=adapter, prompt="warm up", max_tokens=2)
        wait_for(lambda a=adapter: holders(cluster, f"{a}@1"), what=f"{adapter} resident")
    time.sleep(1.0)  # Ray's routers learn which replica holds which adapter from the replicas' reports
    before = {r["replica_id"]: r["requests_by_adapter"] for r in replicas(cluster)}
    for i in range(6):
        for adapter in ("a0", "a1"):
            api.completions.create(model=adapter, prompt=f"request {i}", max_tokens=3)
    after = replicas(cluster)
    for adapter in ("a0@1", "a1@1"):
        ran = {
            r["replica_id"]: r["requests_by_adapter"].get(adapter, 0) - before[r["replica_id"]].get(adapter, 0)
            for r in after
        }
        holder = holders(cluster, adapter)
        assert len(holder) == 1, (adapter, after)
        assert ran[holder[0]] == 6 and sum(ran.values()) == 6, (adapter, ran)  # all six on its holder
    # each adapter came to its replica from the registry database, by digest
    assert sum(r["adapter_files_fetched"] for r in after) >= 2
    cache = cluster.root / "replica-cache"
    with admin(cluster) as http:
        digests = {a["id"]: a["digest"] for a in http.get("/admin/adapters").json()["data"]}
    assert (cache / digests["a0@1"].removeprefix("sha256:") / "adapter_config.json").is_file()


def test_the_ingress_tokenizes_as_the_replicas_do(cluster):
    _, key = new_key(cluster)
    text = "Count these words, then give them back."
    with httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        counted = http.post("/tokenize", json={"model": "a0", "prompt": text}).json()
        assert http.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"].endswith(text)
    usage = client(cluster, key).completions.create(model="a0", prompt=text, max_tokens=2).usage
    assert usage.prompt_tokens == counted["count"]  # the ingress's tokenizer is the replicas' (pickled by Ray)


def test_structured_outputs_cross_to_the_replicas(cluster):
    """A grammar rides the request to a replica and holds its reply there; one that does not compile is refused by
    the replica's engine, a 400 naming the field (the error's type crosses Ray)."""
    _, key = new_key(cluster)
    api = client(cluster, key)
    reply = api.completions.create(
        model="a0", prompt="pick", max_tokens=20, temperature=0, extra_body={"guided_regex": "[a-d]{3}-[0-9]"}
    )
    assert re.fullmatch("[a-d]{3}-[0-9]", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="a0", prompt="pick", max_tokens=4, extra_body={"guided_regex": "a(b"})
    assert refused.value.body["param"] == "guided_regex" and "unclosed group" in refused.value.body["message"]


def test_usage_is_exact_across_replicas(cluster):
    tenant, key = new_key(cluster)
    api = client(cluster, key)
    delivered = {"a0": 0, "a1": 0, "a2": 0, "": 0}
    prompts = {"a0": 0, "a1": 0, "a2": 0, "": 0}
    for i, model in enumerate(["a0", "a1", "a2", BASE] * 3):
        response = api.completions.create(model=model, prompt=f"usage {i}", max_tokens=4 + i, extra_body=EXACT)
        name = "" if model == BASE else model
        delivered[name] += response.usage.completion_tokens
        prompts[name] += response.usage.prompt_tokens
        assert response.usage.completion_tokens == 4 + i
    stream = api.completions.create(
        model="a2", prompt="streamed", max_tokens=7, stream=True, logprobs=1, extra_body=EXACT
    )  # each chunk's logprobs list its tokens (a chunk may hold several, or none while text is held back)
    delivered["a2"] += sum(len(chunk.choices[0].logprobs.tokens) for chunk in stream if chunk.choices)
    assert delivered["a2"] == 30 + 7
    with admin(cluster) as http:
        report = http.get("/admin/usage", params={"tenant": tenant}).json()
    by_adapter = {row["adapter"]: row for row in report["data"]}
    assert {a: by_adapter[a]["completion_tokens"] for a in delivered} == delivered
    assert by_adapter["a0"]["prompt_tokens"] == prompts["a0"]
    assert report["totals"]["requests"] == 13
    # both replicas served some of it
    assert all(sum(r["requests_by_adapter"].values()) > 0 for r in replicas(cluster))


def test_delete_reaches_every_replica_and_lets_running_requests_finish(cluster):
    _, key = new_key(cluster)
    api = client(cluster, key)
    with admin(cluster) as http:
        path = str(cluster.root / "adapters" / "doomed")
        registered = http.post("/admin/adapters", json={"name": "doomed", "path": path})
        assert registered.status_code == 201, registered.text
    api.completions.create(model="doomed", prompt="load it", max_tokens=2)
    assert holders(cluster, "doomed@1")
    stream = api.completions.create(model="doomed", prompt="a long one", max_tokens=120, stream=True, extra_body=EXACT)
    chunks = iter(stream)
    next(chunks)  # it runs on a replica now
    with admin(cluster) as http:
        assert http.delete("/admin/adapters/doomed").status_code == 200
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"  # the running request finished
    assert holders(cluster, "doomed@1") == []  # no replica holds it
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="doomed", prompt="gone", max_tokens=2)
    # registered again under the same name@version with other weights (a2's): every replica serves the new ones
    with admin(cluster) as http:
        again = http.post("/admin/adapters", json={"name": "doomed", "path": str(cluster.root / "adapters" / "a2")})
        assert again.json()["id"] == "doomed@1"
    greedy = {"prompt": "same weights", "max_tokens": 8, "temperature": 0, "extra_body": EXACT}
    for _ in range(2):  # whichever replica runs it
        assert api.completions.create(model="doomed", **greedy).choices[0].text == (
            api.completions.create(model="a2", **greedy).choices[0].text
        )


def test_unload_reaches_every_replica(cluster):
    _, key = new_key(cluster)
    client(cluster, key).completions.create(model="a0", prompt="load", max_tokens=2)
    assert holders(cluster, "a0@1")
    with admin(cluster) as http:
        assert http.post("/admin/adapters/a0/unload").status_code == 200
    assert holders(cluster, "a0@1") == []
    with admin(cluster) as http:  # `load` brings it back on the replica Ray routes it to
        assert http.post("/admin/adapters/a0/load").json()["tier"] in ("device", "host")
    assert len(holders(cluster, "a0@1")) == 1


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(cluster):
    _, key = new_key(cluster)
    with httpx.Client(base_url=cluster.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        body = {"model": "a0", "prompt": "go away", "max_tokens": 3000, "stream": True, **EXACT}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    generated_before = sum(r["engine"]["generated_tokens"] for r in replicas(cluster))
    wait_for(lambda: all(r["engine"]["num_requests"] == 0 for r in replicas(cluster)), 30, "the abort")
    time.sleep(0.5)
    assert sum(r["engine"]["generated_tokens"] for r in replicas(cluster)) - generated_before < 1000


def test_a_replica_killed_with_requests_on_it(cluster):
    tenant, key = new_key(cluster)
    headers = {"Authorization": f"Bearer {key}"}
    api = client(cluster, key)
    api.completions.create(model="a1", prompt="where is it", max_tokens=2)
    victim = wait_for(lambda: [r for r in replicas(cluster) if "a1@1" in r["resident_adapters"]], what="a1 resident")
    victim = victim[0]
    time.sleep(1.0)
    with httpx.Client(base_url=cluster.url, timeout=120, headers=headers) as http:
        running = {"model": "a1", "prompt": "streaming", "max_tokens": 3000, "stream": True, "logprobs": 1, **EXACT}
        with http.stream("POST", "/v1/completions", json=running) as first:
            lines = first.iter_lines()
            streamed = [next(line for line in lines if line.startswith("data: "))]  # it has streamed
            # the second request goes to the same replica (it holds a1) and waits there: one sequence at a time
            with httpx.Client(base_url=cluster.url, timeout=120, headers=headers) as second_http:
                result = {}

                def second():
                    body = {"model": "a1", "prompt": "waiting", "max_tokens": 5, **EXACT}
                    result["response"] = second_http.post("/v1/completions", json=body)

                thread = threading.Thread(target=second)
                thread.start()
                wait_for(
                    lambda: any(
                        r["replica_id"] == victim["replica_id"] and r["engine"]["seqs_waiting"] == 1
                        for r in replicas(cluster)
                    ),
                    30,
                    "the second request queued on the replica holding a1",
                )
                os.kill(victim["pid"], signal.SIGKILL)
                streamed += [line for line in lines if line.startswith("data: ")]
                thread.join(120)
    # the streamed request ends with a clean error event, then [DONE]
    assert streamed[-1] == "data: [DONE]"
    error = json.loads(streamed[-2].removeprefix("data: "))
    assert "error" in error and "replica" in error["error"]["message"]
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed[:-2]]
    delivered_first = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
    assert 0 < delivered_first < 3000
    # the one that had not streamed ran again on the other replica
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    # usage counts what was delivered, once
    with admin(cluster) as http:
        report = wait_for(
            lambda: (r := http.get("/admin/usage", params={"tenant": tenant}).json())["totals"]["requests"] == 3 and r,
            what="usage",
        )
    assert report["totals"]["completion_tokens"] == 2 + delivered_first + 5
    # new requests go to the live replica; Ray starts a replacement
    assert api.completions.create(model="a1", prompt="after", max_tokens=3).usage.completion_tokens == 3
    wait_for(
        lambda: len(ids := {r["replica_id"] for r in replicas(cluster)}) == 2 and victim["replica_id"] not in ids,
        90,
        "Ray's replacement replica",
    )


def test_an_adapter_whose_files_left_the_registry_is_a_clear_error_and_nothing_else_breaks(cluster):
    _, key = new_key(cluster)
    api = client(cluster, key)
    with admin(cluster) as http:
        path = str(cluster.root / "adapters" / "orphan")
        digest = http.post("/admin/adapters", json={"name": "orphan", "path": path}).json()["digest"]
    with create_engine(sync_url(cluster.database)).begin() as connection:  # as if registered before the store
        connection.execute(text("DELETE FROM adapter_files WHERE digest = :d"), {"d": digest})
    with pytest.raises(openai.UnprocessableEntityError, match="register it again"):
        api.completions.create(model="orphan", prompt="hello", max_tokens=2)
    assert api.completions.create(model="a0", prompt="still fine", max_tokens=2).usage.completion_tokens == 2


def ray_head_port() -> int:
    """A free port below Ray's worker port range (10002-19999)."""
    for port in random.sample(range(7000, 9900), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for a Ray head")


def stop_ray_node(temp_dir: str) -> None:
    """Stops the Ray node whose session lives under `temp_dir` (and only it: `ray stop` would stop every node on the
    machine); its workers exit with their raylet."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp_dir.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def test_serve_joins_a_running_ray_cluster_and_leaves_it_running(tmp_path, tokenizer):
    model = make_model(tmp_path / "base", tokenizer, "llama")
    adapter = make_adapter(model, tmp_path / "adapters" / "joined", seed=5)
    port, temp_dir = ray_head_port(), f"/tmp/lpx-ray-{uuid.uuid4().hex[:6]}"
    ray = str(Path(sys.executable).parent / "ray")
    head = [ray, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}"]
    head += ["--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(head, check=True, capture_output=True, timeout=120)
    try:
        args = [
            *("--replicas", "1", "--ray-address", f"127.0.0.1:{port}", "--port", str(free_port())),
            *("--model", str(tmp_path / "base"), "--served-model-name", BASE, f"--lora-modules=joined={adapter}"),
            *("--database-url", f"sqlite:///{tmp_path / 'registry.db'}", "--disable-auth", "--device", "cpu"),
            *("--kv-cache-memory", "16MiB"),
        ]
        with ServerProcess(args, tmp_path / "serve.log") as server:
            api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
            assert api.completions.create(model="joined", prompt="hi", max_tokens=3).usage.completion_tokens == 3
            assert server.stop(signal.SIGTERM) == 0
        # the cluster it joined is still there: a driver connects and sees its CPUs
        status = subprocess.run(
            [ray, "status", f"--address=127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "RAY_AUTH_MODE": "token"},  # the head's token, in ~/.ray
        )
        assert "CPU" in status.stdout, status.stdout + status.stderr
    finally:
        stop_ray_node(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
