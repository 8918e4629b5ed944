"""`loraplex serve` in a subprocess for a benchmark: 127.0.0.1, a port the OS picks, its URL from the ready line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import BenchError

READY = re.compile(r"loraplex ready at (http://\S+)")


class ServeProcess:
    def __init__(self, args: list[str], log_path: Path, start_timeout_s: float = 300.0):
        self.args, self.log_path, self.start_timeout_s = args, log_path, start_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServeProcess:
        command = [sys.executable, "-m", "loraplex.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.args]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while not self.url:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BenchError(f"loraplex serve did not start:\n{self.log_path.read_text()[-3000:]}")
            match = READY.search(self.log_path.read_text())
            self.url = match.group(1) if match else ""
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()
