"""deploy/ for the Ray Serve mode: the KubeRay RayService (deploy/k8s/ray) and the compose topology (a Ray head
running the gateway, Ray workers for the engine replicas) name the real application builder, settings, deployments
and `ray start` options, and their numbers fit together. Offline: no cluster, no docker; ray is imported only for
its Serve config schema and its `ray start` options. test_deploy_files.py checks the rest (schemas, references)."""

from __future__ import annotations

import ast
import math
import re

import pytest
import yaml

from gateway.settings import ServeSettings
from loraplex.flags import settings_from_args
from tests.test_deploy_files import (
    DOCKERFILE,
    GATEWAY_SERVICE,
    K8S,
    ROOT,
    SETTING_VARS,
    compose,
    interpolate,
    is_loraplex_image,
    kustomization_objects,
    parse_cli,
    secret_template,
    service_commands,
    settings_from,
)

RAY_K8S = K8S / "ray"
REQUIREMENTS_DEV = ROOT / "deploy" / "requirements-dev.txt"
DEPLOYMENTS = {"LoraplexIngress", "EngineReplica"}
WORKER_SERVICE = "ray-worker"


def ray_pin() -> str:
    match = re.search(r"^ray\[serve\]==(\S+)$", REQUIREMENTS_DEV.read_text(), flags=re.MULTILINE)
    assert match, "deploy/requirements-dev.txt pins ray[serve]==VERSION"
    return match.group(1)


def rayservice() -> dict:
    [service] = [o for o in kustomization_objects(RAY_K8S) if o["kind"] == "RayService"]
    return service


def serve_config() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def application() -> dict:
    [app] = serve_config()["applications"]
    return app


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in application()["deployments"]}


def ray_groups() -> dict[str, dict]:
    """The head group and every worker group, by group name."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU or count quantity: 4, "4", "500m"."""
    value = str(value)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def group_resources(group: dict) -> tuple[float, float]:
    """(CPUs, GPUs) Ray sees on one pod of a group: rayStartParams, else the container's limits (as KubeRay does)."""
    params = group["rayStartParams"]
    container = group["template"]["spec"]["containers"][0]
    limits = container.get("resources", {}).get("limits", {})
    cpus = quantity(params.get("num-cpus", limits.get("cpu", 0)))
    gpus = quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    return cpus, gpus


def replicas_per_node(cpus: float, gpus: float, replica_cpus: float, replica_gpus: float) -> int:
    fits = [math.floor(cpus / replica_cpus + 1e-9) if replica_cpus else math.inf]
    fits.append(math.floor(gpus / replica_gpus + 1e-9) if replica_gpus else math.inf)
    return min(fits)


def byte_size(size: str | int) -> float:
    """Compose byte sizes: 2gb, 512m, 1000000."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(size).lower()).groups()
    return float(number) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit]


def ray_start(argv: list[str]) -> dict:
    """The options of a `ray start` command line, parsed by ray's own CLI (an unknown option fails)."""
    import click
    from ray.scripts.scripts import start

    assert argv[:2] == ["ray", "start"], f"not a `ray start` command line: {argv}"
    try:
        return start.make_context("ray start", list(argv[2:])).params
    except click.ClickException as e:
        pytest.fail(f"`{' '.join(argv)}`: {e.format_message()}")


# --- KubeRay: the Serve application ---


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve's own pydantic usage, on import
def test_serve_config_matches_ray_serve_schema():
    """Ray Serve's own schema, and no key it does not know (it ignores unknown keys: a typo would go unnoticed)."""
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    config = serve_config()
    ServeDeploySchema.model_validate(config)
    levels = [(config, ServeDeploySchema, "serveConfigV2"), (config.get("http_options", {}), HTTPOptionsSchema, "http")]
    for app in config["applications"]:
        levels.append((app, ServeApplicationSchema, app["name"]))
        for deployment in app.get("deployments", []):
            levels.append((deployment, DeploymentSchema, deployment["name"]))
            levels.append((deployment.get("ray_actor_options", {}), RayActorOptionsSchema, deployment["name"]))
    for data, schema, where in levels:
        unknown = set(data) - set(schema.model_fields)
        assert not unknown, f"{where}: {sorted(unknown)} are not fields of Ray Serve's {schema.__name__}"


