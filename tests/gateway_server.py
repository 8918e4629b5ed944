"""Real loraplex servers for tests: in a thread of this process (introspectable), or as a `loraplex serve`
subprocess (for restarts and signals). Both listen on 127.0.0.1 with a port the OS picks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gateway.server import make_server
from gateway.settings import ServeSettings
from tests.hf_models import make_adapter, make_model

ADMIN_KEY = "test-admin-key"
BASE = "tiny-llama"
READY = re.compile(r"loraplex ready at (http://\S+)")
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


class ServerProcess:
    """`loraplex serve ARGS` in a subprocess; the URL comes from its ready line."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.args, self.log_path = args, log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def __enter__(self) -> ServerProcess:
        command = [sys.executable, "-m", "loraplex.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.args]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.log = open(self.log_path, "a")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.url is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"loraplex serve did not start:\n{self.log_path.read_text()[-4000:]}")
            match = READY.search(self.log_path.read_text()[offset:])
            self.url = match.group(1) if match else None
            time.sleep(0.1)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=90)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()
        self.log.close()


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
