"""Running the gateway under uvicorn: one ready line with the URL; on SIGINT / SIGTERM a graceful drain (running
requests get `timeout_graceful_shutdown` seconds, see gateway/lifecycle.py), then the lifespan stops the engine.

Exit status: 0 after a drain, 1 when the engine thread died (the supervisor should restart the process), 3 when
the application could not start (uvicorn's own).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from gateway.app import build_app
from gateway.settings import ServeSettings

logger = logging.getLogger("loraplex")


class Server(uvicorn.Server):
    """uvicorn's server, plus the bound address once listening (tests bind port 0), the drain on a stop signal,
    and an exit status."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app
        self.exit_code = 0
        app.state.request_exit = self.request_exit

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            state = self.app.state.gateway
            logger.info("loraplex ready at %s (model %s; API docs at %s/docs)", self.url, state.base_model, self.url)

    def request_exit(self, code: int) -> None:
        """Stops the server; the process then exits with `code` (the worst one asked for)."""
        self.exit_code = max(self.exit_code, code)
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        drain = getattr(self.app.state, "drain", None)
        if drain is not None:
            drain.begin(self.config.timeout_graceful_shutdown or 0.0)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the stop signal once it has shut down (exit status -15); the stop it asked for
            # has happened, cleanly, so the process exits with its own status instead
            self._captured_signals.clear()


def make_server(settings: ServeSettings) -> Server:
    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=settings.timeout_graceful_shutdown,
        access_log=settings.log_level.lower() == "debug",
    )
    return Server(config, app)


def serve(settings: ServeSettings) -> int:
    """Runs until stopped; returns the process's exit status."""
    server = make_server(settings)
    server.run()
    return server.exit_code
