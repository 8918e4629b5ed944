"""Real loraplex servers for tests: in a thread of this process (introspectable), or as a `loraplex serve`
subprocess (for restarts and signals). Both listen on 127.0.0.1 with a port the OS picks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.server_process import ServeProcess
from gateway.server import make_server
from gateway.settings import ServeSettings
from tests.hf_models import make_adapter, make_model

ADMIN_KEY = "test-admin-key"
BASE = "tiny-llama"
START_TIMEOUT_S = 180


class ServerThread:
    """`with ServerThread(ServeSettings(...)) as server:` → server.url, server.state (the GatewayState)."""

    def __init__(self, settings: ServeSettings):
        self.server = make_server(settings.model_copy(update={"host": "127.0.0.1", "port": 0}))
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self):
        return self.server.app.state.gateway


class ServerProcess(ServeProcess):
    """`loraplex serve ARGS` in a subprocess (bench/server_process.py), within the tests' start-up bound."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        super().__init__(args, log_path, env, START_TIMEOUT_S)


def build_tiny(root: Path, tokenizer, ranks: dict[str, int]):
    """A random tiny Llama in root/base and one random adapter per name in root/adapters/NAME."""
    hf = make_model(root / "base", tokenizer, "llama")
    adapters = {
        name: make_adapter(hf, root / "adapters" / name, seed=i + 1, r=r) for i, (name, r) in enumerate(ranks.items())
    }
    return root, hf, adapters


def settings_for(root: Path, adapters: dict[str, str], **overrides) -> ServeSettings:
    values = {
        "model": str(root / "base"),
        "served_model_name": BASE,
        "lora_modules": [f"{name}={path}" for name, path in adapters.items()],
        "database_url": f"sqlite:///{root / 'registry.db'}",
        "admin_key": ADMIN_KEY,
        "disable_auth": True,
        "device": "cpu",
        "max_loras": 2,  # fewer rows than adapters: rows turn over while requests run
        "kv_cache_memory": "64MiB",
        **overrides,
    }
    return ServeSettings(**values)
