"""The deploy/ files (Dockerfile, docker-compose.yml, Kubernetes manifests, README) stay in step with the code:
they parse, name only real settings and subcommands, reference files and objects that exist, and the image
copies every package. Fast: no network, no docker, no cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from gateway.routes.health import router as health_router
from gateway.settings import ENV_PREFIX, ServeSettings
from loraplex.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
README = DEPLOY / "README.md"

SETTING_VARS = {ENV_PREFIX + name.upper() for name in ServeSettings.model_fields}
ENV_VAR = re.compile(rf"\b{ENV_PREFIX}[A-Z0-9_]+\b")
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects(directory: Path = K8S) -> list[dict]:
    """The objects of every manifest directly in `directory` (kustomizations excluded, templates included)."""
    return [
        doc for path in sorted(directory.glob("*.yaml")) if path.name != "kustomization.yaml" for doc in load_all(path)
    ]


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return obj["spec"]["template"]["spec"]
    return None


def is_loraplex_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0] == "loraplex"


def parse_cli(argv: list[str]):
    """argv as `loraplex` parses it; a bad subcommand or option fails the test instead of exiting."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`loraplex {shlex.join(argv)}` is not a valid loraplex command line")


def shell_invocations(script: str) -> list[list[str]]:
    """The argument lists of each `loraplex ...` in a shell script (up to the next ; & | or newline)."""
    return [shlex.split(match) for match in re.findall(r"\bloraplex\s+([^;&|\n]+)", script)]


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_loraplex_services() -> dict[str, dict]:
    return {name: svc for name, svc in compose()["services"].items() if is_loraplex_image(svc.get("image", ""))}


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` -> default, `${VAR:?message}` / `${VAR}` -> a stand-in, `$$` -> `$`."""
    value = str(value).replace("$$", "\0")  # an escaped dollar is not interpolated
    value = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{[A-Z0-9_]+(:\?[^}]*)?\}", "stand-in", value)
    return value.replace("\0", "$")


def settings_from(env: dict[str, str], monkeypatch) -> ServeSettings:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    return ServeSettings()


def seconds(duration: str | int) -> float:
    """Compose durations: 45s, 1m30s, 2m."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts, f"unreadable duration {duration!r}"
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(number) * scale[unit] for number, unit in parts)


# --- every file parses ---


def test_there_are_deploy_files():
    assert DOCKERFILE.is_file() and COMPOSE.is_file() and README.is_file()
    assert (K8S / "kustomization.yaml").is_file() and (K8S / "dev" / "kustomization.yaml").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_file_parses(path):
    docs = load_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in docs)
    if path.is_relative_to(K8S) and path.name != "kustomization.yaml":
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path}: not a Kubernetes object"
            assert "namespace" not in doc["metadata"], f"{path}: manifests are namespace-free"


# --- settings named in deploy files are real ---


def test_every_loraplex_variable_in_deploy_files_is_a_setting():
    unknown = {}
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            names = set(ENV_VAR.findall(path.read_text(errors="replace"))) - SETTING_VARS
            if names:
                unknown[str(path.relative_to(ROOT))] = sorted(names)
    assert not unknown, f"not ServeSettings fields (renamed or misspelled?): {unknown}"


def test_readme_settings_table_lists_every_setting_once():
    rows = re.findall(rf"^\| `({ENV_PREFIX}[A-Z0-9_]+)` \|", README.read_text(), flags=re.MULTILINE)
    assert sorted(rows) == sorted(SETTING_VARS), "deploy/README.md's settings table is out of date"


def test_compose_gateway_environment_is_valid_settings(monkeypatch):
    env = {k: interpolate(v) for k, v in compose()["services"]["loraplex"]["environment"].items()}
    settings = settings_from(env, monkeypatch)
    assert settings.database_url.startswith("postgresql://")
    assert settings.redis_url.startswith("redis://")
    assert settings.adapter_root == ["/adapters"]
    assert settings.admin_key
    assert settings.auth_enabled  # tenant keys required, even for the demo


def test_k8s_config_and_secret_template_are_valid_settings(monkeypatch):
    objects = k8s_objects()
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "loraplex-config")
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "loraplex-secrets")
    assert all(isinstance(v, str) for v in config["data"].values()), "ConfigMap values must be strings"
    assert all("REPLACE_ME" in v for v in secret["stringData"].values()), "the Secret template holds placeholders"
    settings = settings_from({**config["data"], **secret["stringData"]}, monkeypatch)
    assert settings.host == "0.0.0.0"
    assert settings.adapter_root == ["/adapters"]
    assert settings.database_url.startswith("postgresql://")
    assert settings.redis_url.startswith("redis://")
    assert settings.auth_enabled


def test_image_sets_the_host_and_port_the_probes_use():
    env = dict(re.findall(rf"\b({ENV_PREFIX}[A-Z0-9_]+)=(\S+)", DOCKERFILE.read_text()))
    assert env[ENV_PREFIX + "HOST"] == "0.0.0.0"
    assert re.search(r"^EXPOSE 8000$", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert int(env.get(ENV_PREFIX + "PORT", ServeSettings.model_fields["port"].default)) == 8000


# --- commands are real subcommands ---


def test_dockerfile_entrypoint_and_cmd():
    text = DOCKERFILE.read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, flags=re.MULTILINE).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", text, flags=re.MULTILINE).group(1))
    assert entrypoint == ["loraplex"] and "loraplex" in scripts
    assert parse_cli(cmd).func.__name__ == "_serve"
    assert re.search(r"^USER (?!root|0\b)\S+", text, flags=re.MULTILINE), "the image runs as a non-root user"
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim", text, flags=re.MULTILINE)
    assert re.search(r"^ARG PYTHON_VERSION=3\.11$", text, flags=re.MULTILINE)


def test_compose_commands_are_loraplex_subcommands():
    services = compose_loraplex_services()
    handlers = {}
    for name, svc in services.items():
        if "entrypoint" in svc:  # a shell wrapper: check every loraplex call in it
            script = " ".join([*svc["entrypoint"], *svc.get("command", [])])
            calls = shell_invocations(script)
            assert calls, f"service {name} overrides the entrypoint without calling loraplex"
            handlers[name] = [parse_cli(argv).func.__name__ for argv in calls]
        else:
            handlers[name] = [parse_cli(svc.get("command", ["serve"])).func.__name__]
    assert handlers["loraplex"] == ["_serve"]
    assert handlers["migrate"] == ["_db_upgrade"]
    assert parse_cli(["db", "upgrade", "--database-url", "x"]).database_url == "x"


def test_k8s_commands_are_loraplex_subcommands():
    handlers = {}
    for obj in [*k8s_objects(), *k8s_objects(K8S / "dev")]:
        spec = pod_spec(obj)
        for container in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
            if is_loraplex_image(container["image"]):
                assert "command" not in container, "keep the image's entrypoint (loraplex); pass args"
                handlers[obj["metadata"]["name"]] = parse_cli(container["args"]).func.__name__
    assert handlers == {"loraplex": "_serve", "loraplex-migrate": "_db_upgrade"}


# --- the image holds the package ---


def test_dockerfile_copies_every_package_directory():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted({pattern.rstrip("*").rstrip(".") for pattern in patterns})
    assert packages and all((ROOT / p / "__init__.py").is_file() for p in packages)
    text = DOCKERFILE.read_text()
    copied = {
        src.rstrip("/")
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.MULTILINE)
        for src in line.split()[:-1]
    }
    missing = [p for p in packages if p not in copied]
    assert not missing, f"deploy/Dockerfile does not copy {missing}"
    # setuptools needs the files pyproject.toml names, and the dependencies come from the pinned list
    assert {"pyproject.toml", pyproject["project"]["readme"], "deploy/requirements.txt"} <= copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    if "**" in ignore or "*" in ignore:  # an allow list: everything copied must be let back in
        assert all(f"!{src}" in ignore for src in copied), "Dockerfile.dockerignore hides a copied path"


def test_dockerfile_healthcheck_uses_health_without_curl():
    text = DOCKERFILE.read_text()
    healthcheck = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, flags=re.MULTILINE | re.DOTALL).group(0)
    assert "/health" in healthcheck and "urllib" in healthcheck and "curl" not in healthcheck
    assert "/health" in {route.path for route in health_router.routes}


# --- Kubernetes: files and references exist ---


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_lists_existing_files(path):
    kustomization = yaml.safe_load(path.read_text())
    listed = kustomization.get("resources", [])
    assert listed
    for resource in listed:
        target = path.parent / resource
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {resource} does not exist"
    for generator in kustomization.get("secretGenerator", []) + kustomization.get("configMapGenerator", []):
        for item in generator.get("files", []) + generator.get("envs", []):
            assert (path.parent / item.split("=")[-1]).is_file(), f"{path}: {item} does not exist"
    # every manifest beside it is listed, except templates (*.example.yaml) that must not be applied as they are
    beside = {p.name for p in path.parent.glob("*.yaml")} - {"kustomization.yaml"}
    unlisted = sorted(name for name in beside - set(listed) if not name.endswith(".example.yaml"))
    assert not unlisted, f"{path}: not listed: {unlisted}"


def test_k8s_references_resolve():
    objects = k8s_objects()
    named = {(o["kind"], o["metadata"]["name"]) for o in objects}
    secret = next(o for o in objects if o["kind"] == "Secret")
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in named
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in named
        mounts = {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= mounts
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert ("ConfigMap", source["configMapRef"]["name"]) in named
                if "secretRef" in source:
                    assert source["secretRef"]["name"] == secret["metadata"]["name"]
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_k8s_deployment():
    objects = k8s_objects()
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    spec = deployment["spec"]
    pod = spec["template"]
    container = pod["spec"]["containers"][0]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    for kind in ("Service", "PodDisruptionBudget"):
        obj = next(o for o in objects if o["kind"] == kind)
        selector = obj["spec"]["selector"].get("matchLabels", obj["spec"]["selector"])
        assert selector.items() <= pod["metadata"]["labels"].items(), f"the {kind} selects no gateway pod"
    service = next(o for o in objects if o["kind"] == "Service")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8000
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    paths = {"startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in paths.items():  # liveness is the process alone; readiness also what it needs
        check = container[probe]["httpGet"]
        assert check["path"] == path and ports.get(check["port"], check["port"]) == 8000
        assert path in {route.path for route in health_router.routes}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading needs minutes"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert all(m.get("readOnly") for m in container["volumeMounts"] if m["mountPath"] == "/adapters")
    config = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    graceful = float(
        config.get(
            ENV_PREFIX + "TIMEOUT_GRACEFUL_SHUTDOWN", ServeSettings.model_fields["timeout_graceful_shutdown"].default
        )
    )
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[-1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert pod["spec"]["terminationGracePeriodSeconds"] > graceful + pause


# --- compose ---


def test_compose_services():
    services = compose()["services"]
    assert {"postgres", "redis", "migrate", "loraplex"} <= services.keys()
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert services["redis"]["image"].split(":")[1].startswith("7")
    assert "--appendonly yes" in " ".join(services["redis"]["command"]), "usage counters must survive restarts"
    gateway = services["loraplex"]
    assert gateway["deploy"]["replicas"] >= 2
    assert gateway["environment"][ENV_PREFIX + "ADMIN_KEY"].startswith("${" + ENV_PREFIX + "ADMIN_KEY:?")
    assert any(interpolate(v).split(":")[1:] == ["/adapters", "ro"] for v in gateway["volumes"]), "adapters: read-only"
    depends = gateway["depends_on"]
    assert depends["postgres"]["condition"] == depends["redis"]["condition"] == "service_healthy"
    assert depends["migrate"]["condition"] == "service_completed_successfully"
    for name in ("postgres", "redis"):
        assert "healthcheck" in services[name]
    assert "/ready" in " ".join(gateway["healthcheck"]["test"])  # the proxy waits for a ready gateway
    declared = set(compose().get("volumes", {}))
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = interpolate(volume).split(":")[0]
            assert source.startswith((".", "/")) or source in declared, f"undeclared volume {source}"
    graceful = float(
        gateway["environment"].get(
            ENV_PREFIX + "TIMEOUT_GRACEFUL_SHUTDOWN", ServeSettings.model_fields["timeout_graceful_shutdown"].default
        )
    )
    assert seconds(gateway["stop_grace_period"]) > graceful


def test_dev_redis_is_append_only():
    redis = next(o for o in k8s_objects(K8S / "dev") if o["kind"] == "StatefulSet" and "redis" in o["metadata"]["name"])
    args = " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in args
