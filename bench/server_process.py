"""`loraplex serve` in a subprocess (benchmarks, and the tests that restart or signal a server): 127.0.0.1, a port
the OS picks, its URL from the ready line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import BenchError

READY = re.compile(r"loraplex ready at (http://\S+)")


class ServeProcess:
    """`with ServeProcess(args, log_path) as server:` → server.url, server.process. The log is appended to (several
    servers in turn may share one file) and only what this server wrote is searched for its ready line."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, start_timeout_s: float = 300.0
    ):
        self.args, self.log_path, self.start_timeout_s = args, log_path, start_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServeProcess:
        command = [sys.executable, "-m", "loraplex.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.args]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log = open(self.log_path, "a")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.start_timeout_s
        while not self.url:
            written = self.log_path.read_text()[offset:]
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BenchError(f"loraplex serve did not start:\n{written[-4000:]}")
            match = READY.search(written)
            self.url = match.group(1) if match else ""
            time.sleep(0.1)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends `sig` (if it still runs) and returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=90)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()
