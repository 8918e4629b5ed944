"""Tenants through a live server: keys (shown once, stored hashed), auth on /v1, isolation of private adapters,
usage equal to what clients received (in process and in a real Redis, across restarts), limits → 429 with
Retry-After, two gateway processes sharing one Redis, and a Redis outage that loses nothing."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from registry.db import sync_url
from tests.gateway_server import ADMIN_KEY, BASE, ServerProcess, ServerThread, build_tiny, settings_for
from tests.services import RedisProcess, create_database, delete_keys, drop_database, ensure_postgres, ensure_redis
from tests.test_gateway_admin import assert_openai_error

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_TOKENS = 5
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("tenants"), tokenizer, {"public": 4, "secret": 8, "other": 4})


@pytest.fixture(scope="module", params=["memory", "redis"])
def store(request):
    """None: usage and limits in process; else a real Redis URL with a key prefix of this module's own."""
    if request.param == "memory":
        yield None, "loraplex:"
        return
    url, prefix = ensure_redis(), f"test-{uuid.uuid4().hex[:8]}:"
    yield url, prefix
    delete_keys(url, prefix)


def tenant_settings(root, adapters, database_url, redis=(None, "loraplex:"), **overrides):
    values = {
        "database_url": database_url,
        "disable_auth": False,
        "redis_url": redis[0],
        "redis_key_prefix": redis[1],
        "adapter_root": [str(root / "adapters")],
        "usage_flush_interval": 0.5,
        **overrides,
    }
    return settings_for(root, {"public": adapters["public"]}, **values)


@pytest.fixture(scope="module")
def server(tiny, store, tmp_path_factory):
    root, _, adapters = tiny
    database = f"sqlite:///{tmp_path_factory.mktemp('tenants-db') / 'registry.db'}"
    with ServerThread(tenant_settings(root, adapters, database, store)) as running:
        yield running


def admin(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=ADMIN, timeout=60)


