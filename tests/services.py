"""Real PostgreSQL and Redis servers for integration tests: the ones already listening on 127.0.0.1, or our own.

`ensure_redis()` / `ensure_postgres()` return the URL of a server on 127.0.0.1: the usual one (Redis on 6379,
PostgreSQL on 5432 with trust auth for user `postgres`) when it answers, otherwise one started here on a free
port that lives until the test process exits. Set `LORAPLEX_TEST_OWN_SERVICES=1` to always start our own
(the path a fresh CI machine takes), or `LORAPLEX_TEST_REDIS_URL` / `LORAPLEX_TEST_POSTGRES_URL` to use servers
elsewhere. `tests/run.sh` installs Debian's redis-server and postgresql when their binaries are missing.

Fixtures (made available to every test by tests/conftest.py):
- `postgres_url` (session): a fresh, uniquely named, empty database, dropped at the end; migrate it yourself.
- `redis_url` (session): a URL of a real Redis (db 15); share it, but keep to your own keys:
- `redis_key_prefix` (function): a unique key prefix whose keys are deleted after the test.

`RedisProcess` is a Redis of the test's own, to kill and start again on the same port (outage tests).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

HOST = "127.0.0.1"
OWN_SERVICES = os.environ.get("LORAPLEX_TEST_OWN_SERVICES", "") not in ("", "0")
TEST_REDIS_DB = 15
_started: dict[str, object] = {}  # service name -> our own server process, reused for the whole test run


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_until(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")
        time.sleep(0.02)


def redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def postgres_answers(url: str) -> bool:
    try:
        with psycopg.connect(f"{url}/postgres", connect_timeout=2):
            return True
    except psycopg.Error:
        return False


class RedisProcess:
    """A redis-server of our own on 127.0.0.1:`port`, to stop (gracefully or with SIGKILL) and start again.

    `persistent` keeps data across restarts (append-only file, fsync always), as a production Redis does."""

    def __init__(self, port: int | None = None, persistent: bool = True):
        self.port = port or free_port()
        self.persistent = persistent
        self.directory = Path(tempfile.mkdtemp(prefix="loraplex-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> RedisProcess:
        if self.process is not None:
            return self
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        args = ["--port", str(self.port), "--bind", HOST, "--dir", str(self.directory), "--save", ""]
        args += ["--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always"]
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the child process keeps writing to it
        self.process = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_until(lambda: self._exited() or redis_answers(self.url), 10, f"redis-server on port {self.port}")
        if self._exited():
            self.process = None
            raise RuntimeError(f"redis-server exited: {(self.directory / 'redis.log').read_text()[-2000:]}")
        return self

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def stop(self, kill: bool = False) -> None:
        """Stops the server: SIGTERM (a clean shutdown) or, with `kill`, SIGKILL (a crash)."""
        if self.process is None:
            return
        self.process.kill() if kill else self.process.terminate()
        self.process.wait(timeout=10)
        self.process = None

    def restart(self, kill: bool = False) -> RedisProcess:
        self.stop(kill=kill)
        return self.start()

    def close(self) -> None:
        self.stop(kill=True)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _postgres_binary(name: str) -> str:
    found = shutil.which(name) or max(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), default=None)
    if found is None:
        raise RuntimeError(f"{name} not found: install PostgreSQL (tests/run.sh does on Debian)")
    return found


class PostgresProcess:
    """A throwaway PostgreSQL cluster (initdb + pg_ctl) in a temp dir on 127.0.0.1:`port`, trust auth.

    initdb refuses to run as root, so as root the cluster belongs to, and runs as, the `postgres` user."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
        self.data = self.directory / "data"
        self.running = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.port}"

    def _run(self, *command: str) -> None:
        if os.geteuid() == 0:
            command = (*_as_postgres_user(), *command)
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresProcess:
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
        options = f"-p {self.port} -k {self.directory} -c listen_addresses={HOST} -c fsync=off"
        try:
            self._run(_postgres_binary("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
            log = str(self.directory / "log")
            self._run(_postgres_binary("pg_ctl"), "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"starting PostgreSQL failed: {e.cmd}\n{e.stdout.decode()}{e.stderr.decode()}") from e
        self.running = True
        return self

    def stop(self) -> None:
        if self.running:
            self._run(_postgres_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.running = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _as_postgres_user() -> tuple[str, ...]:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root and there is no `postgres` user to run initdb as") from None
    if shutil.which("runuser"):
        return ("runuser", "-u", "postgres", "--")
    return ("sudo", "-u", "postgres", "--")


def ensure_redis() -> str:
    """The base URL (no db) of a Redis for tests; starts one of our own when none answers."""
    if url := os.environ.get("LORAPLEX_TEST_REDIS_URL"):
        return url
    if "redis" not in _started:
        default = f"redis://{HOST}:6379"
        if not OWN_SERVICES and redis_answers(default):
            return default
        server = RedisProcess(persistent=False).start()
        atexit.register(server.close)
        _started["redis"] = server
    return f"redis://{HOST}:{_started['redis'].port}"


def ensure_postgres() -> str:
    """The base URL (no database) of a PostgreSQL for tests; starts one of our own when none answers."""
    if url := os.environ.get("LORAPLEX_TEST_POSTGRES_URL"):
        return url
    if "postgres" not in _started:
        default = f"postgresql://postgres@{HOST}:5432"
        if not OWN_SERVICES and postgres_answers(default):
            return default
        server = PostgresProcess().start()
        atexit.register(server.close)
        _started["postgres"] = server
    return _started["postgres"].url


def create_database(base_url: str) -> str:
    """Creates a fresh, uniquely named database and returns its URL."""
    name = f"loraplex_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{base_url}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base_url}/{name}"


def drop_database(url: str) -> None:
    base_url, name = url.rsplit("/", 1)
    with psycopg.connect(f"{base_url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def delete_keys(url: str, prefix: str) -> None:
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="session")
def postgres_url():
    url = create_database(ensure_postgres())
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def redis_url():
    return f"{ensure_redis()}/{TEST_REDIS_DB}"


@pytest.fixture
def redis_key_prefix(redis_url):
    prefix = f"loraplex-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    delete_keys(redis_url, prefix)
