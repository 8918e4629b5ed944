"""The Ray Serve application: the gateway (`LoraplexIngress`, the same FastAPI app as `loraplex serve`) in front of
`EngineReplica` × N.

    loraplex serve --model DIR --replicas 2                 # gateway/cluster/launch.py deploys this
    import_path: gateway.cluster.serve_app:app_builder      # KubeRay RayService / `serve run` (args: ServeSettings)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from gateway.app import build_app
from gateway.cluster.remote_engine import RemoteEngine
from gateway.cluster.replica import EngineReplica
from gateway.settings import ServeSettings

logger = logging.getLogger(__name__)
APP_NAME = "loraplex"
INGRESS_MAX_ONGOING_REQUESTS = 4096  # the gateway only waits on the replicas; Ray's default (5) would queue at it


@serve.ingress()
class LoraplexIngress:
    """The gateway's FastAPI app, built inside the ingress replica around a RemoteEngine."""

    def __init__(self, settings: ServeSettings, engine):
        self.settings, self.engine = settings, engine

    def __serve_build_asgi_app__(self):
        async def remote_engine(settings: ServeSettings, model_dir: str) -> RemoteEngine:
            return await RemoteEngine.connect(self.engine, route_by_adapter=settings.replica_routing == "adapter")

        return build_app(self.settings, make_engine=remote_engine)


def replica_gpus(settings: ServeSettings) -> float:
    if settings.replica_num_gpus is not None:
        return settings.replica_num_gpus
    on_cuda = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    return 1.0 if on_cuda else 0.0


def build_application(settings: ServeSettings) -> serve.Application:
    if settings.model is None:
        raise ValueError("the Ray Serve application needs `model` (a model directory or GGUF file on every node)")
    if settings.replicas < 1:
        raise ValueError("the Ray Serve application needs `replicas` >= 1")
    if settings.ingress_replicas > 1 and not settings.redis_url:
        logger.warning(
            "%d gateway replicas without --redis-url: each keeps its own usage counters and rate limits",
            settings.ingress_replicas,
        )
    router = (
        RequestRouterConfig(request_router_class="gateway.cluster.round_robin:RoundRobinRouter")
        if settings.replica_routing == "round-robin"
        else RequestRouterConfig()
    )
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.replica_num_cpus, "num_gpus": replica_gpus(settings)},
        max_ongoing_requests=max(64, 2 * settings.max_num_seqs),  # continuous batching wants the whole batch
        health_check_period_s=5,
        request_router_config=router,
    )
    ingress = serve.deployment(
        LoraplexIngress,
        name="LoraplexIngress",
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    )
    return ingress.bind(settings, engine.bind(settings, settings.model))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder (KubeRay's `serveConfigV2`, `serve run`): `args` are ServeSettings fields;
    `LORAPLEX_*` environment variables fill in the rest."""
    return build_application(ServeSettings(**args))
