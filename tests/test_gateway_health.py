"""Liveness, readiness and who may read /metrics.

`/health` is about this process (the engine thread); `/ready` also about what it needs (the registry schema at
head, Redis when configured), each failing check named. `/metrics` names tenants and private adapters: it needs
the metrics or admin key when one is set, and is loopback-only when none is.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from gateway.errors import APIError
from gateway.routes.metrics import check_scraper
from gateway.settings import ServeSettings
from tests.engine_probe import kill_engine_thread
from tests.gateway_server import ADMIN_KEY, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error

METRICS_KEY = "scrape-only-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("health"), tokenizer, {"sql": 4})


def test_health_is_liveness_and_ready_names_a_schema_that_is_not_at_head(tiny, tmp_path):
    root, _, adapters = tiny
    database = tmp_path / "registry.db"
    settings = settings_for(root, adapters, max_model_len=64, database_url=f"sqlite:///{database}")
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/ready").json() == {"status": "ready"}
        with sqlite3.connect(database) as connection:  # a database nobody migrated
            connection.execute("DELETE FROM alembic_version")
        assert client.get("/health").status_code == 200  # the process is fine: no restart
        assert_openai_error(client.get("/ready"), 503, text="loraplex db upgrade")
        with sqlite3.connect(database) as connection:  # emptied altogether
            connection.execute("DROP TABLE alembic_version")
        assert client.get("/health").status_code == 200
        assert_openai_error(client.get("/ready"), 503, text="registry database cannot be read")


def test_ready_names_an_unreachable_redis(tiny, tmp_path):
    root, _, adapters = tiny
    settings = settings_for(
        root,
        adapters,
        max_model_len=64,
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        redis_url="redis://127.0.0.1:1/0",  # nothing listens on port 1
    )
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        assert_openai_error(client.get("/ready"), 503, text="Redis does not answer")


def test_a_dead_engine_fails_health_and_stops_the_server_with_status_1(tiny, tmp_path):
    root, _, adapters = tiny
    settings = settings_for(root, adapters, max_model_len=64, database_url=f"sqlite:///{tmp_path / 'registry.db'}")
    running = ServerThread(settings).__enter__()
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            kill_engine_thread(running.state.engine)
            assert_openai_error(client.get("/health"), 503, text="engine thread has stopped")
        running.thread.join(timeout=30)  # the watch stops the server by itself
        assert not running.thread.is_alive()
        assert running.server.exit_code == 1
    finally:
        running.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("keys", "token", "host", "allowed"),
    [
        ({}, None, "127.0.0.1", True),
        ({}, None, "::1", True),
        ({}, None, "10.1.2.3", False),  # no key set: remote scrapers are refused
        ({"metrics_key": METRICS_KEY}, METRICS_KEY, "10.1.2.3", True),
        ({"metrics_key": METRICS_KEY}, None, "127.0.0.1", False),  # a key is set: it is needed from anywhere
        ({"metrics_key": METRICS_KEY}, "wrong", "10.1.2.3", False),
        ({"admin_key": ADMIN_KEY}, ADMIN_KEY, "10.1.2.3", True),
        ({"admin_key": ADMIN_KEY, "metrics_key": METRICS_KEY}, METRICS_KEY, "10.1.2.3", True),
    ],
)
def test_who_may_read_metrics(keys, token, host, allowed):
    settings = ServeSettings(model="unused", **keys)
    if allowed:
        check_scraper(settings, token, host)
    else:
        with pytest.raises(APIError) as refused:
            check_scraper(settings, token, host)
        assert refused.value.status_code in (401, 403)


def test_metrics_need_the_key_over_a_real_socket(tiny, tmp_path):
    root, _, adapters = tiny
    settings = settings_for(
        root, adapters, max_model_len=64, database_url=f"sqlite:///{tmp_path / 'r.db'}", metrics_key=METRICS_KEY
    )
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert_openai_error(client.get("/metrics"), 401, text="metrics key")
        assert_openai_error(client.get("/metrics", headers={"Authorization": "Bearer nope"}), 403)
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
        assert scraped.status_code == 200 and 'adapter="sql"' in scraped.text
        # the admin key reads them too
        assert client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
