"""Running the gateway under uvicorn: one ready line with the URL, graceful stop on SIGINT / SIGTERM
(running requests get `timeout_graceful_shutdown` seconds to finish, then the lifespan stops the engine)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import build_app
from gateway.settings import ServeSettings

logger = logging.getLogger("loraplex")


class Server(uvicorn.Server):
    """uvicorn's server, plus the bound address once listening (tests bind port 0)."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            state = self.app.state.gateway
            logger.info("loraplex ready at %s (model %s; API docs at %s/docs)", self.url, state.base_model, self.url)


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


def serve(settings: ServeSettings) -> None:
    make_server(settings).run()
