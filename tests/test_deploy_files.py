"""The deploy/ files (Dockerfile, docker-compose.yml, Kubernetes manifests, README) stay in step with the code:
they parse, name only real settings and subcommands, reference files and objects that exist, every built-in
Kubernetes object validates against the Kubernetes schemas, and the image copies every package. Fast: no network,
no docker, no cluster. The Ray Serve parts (deploy/k8s/ray, the compose topology) are in test_deploy_ray.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
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
SECRET_TEMPLATE = K8S / "secret.example.yaml"  # loraplex-secrets: created by hand, never applied as it is
GATEWAY_SERVICE = "ray-head"  # the compose service that runs `loraplex serve`
# Kubernetes version the built-in objects are validated against (kubernetes-validate ships its schemas, offline)
K8S_VERSION = "1.35.0"
CUSTOM_RESOURCES = {("ray.io/v1", "RayService")}  # no schema in kubernetes-validate: checked in test_deploy_ray.py

SETTING_VARS = {ENV_PREFIX + name.upper() for name in ServeSettings.model_fields}
ENV_VAR = re.compile(rf"\b{ENV_PREFIX}[A-Z0-9_]+\b")
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_files() -> list[Path]:
    """Every manifest under deploy/k8s (kustomizations excluded, templates included)."""
    return sorted(path for path in K8S.rglob("*.yaml") if path.name != "kustomization.yaml")


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def kustomization_objects(directory: Path) -> list[dict]:
    """The objects `kubectl apply -k directory` makes from files: its resources, directories followed (objects
    from generators are in `generated_keys`)."""
    objects = []
    for resource in kustomization(directory)["resources"]:
        target = directory / resource
        objects += kustomization_objects(target) if target.is_dir() else load_all(target)
    return objects


def generated_keys(directory: Path, generator: str = "secretGenerator") -> dict[str, set[str]]:
    """name -> keys of the Secrets (or ConfigMaps) the kustomization's generators make, directories followed."""
    keys = {}
    for resource in kustomization(directory)["resources"]:
        if (directory / resource).is_dir():
            keys |= generated_keys(directory / resource, generator)
    for gen in kustomization(directory).get(generator, []):
        names = {item.split("=")[0] for item in gen.get("literals", [])}
        names |= {Path(item.split("=")[0]).name for item in gen.get("files", [])}
        for env_file in gen.get("envs", []):
            lines = (directory / env_file).read_text().splitlines()
            names |= {line.split("=")[0] for line in lines if "=" in line and not line.startswith("#")}
        keys[gen["name"]] = names
    return keys


def secret_template() -> dict:
    return load_all(SECRET_TEMPLATE)[0]


def pod_templates(obj: dict) -> dict[str, dict]:
    """The pod templates in a workload or a RayService, by a name for messages."""
    name = obj["metadata"]["name"]
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return {name: obj["spec"]["template"]}
    if obj["kind"] == "RayService":
        cluster = obj["spec"]["rayClusterConfig"]
        groups = {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}
        return {f"{name}-{group}": spec["template"] for group, spec in groups.items()}
    return {}


def is_loraplex_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0] == "loraplex"