def new_tenant(server, **limits) -> tuple[str, str]:
    """(tenant name, one API key)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    with admin(server) as http:
        assert http.post("/admin/tenants", json={"name": name, **limits}).status_code == 201
        key = http.post(f"/admin/tenants/{name}/keys").json()["key"]
    return name, key


def api(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_keys_are_shown_once_stored_hashed_and_revocable(server):
    with admin(server) as http:
        assert http.post("/admin/tenants", json={"name": "acme"}).status_code == 201
        assert_openai_error(http.post("/admin/tenants", json={"name": "acme"}), 409, "name")
        created = http.post("/admin/tenants/acme/keys")
        assert created.status_code == 201
        key = created.json()["key"]
        listed = http.get("/admin/tenants/acme/keys").json()["data"]
        assert [k["id"] for k in listed] == [created.json()["id"]] and "key" not in listed[0]
        assert key.startswith(listed[0]["prefix"])
    hashes = stored_key_hashes(server)
    assert key not in hashes and len(hashes[0]) == 64  # only the sha256 is kept

    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": BASE, "prompt": "x", "max_tokens": 2}
        assert_openai_error(http.post("/v1/completions", json=body), 401, text="missing API key")
        bad = {"Authorization": "Bearer lpx-not-a-key"}
        assert_openai_error(http.post("/v1/completions", json=body, headers=bad), 401, text="invalid API key")
        assert_openai_error(http.get("/v1/models"), 401)
        good = {"Authorization": f"Bearer {key}"}
        assert http.post("/v1/completions", json=body, headers=good).status_code == 200
        assert_openai_error(http.get("/admin/adapters", headers=good), 403)  # a tenant key is not the admin's
        assert_openai_error(http.get("/admin/usage", headers=good), 403)
        with admin(server) as a:
            assert a.delete(f"/admin/tenants/acme/keys/{created.json()['id']}").json()["revoked_at"] is not None
        assert_openai_error(http.post("/v1/completions", json=body, headers=good), 401)


def stored_key_hashes(server) -> list[str]:
    engine = create_engine(sync_url(server.state.settings.database_url))
    with engine.connect() as connection:
        hashes = [row[0] for row in connection.execute(text("SELECT key_hash FROM api_keys"))]
    engine.dispose()
    return hashes


def test_a_private_adapter_is_invisible_to_other_tenants(server, tiny):
    _, _, adapters = tiny
    owner, owner_key = new_tenant(server)
    _, other_key = new_tenant(server)
    with admin(server) as http:
        body = {"name": f"priv-{owner}", "path": adapters["secret"], "owner": owner}
        assert http.post("/admin/adapters", json=body).status_code == 201
    private = f"priv-{owner}"
    mine, theirs = api(server, owner_key), api(server, other_key)
    assert private in {m.id for m in mine.models.list().data}
    assert private not in {m.id for m in theirs.models.list().data}
    assert "public" in {m.id for m in theirs.models.list().data}
    assert mine.completions.create(model=private, prompt="x", max_tokens=2).usage.completion_tokens >= 1

    def not_found(call) -> dict:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        return caught.value.body

    hidden = not_found(lambda: theirs.completions.create(model=private, prompt="x", max_tokens=2))
    missing = not_found(lambda: theirs.completions.create(model="never-registered", prompt="x", max_tokens=2))
    assert hidden == {**missing, "message": missing["message"].replace("never-registered", private)}
    for model in (f"{private}@1", private):
        not_found(lambda m=model: theirs.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}]))
    via_base = not_found(
        lambda: theirs.completions.create(model=BASE, prompt="x", extra_body={"lora_request": {"lora_name": private}})
    )
    assert via_base["param"] == "lora_request.lora_name"
    assert mine.models.retrieve(private).parent == BASE  # retrieve by id: the same 404 as a generation's
    assert not_found(lambda: theirs.models.retrieve(private)) == hidden
    assert not_found(lambda: theirs.models.retrieve("never-registered")) == missing

    def post_as(key: str | None, route: str, body: dict) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
            return http.post(route, json=body)

    for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(post_as(None, route, body), 401)  # a tenant's key is needed
        assert post_as(owner_key, route, {**body, "model": private}).status_code == 200
        assert assert_openai_error(post_as(other_key, route, {**body, "model": private}), 404, "model") == hidden
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {other_key}"}) as http:
        assert http.delete(f"/admin/adapters/{private}").status_code == 403
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": private}).status_code == 403
        assert private not in http.get("/v1/usage").text
    assert private in {m.id for m in mine.models.list().data}  # still there

    with admin(server) as http:  # deleting the tenant takes its keys and private adapters with it
        assert http.delete(f"/admin/tenants/{owner}").json()["adapters_deleted"] == [f"{private}@1"]
        assert_openai_error(http.get(f"/admin/adapters/{private}"), 404)
        assert_openai_error(http.get(f"/admin/tenants/{owner}"), 404)
        assert owner not in {t["name"] for t in http.get("/admin/tenants").json()["data"]}
    with pytest.raises(openai.AuthenticationError):
        mine.models.list()


def sent(server, key: str, model: str, requests: list[dict]) -> dict[str, int]:
    """Sends completions / chats (stream or not) and sums the usage fields the client received."""
    client = api(server, key)
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "requests": 0}
    for request in requests:
        kind, stream, n = request["kind"], request.get("stream", False), request.get("n", 1)
        common = {"model": model, "max_tokens": MAX_TOKENS, "n": n, "extra_body": {"ignore_eos": True}}
        if stream:
            common.update(stream=True, stream_options={"include_usage": True})
        if kind == "chat":
            response = client.chat.completions.create(messages=[{"role": "user", "content": request["text"]}], **common)
        else:
            response = client.completions.create(prompt=request["text"], **common)
        usage = [c.usage for c in response if c.usage][-1] if stream else response.usage
        totals["prompt_tokens"] += usage.prompt_tokens
        totals["completion_tokens"] += usage.completion_tokens
        totals["cached_tokens"] += usage.prompt_tokens_details.cached_tokens
        totals["requests"] += 1
    return totals


LONG = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of " * 3


def test_usage_totals_equal_what_clients_received(server):
    tenant, key = new_tenant(server)
    mix = [
        {"kind": "completion", "text": LONG},
        {"kind": "completion", "text": LONG, "stream": True},  # a prefix-cache hit: cached tokens
        {"kind": "chat", "text": "hello", "stream": True},
        {"kind": "chat", "text": "hello again", "n": 2},
    ]
    on_public = sent(server, key, "public", mix)
    on_base = sent(server, key, BASE, mix[:2])
    assert on_public["cached_tokens"] > 0
    with httpx.Client(base_url=server.url, timeout=60) as http:
        report = http.get("/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()
        own = http.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert own == report
    by_adapter = {row["adapter"]: row for row in report["data"]}
    for adapter, expected in (("public", on_public), ("", on_base)):
        assert {k: by_adapter[adapter][k] for k in expected} == expected
    assert report["totals"]["completion_tokens"] == on_public["completion_tokens"] + on_base["completion_tokens"]
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).text
    samples = {
        (s.name, s.labels.get("tenant"), s.labels.get("adapter")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples[("loraplex_completion_tokens_total", tenant, "public")] == on_public["completion_tokens"]
    assert samples[("loraplex_prompt_tokens_total", tenant, "_base")] == on_base["prompt_tokens"]


def test_usage_is_flushed_at_shutdown_and_reported_after_a_restart(server, tmp_path):
    """Only the final flush at shutdown can have written it (the periodic one is an hour away)."""
    settings = server.state.settings.model_copy(  # its own database and Redis keys: nobody else flushes them
        update={
            "database_url": f"sqlite:///{tmp_path / 'r.db'}",
            "usage_flush_interval": 3600.0,
            "redis_key_prefix": f"test-{uuid.uuid4().hex[:8]}:",
        }
    )
    with ServerThread(settings) as first:
        tenant, key = new_tenant(first)
        got = sent(first, key, "public", [{"kind": "completion", "text": LONG}, {"kind": "chat", "text": "hi"}])
    with ServerThread(settings) as again, httpx.Client(base_url=again.url, timeout=60) as http:
        report = http.get("/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()
    assert {k: report["totals"][k] for k in got} == got


def test_an_aborted_stream_is_counted(server):
    tenant, key = new_tenant(server)
    body = {"model": "public", "prompt": "Alice", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as response:
            received = sum(1 for line, _ in zip(response.iter_lines(), range(8)) if line.startswith("data: {"))
        deadline = time.monotonic() + 10
        while True:
            rows = http.get(f"{server.url}/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()["data"]
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert rows and rows[0]["requests"] == 1 and received <= rows[0]["completion_tokens"] < 200


def within_one_minute_window() -> None:
    """Waits out the end of a minute so that a short burst stays inside one rate window."""
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)


def test_limits_answer_429_with_retry_after_naming_the_limit(server, tokenizer):
    tenant, key = new_tenant(server, requests_per_minute=3)
    within_one_minute_window()
    client = api(server, key)
    for _ in range(3):
        client.completions.create(model="public", prompt="x", max_tokens=1)
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        response = http.post("/v1/completions", json={"model": "public", "prompt": "x", "max_tokens": 1})
        error = assert_openai_error(response, 429, "requests_per_minute", "3 requests per minute")
        assert error["code"] == "requests_per_minute" and 1 <= int(response.headers["retry-after"]) <= 60
        with admin(server) as a:  # raising the limit takes effect at once
            assert a.patch(f"/admin/tenants/{tenant}", json={"requests_per_minute": 100}).status_code == 200
        assert http.post("/v1/completions", json={"model": "public", "prompt": "x", "max_tokens": 1}).status_code == 200

    per_request = len(tokenizer.encode("Alice was")) + MAX_TOKENS  # prompt and completion tokens both count
    _, key = new_tenant(server, token_quota=2 * per_request, quota_period="month")
    client = api(server, key)
    client.completions.create(
        model="public", prompt="Alice was", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    client.completions.create(
        model="public", prompt="Alice was", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="public", prompt="x", max_tokens=1)
    assert caught.value.body["code"] == "token_quota"
    assert int(caught.value.response.headers["retry-after"]) > 0


def test_tokenize_and_detokenize_are_requests_under_the_tenants_limits(server):
    """Each /tokenize and /detokenize call counts against requests per minute (with the completions'), so a key
    cannot render chat templates without bound; it records no usage."""
    tenant, key = new_tenant(server, requests_per_minute=3)
    within_one_minute_window()
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        assert http.post("/tokenize", json={"model": "public", "prompt": "Alice was"}).status_code == 200
        assert http.post("/detokenize", json={"model": "public", "tokens": [5, 6]}).status_code == 200
        assert http.post("/v1/completions", json={"model": "public", "prompt": "x", "max_tokens": 1}).status_code == 200
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert_openai_error(http.post(route, json=body), 429, "requests_per_minute")
        deadline = time.monotonic() + 10
        while True:
            rows = http.get("/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()["data"]
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert sum(row["requests"] for row in rows) == 1  # the completion alone


def test_concurrent_requests_limit(server):
    _, key = new_tenant(server, max_concurrent_requests=1)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "public", "prompt": "Alice", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            second = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
            assert_openai_error(second, 429, "max_concurrent_requests")
            for _ in running.iter_lines():
                pass
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1}).status_code == 200


def test_without_auth_the_server_says_so_and_counts_usage_under_no_tenant(tiny, tmp_path, caplog):
    root, _, adapters = tiny
    caplog.set_level(logging.WARNING, logger="gateway.app")
    settings = tenant_settings(root, adapters, f"sqlite:///{tmp_path / 'r.db'}", disable_auth=True)
    with ServerThread(settings) as server:
        assert any("authentication is OFF" in r.getMessage() for r in caplog.records)
        got = sent(server, "anything", "public", [{"kind": "completion", "text": "hello"}])
        usage = httpx.get(f"{server.url}/v1/usage", timeout=60).json()
    assert usage["totals"]["completion_tokens"] == got["completion_tokens"]
    assert {row["tenant"] for row in usage["data"]} == {""}


@pytest.fixture(scope="module")
def shared_postgres():
    url = create_database(ensure_postgres())
    yield url
    drop_database(url)


def test_two_gateway_processes_share_one_tenant_limit_through_redis(tiny, shared_postgres, tmp_path):
    root, _, adapters = tiny
    redis_url, prefix = ensure_redis(), f"test-{uuid.uuid4().hex[:8]}:"
    args = [
        "--model", str(root / "base"), "--served-model-name", BASE, "--device", "cpu", "--kv-cache-memory", "32MiB",
        "--database-url", shared_postgres, "--admin-key", ADMIN_KEY, "--no-disable-auth",
        "--redis-url", redis_url, "--redis-key-prefix", prefix, "--lora-modules", f"public={adapters['public']}",
    ]  # fmt: skip
    try:
        with ServerProcess(args, tmp_path / "a.log") as first, ServerProcess(args, tmp_path / "b.log") as second:
            with httpx.Client(timeout=60, headers=ADMIN) as http:
                http.post(f"{first.url}/admin/tenants", json={"name": "shared", "requests_per_minute": 4})
                key = http.post(f"{second.url}/admin/tenants/shared/keys").json()["key"]
            body = {"model": "public", "prompt": "x", "max_tokens": 1}

            async def burst() -> list[int]:
                async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
                    calls = [http.post(f"{url}/v1/completions", json=body) for url in [first.url, second.url] * 4]
                    return [r.status_code for r in await asyncio.gather(*calls)]

            within_one_minute_window()
            statuses = asyncio.run(burst())
    finally:
        delete_keys(redis_url, prefix)
    assert sorted(statuses) == [200] * 4 + [429] * 4


def test_a_redis_outage_loses_no_usage_and_counts_nothing_twice(tiny, tmp_path):
    root, _, adapters = tiny
    with RedisProcess() as redis_server:
        settings = tenant_settings(root, adapters, f"sqlite:///{tmp_path / 'r.db'}", (redis_server.url, "loraplex:"))
        with ServerThread(settings) as server:
            tenant, key = new_tenant(server, requests_per_minute=1000)
            mix = [{"kind": "completion", "text": "Alice was"}, {"kind": "chat", "text": "hi", "stream": True}]
            before = sent(server, key, "public", mix)
            redis_server.stop(kill=True)
            during = sent(server, key, "public", mix * 2)  # serving goes on (limits fail open)
            redis_server.start()
            after = sent(server, key, "public", mix)
            expected = {k: before[k] + during[k] + after[k] for k in before}
            deadline = time.monotonic() + 20
            while True:
                report = httpx.get(f"{server.url}/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()
                totals = report["totals"]
                if totals["requests"] >= expected["requests"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert {k: totals[k] for k in expected} == expected
        # after the server's final flush the registry alone holds exactly the same
        with ServerThread(settings) as again:
            report = httpx.get(f"{again.url}/admin/usage", params={"tenant": tenant}, headers=ADMIN).json()
        assert {k: report["totals"][k] for k in expected} == expected
