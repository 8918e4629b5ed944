"""`loraplex serve --replicas N`: starts a local Ray instance (or joins `--ray-address`), deploys the Serve
application (gateway/cluster/serve_app.py) with Serve's HTTP proxy on --host/--port, and runs until SIGINT / SIGTERM,
then deletes the application (and stops the local Ray instance it started).

Exit status: 0 after a stop signal, 3 when the application could not be deployed.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from pathlib import Path

from gateway.settings import ServeSettings

logger = logging.getLogger("loraplex")


class RayMissing(RuntimeError):
    pass


def require_ray(settings: ServeSettings):
    """Imports Ray (a one-line RayMissing without it), after setting what Ray reads from the environment at import."""
    if settings.ray_address is not None:
        use_local_token()
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise RayMissing(
            "`loraplex serve --replicas N` runs engine replicas on Ray Serve, which is not installed: "
            "pip install 'loraplex[ray]'"
        ) from None
    return ray


def local_cpus(settings: ServeSettings) -> int:
    """Logical CPUs for a local Ray instance: the machine's, or enough for every replica (Ray's CPUs are a
    reservation, not a binding; the engines size their own thread teams)."""
    wanted = math.ceil(settings.replicas * settings.replica_num_cpus)
    machine = os.cpu_count() or 1
    if wanted > machine:
        logger.warning(
            "%d replicas x %g CPUs oversubscribe this machine's %d cores",
            settings.replicas,
            settings.replica_num_cpus,
            machine,
        )
    return max(machine, wanted)


def use_local_token() -> None:
    """Ray clusters authenticate with a token by default; `ray start --head` on this machine leaves it in
    ~/.ray/auth_token (or it is in RAY_AUTH_TOKEN). Ray uses it by itself only for a cluster it starts, so a
    process joining one turns token mode on when a token is at hand and RAY_AUTH_MODE says nothing (before Ray is
    imported: it reads the mode then)."""
    has_token = "RAY_AUTH_TOKEN" in os.environ or (Path.home() / ".ray" / "auth_token").is_file()
    if "RAY_AUTH_MODE" not in os.environ and has_token:
        os.environ["RAY_AUTH_MODE"] = "token"


def serve_on_ray(settings: ServeSettings) -> int:
    ray = require_ray(settings)
    from ray import serve

    from gateway.cluster.serve_app import APP_NAME, build_application

    joined = settings.ray_address is not None
    if joined:
        ray.init(address=settings.ray_address, namespace="loraplex", logging_level=logging.WARNING)
    else:
        ray.init(
            address="local",  # a new instance, even where another Ray cluster runs on this machine
            num_cpus=local_cpus(settings),
            namespace="loraplex",
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(build_application(settings), name=APP_NAME, route_prefix="/")
        except Exception as e:  # the replicas' own logs say more; this says what failed
            logger.error("the Ray Serve application could not start: %s", e)
            return 3
        logger.info(
            "loraplex ready at http://%s:%d (model %s; %d engine replicas on Ray %s)",
            settings.host,
            settings.port,
            settings.base_model_name,
            settings.replicas,
            settings.ray_address or "(local)",
        )
        stop.wait()
        logger.info("stopping: deleting the Ray Serve application")
        serve.delete(APP_NAME)
        return 0
    finally:
        if not joined:
            serve.shutdown()
        ray.shutdown()