def parse_cli(argv: list[str]):
    """argv as `loraplex` parses it; a bad subcommand or option fails the test instead of exiting."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`loraplex {shlex.join(argv)}` is not a valid loraplex command line")


def service_commands(svc: dict) -> list[list[str]]:
    """The command lines a compose service runs, program first: the image's entrypoint (`loraplex`) with the
    service's command, its own entrypoint with it, or each `loraplex ...` and `ray ...` of a `sh -c` script (up to
    the next ; & | or newline)."""
    entrypoint = svc.get("entrypoint")
    if entrypoint is None:
        return [["loraplex", *svc.get("command", ["serve"])]]
    if entrypoint[:2] == ["sh", "-c"]:
        script = " ".join(svc.get("command", []))
        return [shlex.split(match) for match in re.findall(r"\b((?:loraplex|ray)\s+[^;&|\n]+)", script)]
    return [[*entrypoint, *svc.get("command", [])]]


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
    assert DOCKERFILE.is_file() and COMPOSE.is_file() and README.is_file() and SECRET_TEMPLATE.is_file()
    for directory in (K8S, K8S / "common", K8S / "dev", K8S / "ray"):
        assert directory / "kustomization.yaml" in KUSTOMIZATIONS


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
    env = {k: interpolate(v) for k, v in compose()["services"][GATEWAY_SERVICE]["environment"].items()}
    settings = settings_from(env, monkeypatch)
    assert settings.database_url.startswith("postgresql://")
    assert settings.redis_url.startswith("redis://")
    assert settings.adapter_root == ["/adapters"]
    assert settings.admin_key
    assert settings.auth_enabled  # tenant keys required, even for the demo


def test_k8s_config_and_secret_template_are_valid_settings(monkeypatch):
    objects = kustomization_objects(K8S)
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "loraplex-config")
    secret = secret_template()
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "loraplex-secrets"
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
    handlers = {}
    for name, svc in compose_loraplex_services().items():
        commands = service_commands(svc)
        assert commands, f"service {name} overrides the entrypoint without calling loraplex or ray"
        for argv in commands:  # `ray start` lines are checked against ray's own options in test_deploy_ray.py
            assert argv[0] in ("loraplex", "ray"), f"service {name} runs {argv[0]}, not loraplex or ray"
        handlers[name] = [parse_cli(argv[1:]).func.__name__ for argv in commands if argv[0] == "loraplex"]
    assert handlers[GATEWAY_SERVICE] == ["_serve"]
    assert handlers["migrate"] == ["_db_upgrade"]
    assert handlers["demo-model"] == ["_generate"]
    assert parse_cli(["db", "upgrade", "--database-url", "x"]).database_url == "x"


def test_k8s_commands_are_loraplex_subcommands():
    handlers = {}
    for obj in [*kustomization_objects(K8S), *kustomization_objects(K8S / "dev")]:
        for name, template in pod_templates(obj).items():
            spec = template["spec"]
            for container in spec["containers"] + spec.get("initContainers", []):
                if is_loraplex_image(container["image"]):
                    assert "command" not in container, "keep the image's entrypoint (loraplex); pass args"
                    handlers[name] = parse_cli(container["args"]).func.__name__
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


@pytest.mark.parametrize("directory", [K8S, K8S / "dev", K8S / "ray"], ids=lambda d: str(d.relative_to(DEPLOY)))
def test_k8s_references_resolve(directory):
    """Every volume, ConfigMap and Secret a pod template names is made by the same kustomization (a resource or a
    generator), or is the Secret made by hand from secret.example.yaml."""
    objects = kustomization_objects(directory)
    named = {(o["kind"], o["metadata"]["name"]) for o in objects}
    template = secret_template()
    secrets = {
        o["metadata"]["name"]: {*o.get("data", {}), *o.get("stringData", {})} for o in objects if o["kind"] == "Secret"
    }
    secrets |= generated_keys(directory) | {template["metadata"]["name"]: set(template["stringData"])}
    configs = {o["metadata"]["name"]: set(o.get("data", {})) for o in objects if o["kind"] == "ConfigMap"}
    configs |= generated_keys(directory, "configMapGenerator")
    claims = {c["metadata"]["name"] for o in objects for c in o.get("spec", {}).get("volumeClaimTemplates", [])}
    templates = {name: pod for obj in objects for name, pod in pod_templates(obj).items()}
    assert templates, f"{directory}: no pod templates"
    for name, pod in templates.items():
        spec = pod["spec"]
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in named or claim in claims, f"{name}: no PVC {claim}"
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configs, f"{name}: no ConfigMap {volume['configMap']['name']}"
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, f"{name}: no Secret {volume['secret']['secretName']}"
        mounts = {v["name"] for v in spec.get("volumes", [])} | claims
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {m["name"] for m in container.get("volumeMounts", [])} <= mounts, f"{name}: mount of no volume"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configs, f"{name}: no ConfigMap {source}"
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, f"{name}: no Secret {source}"
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], ()), f"{name}: no Secret key {ref}"
                ref = var.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in configs.get(ref["name"], ()), f"{name}: no ConfigMap key {ref}"


def k8s_validation_cases() -> list:
    """(built-in object, id) for every object of every manifest; a custom resource's pod templates as PodTemplates."""
    cases = []
    for path in k8s_files():
        for obj in load_all(path):
            where = f"{path.relative_to(K8S)}:{obj['kind']}/{obj['metadata']['name']}"
            if (obj["apiVersion"], obj["kind"]) not in CUSTOM_RESOURCES:
                cases.append(pytest.param(obj, id=where))
            for name, template in pod_templates(obj).items() if obj["kind"] == "RayService" else ():
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
                cases.append(pytest.param(pod_template | {"template": template}, id=f"{where}:{name}"))
    return cases


