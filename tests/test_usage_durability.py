"""Usage survives Redis: with Redis persistent (append-only file, as deploy/ runs it), killing it with SIGKILL
in the middle of a load, while flushes are under way, loses no request's usage and counts none twice; the
gateway warns at start when Redis keeps nothing on disk."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time

import httpx
import pytest

from tests.gateway_server import ServerThread, build_tiny, settings_for
from tests.services import RedisProcess

REQUESTS = 72
CONCURRENCY = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("durability"), tokenizer, {"sql": 4})


async def load(url: str, served: list[dict], halfway: threading.Event) -> None:
    """REQUESTS short completions, CONCURRENCY at a time; the usage of every 200 goes into `served`."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            model = "sql" if i % 2 else "tiny-llama"
            body = {"model": model, "prompt": f"Alice {i}", "max_tokens": 1 + i % 5, "ignore_eos": True}
            response = await client.post(f"{url}/v1/completions", json=body)
            if response.status_code == 200:
                served.append({"adapter": "" if model == "tiny-llama" else model, **response.json()["usage"]})
            if len(served) == REQUESTS // 2:
                halfway.set()

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))


def rollups(database) -> dict[str, tuple[int, int, int]]:
    with sqlite3.connect(database) as connection:
        rows = connection.execute(
            "SELECT adapter, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM usage_rollups "
            "GROUP BY adapter"
        ).fetchall()
    return {adapter: (requests, prompt, completion) for adapter, requests, prompt, completion in rows}


def test_a_persistent_redis_killed_mid_load_loses_no_usage_and_counts_none_twice(tiny, tmp_path):
    root, _, adapters = tiny
    database = tmp_path / "registry.db"
    with RedisProcess(persistent=True) as redis_server:
        settings = settings_for(
            root,
            adapters,
            max_model_len=64,
            database_url=f"sqlite:///{database}",
            redis_url=redis_server.url,
            redis_key_prefix="durability:",
            usage_flush_interval=0.2,  # flushes run all through the load, and through the kill
        )
        served: list[dict] = []
        halfway = threading.Event()
        with ServerThread(settings) as server:
            loader = threading.Thread(target=lambda: asyncio.run(load(server.url, served, halfway)))
            loader.start()
            assert halfway.wait(120)
            redis_server.stop(kill=True)  # SIGKILL: a crash, with requests in flight
            time.sleep(0.5)
            redis_server.start()  # the same port and directory: it replays its append-only file
            loader.join(timeout=120)
        # the server has stopped: its final flush ran
    assert len(served) == REQUESTS
    expected: dict[str, tuple[int, int, int]] = {}
    for usage in served:
        requests, prompt, completion = expected.get(usage["adapter"], (0, 0, 0))
        expected[usage["adapter"]] = (
            requests + 1,
            prompt + usage["prompt_tokens"],
            completion + usage["completion_tokens"],
        )
    assert rollups(database) == expected


def test_the_gateway_warns_when_redis_keeps_nothing_on_disk(tiny, tmp_path, caplog):
    root, _, adapters = tiny
    with RedisProcess(persistent=False) as redis_server, caplog.at_level(logging.WARNING):
        settings = settings_for(
            root, adapters, database_url=f"sqlite:///{tmp_path / 'r.db'}", redis_url=redis_server.url
        )
        with ServerThread(settings):
            pass
    warnings = [r.getMessage() for r in caplog.records if "appendonly=no" in r.getMessage()]
    assert warnings and "--appendonly yes" in warnings[0]