def test_serve_application_is_loraplex_app_builder():
    app = application()
    module, _, attribute = app["import_path"].partition(":")
    assert (module, attribute) == ("gateway.cluster.serve_app", "app_builder")
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.is_file(), f"{app['import_path']}: no {source.relative_to(ROOT)}"
    tree = ast.parse(source.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert attribute in functions, f"{source.relative_to(ROOT)} defines no function {attribute}"
    assert len(functions[attribute].args.args) == 1, "Ray Serve calls an application builder with one argument"
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert app["name"] == constants.get("APP_NAME", "loraplex"), "the name `loraplex serve --replicas` deploys"
    assert app["route_prefix"] == "/"


def test_serve_args_are_settings(monkeypatch):
    """`args` are ServeSettings fields and, with the pods' ConfigMap and Secret, make valid settings for Ray mode."""
    args = application()["args"]
    unknown = set(args) - set(ServeSettings.model_fields)
    assert not unknown, f"serveConfigV2 args {sorted(unknown)} are not ServeSettings fields"
    config = next(o for o in kustomization_objects(RAY_K8S) if o["kind"] == "ConfigMap")
    secrets = {name: "x" for name in secret_template()["stringData"]}  # the real values are not checked in
    settings = settings_from({**config["data"], **secrets}, monkeypatch).model_copy(update=args)
    ServeSettings.model_validate(settings.model_dump())
    assert settings.model and settings.replicas >= 1, "the Ray Serve application needs model and replicas >= 1"
    assert not {"database_url", "redis_url", "admin_key", "metrics_key"} & set(args), "secrets: in loraplex-secrets"


def test_serve_deployments_match_args():
    """The deployments' options override what app_builder derives from args: they must say the same."""
    by_name = deployments()
    assert set(by_name) == DEPLOYMENTS
    args, defaults = application()["args"], ServeSettings.model_fields

    def setting(name):
        return args.get(name, defaults[name].default)

    engine, ingress = by_name["EngineReplica"], by_name["LoraplexIngress"]
    assert engine["num_replicas"] == setting("replicas")
    assert engine["ray_actor_options"]["num_cpus"] == setting("replica_num_cpus")
    assert engine["ray_actor_options"].get("num_gpus", 0) == setting("replica_num_gpus")
    assert ingress.get("num_replicas", 1) == setting("ingress_replicas")


# --- KubeRay: the Ray cluster ---


def test_ray_cluster_pods():
    spec = rayservice()["spec"]
    assert rayservice()["apiVersion"] == "ray.io/v1"
    assert spec["rayClusterConfig"]["rayVersion"] == ray_pin(), "rayVersion: the ray in the image"
    groups = ray_groups()
    assert len(groups) >= 2, "a head group and at least one worker group"
    http_port = serve_config().get("http_options", {}).get("port", 8000)
    for name, group in groups.items():
        assert isinstance(group.get("rayStartParams"), dict), f"{name}: rayStartParams"
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert is_loraplex_image(container["image"]), f"{name}: {container['image']} is not the loraplex image"
            # KubeRay puts `ray start` in place of the entrypoint; command or args would run before it
            assert "command" not in container and "args" not in container, f"{name}: KubeRay starts ray"
            env = {var["name"] for var in container.get("env", [])}
            unknown = {var for var in env if var.startswith("LORAPLEX_")} - SETTING_VARS
            assert not unknown, f"{name}: {sorted(unknown)} are not settings"
            sources = {next(iter(s.values()))["name"] for s in container.get("envFrom", [])}
            assert {"loraplex-config", secret_template()["metadata"]["name"]} <= sources, f"{name}: the settings"
            serve_ports = {p["containerPort"] for p in container.get("ports", []) if p.get("name") == "serve"}
            assert serve_ports <= {http_port}, f"{name}: the Serve proxy listens on {http_port}"
        mounts = {m["mountPath"]: m for c in pod["containers"] for m in c.get("volumeMounts", [])}
        args = application()["args"]
        assert args["model"].startswith("/models/") and mounts["/models"].get("readOnly"), f"{name}: the model"


def test_engine_replicas_fit_the_ray_cluster():
    engine = deployments()["EngineReplica"]
    need_cpus = engine["ray_actor_options"]["num_cpus"]
    need_gpus = engine["ray_actor_options"].get("num_gpus", 0)
    capacity = 0
    for name, group in ray_groups().items():
        pods = 1 if name == "head" else group["replicas"]
        if name != "head":
            assert group.get("minReplicas", 0) <= pods <= group.get("maxReplicas", pods)
        capacity += pods * replicas_per_node(*group_resources(group), need_cpus, need_gpus)
    assert capacity >= engine["num_replicas"], f"{engine['num_replicas']} engine replicas, room for {capacity}"


# --- the image and the pins ---


def test_ray_version_is_one_pin():
    pin = ray_pin()
    installs = re.findall(r"ray\[serve\]==(\S+?)\"", DOCKERFILE.read_text())
    assert installs == [pin], "deploy/Dockerfile installs the ray[serve] that requirements-dev.txt pins"
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == pin


# --- compose: a Ray head with the gateway, Ray workers with the engine replicas ---


def compose_settings(monkeypatch) -> ServeSettings:
    """What `loraplex serve` in the gateway service runs with: its flags, then its environment."""
    head = compose()["services"][GATEWAY_SERVICE]
    [serve] = [argv for argv in service_commands(head) if argv[0] == "loraplex"]
    env = {name: interpolate(value) for name, value in head["environment"].items()}
    settings_from(env, monkeypatch)  # sets the environment
    return settings_from_args(ServeSettings, parse_cli(serve[1:]), "serve")


def compose_ray_nodes() -> tuple[dict, dict]:
    """The `ray start` options of the head and of a worker."""
    services = compose()["services"]
    [head] = [argv for argv in service_commands(services[GATEWAY_SERVICE]) if argv[0] == "ray"]
    [worker] = service_commands(services[WORKER_SERVICE])
    return ray_start(head), ray_start(worker)


def test_compose_ray_start_command_lines():
    services = compose()["services"]
    head, worker = compose_ray_nodes()
    assert head["head"] and not head["block"], "the head starts Ray, then runs `loraplex serve`"
    assert not worker["head"] and worker["block"], "a worker's container lives as long as its Ray node"
    assert worker["address"] == f"{GATEWAY_SERVICE}:{head['port'] or 6379}"
    for name, options in ((GATEWAY_SERVICE, head), (WORKER_SERVICE, worker)):
        # /dev/shm (64 MB in a container unless raised) must hold the object store, or Ray falls back to /tmp
        assert options["object_store_memory"], f"{name}: --object-store-memory, within its shm_size"
        assert options["object_store_memory"] < byte_size(services[name]["shm_size"]), f"{name}: shm_size too small"


def test_compose_gateway_runs_on_ray(monkeypatch):
    settings = compose_settings(monkeypatch)
    assert settings.replicas >= 2, "the compose file shows more than one engine replica"
    assert settings.ray_address == "auto", "`loraplex serve` joins the head's Ray instance"
    assert settings.host == "0.0.0.0"
    ports = [interpolate(p).split(":") for p in compose()["services"][GATEWAY_SERVICE]["ports"]]
    assert [str(settings.port)] * 2 in [p[-2:] for p in ports], "Serve's HTTP proxy is published"


def test_compose_engine_replicas_fit_the_workers(monkeypatch):
    settings = compose_settings(monkeypatch)
    services = compose()["services"]
    head, worker = compose_ray_nodes()
    per_worker = replicas_per_node(
        worker["num_cpus"] or 0, worker["num_gpus"] or 0, settings.replica_num_cpus, settings.replica_num_gpus
    )
    on_head = replicas_per_node(
        head["num_cpus"] or 0, head["num_gpus"] or 0, settings.replica_num_cpus, settings.replica_num_gpus
    )
    room = on_head + services[WORKER_SERVICE]["deploy"]["replicas"] * per_worker
    assert room >= settings.replicas, f"{settings.replicas} engine replicas, room for {room} on the Ray nodes"


def test_compose_ray_nodes_see_the_same_files():
    """The model (and the demo in /cache) must be at the same path on every Ray node; the worker is the image."""
    services = compose()["services"]
    head, worker = services[GATEWAY_SERVICE], services[WORKER_SERVICE]
    assert sorted(head["volumes"]) == sorted(worker["volumes"])
    assert head["image"] == worker["image"] and is_loraplex_image(worker["image"])
    assert head.get("shm_size") and worker.get("shm_size")
    assert worker.get("healthcheck", {}).get("disable") is True, "the image's check is the gateway's /health"
    assert worker["depends_on"][GATEWAY_SERVICE]["condition"] == "service_started", "not healthy: it needs workers"
