"""Hostile and unlucky inputs get a 4xx naming the problem, and nobody else notices: lone surrogates, non-finite
sampling values, oversized bodies and prompts, huge `n`, runaway chat templates, a broken registry database.
`/health` keeps answering within 100 ms while each bad request is handled."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from contextlib import contextmanager
from http.client import HTTPConnection, HTTPResponse
from urllib.parse import urlparse

import httpx
import pytest

from tests.gateway_server import ADMIN_KEY, BASE, ServerProcess, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error, assert_still_serving

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# What a /health answer may take while a bad request is refused: a refusal's work on the event loop would stall it
# for the whole of that work (tokenizing the 900 KB prompt below takes 1.3 s on a 2-core host), while the poller's
# own thread shares this process's GIL and a loaded 2-core CI host: one answer there took 224 ms (it was 0.1).
HEALTH_BUDGET_S = 0.4
# The runaway template's render budget (the server fixture's chat_template_timeout). Its render is pure Python on a
# thread of the server's process, so /health shares the GIL with it, and on a busy 2-core host one answer took
# 177-195 ms; had the render run on the event loop, /health would have waited the whole budget instead.
TEMPLATE_BUDGET_S = 1.0
# Two nested loops over ranges: ~10^10 iterations, minutes of pure Python if nothing stops it.
RUNAWAY_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("hardening"), tokenizer, {"sql": 8})


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    settings = settings_for(
        root,
        adapters,
        max_model_len=64,
        max_request_body_bytes="1MiB",
        trust_request_chat_template=True,
        chat_template_timeout=TEMPLATE_BUDGET_S,
        adapter_root=[str(root / "adapters")],
    )
    with ServerThread(settings) as running:
        yield running


@contextmanager
def health_watch(url: str):
    """Polls /health from another thread while the block runs; yields the list of (status, seconds) it saw."""
    seen: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            client.get("/health")  # connect outside the measurement
            while not stop.is_set():
                start = time.perf_counter()
                status = client.get("/health").status_code
                seen.append((status, time.perf_counter() - start))
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.05)
    try:
        yield seen
    finally:
        deadline = time.monotonic() + 1
        while len(seen) < 2 and time.monotonic() < deadline:  # at least one poll overlapped the block
            time.sleep(0.01)
        stop.set()
        poller.join(timeout=20)


def assert_health_stayed_fast(seen: list[tuple[int, float]], budget_s: float = HEALTH_BUDGET_S) -> None:
    assert seen, "the /health poller never ran"
    assert all(status == 200 for status, _ in seen), seen
    slowest = max(seconds for _, seconds in seen)
    assert slowest < budget_s, f"/health took {slowest * 1000:.0f} ms during the bad request"


# ---- text that is not valid Unicode ----------------------------------------------------------------------------
def raw_post(url: str, path: str, body: str) -> tuple[HTTPConnection, HTTPResponse]:
    """Posts `body` (JSON text, escapes kept as written) and returns the connection, to be reused after."""
    parsed = urlparse(url)
    connection = HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    connection.request("POST", path, body=body.encode(), headers={**ADMIN, "Content-Type": "application/json"})
    return connection, connection.getresponse()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "sql", "prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"model": "sql", "prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt.1"),
        (
            "/v1/chat/completions",
            '{"model": "sql", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"model": "up\\ud800", "prompt": "x", "max_tokens": 2}', "model"),
        ("/admin/adapters", '{"name": "bad\\udc00name", "path": "/nowhere"}', "name"),
        ("/admin/tenants", '{"name": "t\\ud800"}', "name"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays_open(server, path, body, param):
    connection, response = raw_post(server.url, path, body)
    payload = json.loads(response.read())
    assert response.status == 400, payload
    assert payload["error"]["param"] == param and "surrogate" in payload["error"]["message"]
    # the same keep-alive connection serves the next request (a 500 used to drop it)
    connection.request("GET", "/v1/models", headers=ADMIN)
    assert connection.getresponse().status == 200
    connection.close()


# ---- sampling values that would poison the logits -------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("repetition_penalty", "NaN"),
        ("repetition_penalty", "1e-300"),
    ],
)
def test_non_finite_or_absurd_sampling_values_are_400s_naming_the_field(server, field, value):
    body = f'{{"model": "sql", "prompt": "hello", "max_tokens": 2, "temperature": 1, "{field}": {value}}}'
    connection, response = raw_post(server.url, "/v1/completions", body)
    payload = json.loads(response.read())
    connection.close()
    assert response.status == 400, payload
    assert payload["error"]["param"] == field


# ---- sizes: bodies, prompts, n, prompt lists ------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_read_and_health_stays_fast(server, http):
    prompt = "hello world " * (10 * 2**20 // 12)  # 10 MB
    with health_watch(server.url) as seen:
        start = time.perf_counter()
        response = http.post("/v1/completions", json={"model": "sql", "prompt": prompt, "max_tokens": 2})
        elapsed = time.perf_counter() - start
    assert_openai_error(response, 413, text="max-request-body-bytes")
    assert elapsed < 5, f"refusing the body took {elapsed:.1f} s"
    assert_health_stayed_fast(seen)
    assert_still_serving(http)


def test_a_prompt_that_cannot_fit_is_refused_without_stalling_the_loop(server, http):
    prompt = "hello world " * (900 * 2**10 // 12)  # under the 1 MiB body limit, far over 64 tokens
    with health_watch(server.url) as seen:
        response = http.post("/v1/completions", json={"model": "sql", "prompt": prompt, "max_tokens": 2})
    error = assert_openai_error(response, 400, param="prompt", text="maximum context length is 64 tokens")
    assert error["code"] == "context_length_exceeded"
    assert_health_stayed_fast(seen)
    chat = {"model": "sql", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, param="messages", text="context length")


def test_huge_n_and_too_many_prompts_are_400s(server, http):
    with health_watch(server.url) as seen:
        response = http.post("/v1/completions", json={"model": "sql", "prompt": "x", "n": 8000, "max_tokens": 2})
    assert_openai_error(response, 400, param="n", text="--max-n")
    assert_health_stayed_fast(seen)
    chat = {"model": "sql", "messages": [{"role": "user", "content": "x"}], "n": 8000}
    assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, param="n")
    prompts = {"model": "sql", "prompt": ["x"] * 2000, "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=prompts), 400, param="prompt", text="at most 1024")
    many_samples = {"model": "sql", "prompt": ["x"] * 100, "n": 100, "max_tokens": 1}  # each under its own cap
    assert_openai_error(http.post("/v1/completions", json=many_samples), 400, param="prompt", text="10000 sequences")


# ---- chat templates ---------------------------------------------------------------------------------------------
def test_a_runaway_request_template_is_stopped_at_its_budget_and_health_stays_fast(server, http):
    body = {
        "model": "sql",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template": RUNAWAY_TEMPLATE,
    }
    with health_watch(server.url) as seen:
        start = time.perf_counter()
        response = http.post("/v1/chat/completions", json=body)
        elapsed = time.perf_counter() - start
    assert_openai_error(response, 400, param="messages", text="longer than 1 s")
    assert elapsed < 5
    # The loop answered all along: a render on it would have held the poll in flight for the whole second.
    assert_health_stayed_fast(seen, budget_s=TEMPLATE_BUDGET_S / 2)
    time.sleep(0.2)  # the render's thread was interrupted: it is gone, not burning a core
    assert not [t for t in threading.enumerate() if t.name == "chat-template"]
    assert_still_serving(http)


def test_a_broken_request_template_is_a_400_naming_the_template(http):
    body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ broken"}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="messages", text="chat template")


def test_a_request_template_needs_the_trust_flag(tiny):
    root, _, adapters = tiny
    settings = settings_for(root, adapters, max_model_len=64, database_url=f"sqlite:///{root / 'trust.db'}")
    body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert_openai_error(response, 400, param="chat_template", text="--trust-request-chat-template")
        del body["chat_template"]
        assert client.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200


# ---- the registry database -----------------------------------------------------------------------------------
def test_a_broken_registry_database_is_a_503_naming_it(tiny):
    root, _, adapters = tiny
    database = root / "broken.db"
    settings = settings_for(root, adapters, max_model_len=64, database_url=f"sqlite:///{database}")
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}).status_code == 200
        with sqlite3.connect(database) as connection:  # the operator's mistake: the tables are gone
            for (table,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                connection.execute(f'DROP TABLE "{table}"')
        for response in (
            client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}),
            client.get("/v1/models"),
            client.get("/admin/adapters", headers=ADMIN),
        ):
            error = assert_openai_error(response, 503, text="registry database is unavailable")
            assert error["code"] == "registry_unavailable" and response.headers["retry-after"]
            assert "SELECT" not in error["message"]  # the statement stays in the log
        # the base model needs no registry row: it is still served
        assert client.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2}).status_code == 200


# ---- adapters whose scaling would poison the logits -----------------------------------------------------------
@pytest.fixture(scope="module")
def absurd_adapter(tiny):
    """A copy of the `sql` adapter whose adapter_config.json says lora_alpha = 1e300."""
    root, _, adapters = tiny
    directory = root / "adapters" / "absurd"  # under the server's --adapter-root
    shutil.copytree(adapters["sql"], directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e300}))
    return directory


def test_an_absurd_lora_alpha_is_a_422_at_registration(server, http, absurd_adapter):
    response = http.post("/admin/adapters", headers=ADMIN, json={"name": "absurd", "path": str(absurd_adapter)})
    assert_openai_error(response, 422, param="path", text="lora_alpha")
    assert_openai_error(http.post("/v1/completions", json={"model": "absurd", "prompt": "x"}), 404, param="model")
    assert_still_serving(http)


def test_an_absurd_lora_alpha_in_lora_modules_stops_the_start_naming_it(tiny, absurd_adapter, tmp_path):
    root, _, _ = tiny
    args = ["--model", str(root / "base"), "--lora-modules", f"absurd={absurd_adapter}", "--device", "cpu"]
    args += ["--database-url", f"sqlite:///{tmp_path / 'absurd.db'}", "--max-model-len", "64"]
    server = ServerProcess(args, tmp_path / "serve.log")
    with pytest.raises(RuntimeError, match="did not start"):
        server.__enter__()
    assert server.process.wait(timeout=30) != 0
    log = (tmp_path / "serve.log").read_text()
    assert "lora_alpha" in log and "absurd" in log


# ---- numbers the database cannot hold -------------------------------------------------------------------------
def test_integers_past_what_the_tables_hold_are_400s(http):
    response = http.delete("/admin/tenants/nobody/keys/3280630296200749613720797184", headers=ADMIN)
    assert_openai_error(response, 400, param="key_id")
    for field, value in (("tokens_per_minute", 2**31), ("token_quota", 2**63)):
        response = http.post("/admin/tenants", headers=ADMIN, json={"name": f"big-{field}", field: value})
        assert_openai_error(response, 400, param=field)
    assert http.post("/admin/tenants", headers=ADMIN, json={"name": "big", "token_quota": 2**40}).status_code == 201
