"""The registry outlives the process: register over admin REST, use it, stop the server (SIGTERM: a clean
exit), start it again, use it again, delete it, then 404; on SQLite and on PostgreSQL. Also `loraplex db
upgrade`, and `--lora-modules` in vLLM's JSON form registered idempotently across restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from tests.gateway_server import ADMIN_KEY, BASE, ServerProcess, build_tiny

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("restart"), tokenizer, {"sql": 8, "late": 4})


def serve_args(root, adapters, registry_url) -> list[str]:
    module = json.dumps({"name": "sql", "path": adapters["sql"], "base_model_name": BASE})
    return [
        "--model", str(root / "base"), "--served-model-name", BASE, "--device", "cpu",
        "--kv-cache-memory", "32MiB", "--database-url", registry_url, "--admin-key", ADMIN_KEY,
        "--disable-auth", "--adapter-root", str(root / "adapters"), "--lora-modules", module,
    ]  # fmt: skip


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Alice", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def stream_through_stop(server: ServerProcess, sig: int) -> list[dict]:
    """Starts a long stream, signals the server once the first chunk arrived, reads the stream to its end."""
    body = {"model": "late", "prompt": "Alice", "max_tokens": 40, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 1:
                    server.process.send_signal(sig)
    return chunks


def test_registered_adapters_survive_a_restart_until_deleted(tiny, registry_url, tmp_path):
    root, _, adapters = tiny
    upgrade = [sys.executable, "-m", "loraplex.cli", "db", "upgrade", "--database-url", registry_url]
    subprocess.run(upgrade, check=True, capture_output=True, timeout=120)
    log = tmp_path / "serve.log"
    args = serve_args(root, adapters, registry_url)
    with ServerProcess(args, log) as server:
        registered = httpx.post(
            f"{server.url}/admin/adapters", headers=ADMIN, json={"name": "late", "path": adapters["late"]}, timeout=60
        )
        assert registered.status_code == 201, registered.text
        first = complete(server.url, "late")
        assert first.status_code == 200
        chunks = stream_through_stop(server, signal.SIGTERM)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the running stream ended normally
        assert server.process.wait(timeout=90) == 0  # a clean drain
    assert "loraplex stopped" in log.read_text()  # the lifespan ran to its end: engine and database closed

    with ServerProcess(args, log) as server:
        again = complete(server.url, "late")
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        listed = httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"]
        assert sorted(a["id"] for a in listed) == ["late@1", "sql@1"]  # --lora-modules did not add a version
        assert httpx.delete(f"{server.url}/admin/adapters/late", headers=ADMIN).status_code == 200
        assert complete(server.url, "late").status_code == 404
        assert server.stop(signal.SIGINT) == 0

    with ServerProcess(args, log) as server:
        assert complete(server.url, "late").status_code == 404
        assert complete(server.url, "sql").status_code == 200