@pytest.mark.parametrize("obj", k8s_validation_cases())
def test_k8s_object_validates_against_the_kubernetes_schema(obj):
    """Strict: a misspelled or misplaced field fails, as `kubectl apply` with server-side field validation would."""
    assert K8S_VERSION in kubernetes_validate.utils.all_versions(), "kubernetes-validate no longer ships K8S_VERSION"
    error = None
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        error = f"{'.'.join(map(str, e.path))}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        error = f"{e.message}: a custom resource? add it to CUSTOM_RESOURCES and check it in test_deploy_ray.py"
    assert error is None, error


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_builds(path):
    """`kubectl kustomize` (kustomize's own load rules: files outside the directory only through directories)."""
    kustomize = shutil.which("kustomize") or shutil.which("kubectl")
    if kustomize is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    command = [kustomize, "build"] if kustomize.endswith("kustomize") else [kustomize, "kustomize"]
    done = subprocess.run([*command, str(path.parent)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    built = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    expected = kustomization_objects(path.parent)
    assert len(built) == len(expected) + len(generated_keys(path.parent)) + len(
        generated_keys(path.parent, "configMapGenerator")
    )


def test_k8s_deployment():
    objects = kustomization_objects(K8S)
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
    assert {"postgres", "redis", "migrate", GATEWAY_SERVICE} <= services.keys()
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert services["redis"]["image"].split(":")[1].startswith("7")
    assert "--appendonly yes" in " ".join(services["redis"]["command"]), "usage counters must survive restarts"
    gateway = services[GATEWAY_SERVICE]
    assert gateway["environment"][ENV_PREFIX + "ADMIN_KEY"].startswith("${" + ENV_PREFIX + "ADMIN_KEY:?")
    assert any(interpolate(v).split(":")[1:] == ["/adapters", "ro"] for v in gateway["volumes"]), "adapters: read-only"
    depends = gateway["depends_on"]
    assert depends["postgres"]["condition"] == depends["redis"]["condition"] == "service_healthy"
    assert depends["migrate"]["condition"] == "service_completed_successfully"
    for name in ("postgres", "redis"):
        assert "healthcheck" in services[name]
    assert "/ready" in " ".join(gateway["healthcheck"]["test"])  # healthy: ready to serve, not only alive
    declared = set(compose().get("volumes", {}))
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = interpolate(volume).split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"service {name} mounts {source}, which does not exist"
            else:
                assert source.startswith("/") or source in declared, f"undeclared volume {source}"
    graceful = float(
        gateway["environment"].get(
            ENV_PREFIX + "TIMEOUT_GRACEFUL_SHUTDOWN", ServeSettings.model_fields["timeout_graceful_shutdown"].default
        )
    )
    assert seconds(gateway["stop_grace_period"]) > graceful


def test_dev_redis_is_append_only():
    redis = next(
        o for o in kustomization_objects(K8S / "dev") if o["kind"] == "StatefulSet" and "redis" in o["metadata"]["name"]
    )
    args = " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in args
