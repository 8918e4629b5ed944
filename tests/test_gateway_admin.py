"""Admin REST and vLLM's adapter endpoints against a live server, on SQLite and on PostgreSQL: register
(validated first), use at once, versions, 409 / 422 / 401 / 403 / 404 with OpenAI-style bodies, delete while
a request runs, warm / cold, and the server serving on after every error."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from adapters.ref import LoRARequest
from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for
from tests.hf_models import make_adapter, make_model

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    root, hf, adapters = build_tiny(tmp_path_factory.mktemp("admin"), tokenizer, {"sql": 8, "extra": 4, "v2": 8})
    other = make_model(root / "other-base", tokenizer, "llama", hidden_size=48, intermediate_size=96)
    bad = root / "adapters" / "bad"
    make_adapter(other, bad / "wrong-shapes", seed=9)
    make_adapter(hf, bad / "rank-too-high", seed=9, r=32)
    shutil.copytree(adapters["extra"], bad / "no-weights")
    (bad / "no-weights" / "adapter_model.safetensors").unlink()
    shutil.copytree(adapters["extra"], bad / "pickle-only")
    import torch

    tensors = load_file(bad / "pickle-only" / "adapter_model.safetensors")
    torch.save(tensors, bad / "pickle-only" / "adapter_model.bin")
    (bad / "pickle-only" / "adapter_model.safetensors").unlink()
    shutil.copytree(adapters["extra"], bad / "nan")
    tensors = load_file(bad / "nan" / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, bad / "nan" / "adapter_model.safetensors")
    return root, hf, adapters


@pytest.fixture(scope="module")
def server(tiny, registry_url):
    root, _, adapters = tiny
    settings = settings_for(
        root, {"sql": adapters["sql"]}, database_url=registry_url, adapter_root=[str(root / "adapters")]
    )
    with ServerThread(settings) as running:
        yield running


def complete(http, model: str, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": "Alice was", "max_tokens": 3, **extra})


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(http) -> None:
    assert complete(http, "sql").status_code == 200
    assert complete(http, BASE).status_code == 200


def test_register_use_at_once_versions_then_delete_gives_404(http, tiny):
    _, _, adapters = tiny
    response = http.post("/admin/adapters", headers=ADMIN, json={"name": "extra", "path": adapters["extra"]})
    assert response.status_code == 201, response.text
    row = response.json()
    assert row["id"] == "extra@1" and row["rank"] == 4 and row["digest"].startswith("sha256:")
    assert row["owner"] is None and set(row["target_modules"]) >= {"q_proj", "down_proj"}
    assert row["tier"] in ("host", "device")  # validated, hence already in host memory
    assert complete(http, "extra").json()["model"] == "extra"  # servable at once

    # a second version of the name: the latest serves by default, each version by name@version
    v2 = http.post("/admin/adapters", headers=ADMIN, json={"name": "extra", "path": adapters["v2"]})
    assert v2.status_code == 201 and v2.json()["id"] == "extra@2"
    assert v2.json()["digest"] != row["digest"]
    prompt = {"prompt": "Call me", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    latest, first, second = (complete(http, m, **prompt).json() for m in ("extra", "extra@1", "extra@2"))
    assert latest["choices"][0]["text"] == second["choices"][0]["text"] != first["choices"][0]["text"]

    dup = http.post("/admin/adapters", headers=ADMIN, json={"name": "extra", "path": adapters["v2"], "version": "2"})
    assert_openai_error(dup, 409, "version", "already registered")

    listed = http.get("/admin/adapters", headers=ADMIN).json()["data"]
    assert {"sql@1", "extra@1", "extra@2"} <= {a["id"] for a in listed}
    one = http.get("/admin/adapters/extra", headers=ADMIN).json()
    assert one["id"] == "extra@2" and [v["id"] for v in one["versions"]] == ["extra@1", "extra@2"]
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["extra"]["parent"] == BASE and models["extra"]["version"] == "2"

    assert http.delete("/admin/adapters/extra", headers=ADMIN, params={"version": "1"}).json() == {
        "deleted": ["extra@1"]
    }
    assert_openai_error(complete(http, "extra@1"), 404, "model", "does not exist")
    assert complete(http, "extra").status_code == 200
    assert http.delete("/admin/adapters/extra", headers=ADMIN).json() == {"deleted": ["extra@2"]}
    assert_openai_error(complete(http, "extra"), 404, "model", "does not exist")
    assert_openai_error(http.get("/admin/adapters/extra", headers=ADMIN), 404, "name")
    assert_openai_error(http.delete("/admin/adapters/extra", headers=ADMIN), 404, "name")
    assert "extra" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert_still_serving(http)


@pytest.mark.parametrize(
    ("sub_path", "text"),
    [
        ("wrong-shapes", "shape"),
        ("rank-too-high", "rank"),
        ("no-weights", "adapter_model"),
        ("pickle-only", "pickle"),
        ("nan", "nan"),
    ],
)
def test_a_bad_adapter_is_refused_with_422_naming_the_problem(http, tiny, sub_path, text):
    root, _, _ = tiny
    path = str(root / "adapters" / "bad" / sub_path)
    response = http.post("/admin/adapters", headers=ADMIN, json={"name": f"bad-{sub_path}", "path": path})
    assert_openai_error(response, 422, "path", text)
    assert_openai_error(complete(http, f"bad-{sub_path}"), 404, "model")  # nothing was registered
    assert_still_serving(http)


def test_paths_outside_the_allowed_roots_are_refused(http, tiny, tmp_path):
    root, _, adapters = tiny
    outside = tmp_path / "outside"
    shutil.copytree(adapters["extra"], outside)
    link = root / "adapters" / "link-out"
    if not link.exists():
        link.symlink_to(outside)
    for path in (str(outside), str(link), str(root / "adapters" / ".." / "base"), "/etc"):
        response = http.post("/admin/adapters", headers=ADMIN, json={"name": "escape", "path": path})
        assert_openai_error(response, 422, "path", "outside the allowed adapter roots")
    missing = http.post("/admin/adapters", headers=ADMIN, json={"name": "gone", "path": str(root / "adapters" / "x")})
    assert_openai_error(missing, 422, "path", "not a directory")
    gguf = root / "adapters" / "lora.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    as_gguf = http.post("/admin/adapters", headers=ADMIN, json={"name": "gguf", "path": str(gguf)})
    assert_openai_error(as_gguf, 422, "path", "is a GGUF file")
    assert_openai_error(http.post("/admin/adapters", headers=ADMIN, json={"name": "a b", "path": "x"}), 422, "name")
    unknown_owner = {"name": "owned", "path": adapters["extra"], "owner": "nobody"}
    assert_openai_error(http.post("/admin/adapters", headers=ADMIN, json=unknown_owner), 422, "owner")
    # a body field called `path` is named, not taken for the request's path
    no_path = http.post("/admin/adapters", headers=ADMIN, json={"name": "nopath"})
    assert_openai_error(no_path, 400, "path", "invalid value for 'path': field required")
    assert_openai_error(http.post("/admin/adapters", headers=ADMIN, json={"path": "x"}), 400, "name", "required")
    assert_still_serving(http)


def test_the_admin_api_needs_the_admin_key(http):
    assert_openai_error(http.get("/admin/adapters"), 401, text="admin credential")
    assert_openai_error(http.get("/admin/adapters", headers={"Authorization": "Bearer nope"}), 403)
    assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}), 401)
    assert_openai_error(http.post("/admin/adapters", json={"name": "x", "path": "y"}), 401)


def test_vllm_load_and_unload_endpoints_with_vllm_status_codes(http, tiny):
    _, _, adapters = tiny
    body = {"lora_name": "hot", "lora_path": adapters["extra"]}
    response = http.post("/v1/load_lora_adapter", headers=ADMIN, json=body)
    assert response.status_code == 200 and "added successfully" in response.text
    assert complete(http, "hot").status_code == 200
    assert_openai_error(http.post("/v1/load_lora_adapter", headers=ADMIN, json=body), 400, text="already been loaded")
    assert_openai_error(http.post("/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "x"}), 400)
    bad = {"lora_name": "bad", "lora_path": "/etc"}
    assert_openai_error(http.post("/v1/load_lora_adapter", headers=ADMIN, json=bad), 400, text="outside")
    response = http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "hot"})
    assert response.status_code == 200 and "removed successfully" in response.text
    assert_openai_error(complete(http, "hot"), 404)
    gone = http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "hot"})
    assert_openai_error(gone, 404, text="cannot be found")
    assert_still_serving(http)


def test_load_warms_and_unload_cools(http, server):
    assert http.post("/admin/adapters/sql/load", headers=ADMIN).json() == {"id": "sql@1", "tier": "device"}
    cooled = http.post("/admin/adapters/sql/unload", headers=ADMIN).json()
    assert cooled == {"id": "sql@1", "tier": "disk", "draining": False}
    assert complete(http, "sql").status_code == 200  # a cold adapter loads on demand
    assert http.get("/admin/adapters/sql", headers=ADMIN).json()["tier"] == "device"
    assert_openai_error(http.post("/admin/adapters/nope/load", headers=ADMIN), 404)


def test_deleting_an_adapter_in_use_lets_its_request_finish_then_frees_the_row(http, server, tiny):
    _, _, adapters = tiny
    assert http.post("/admin/adapters", headers=ADMIN, json={"name": "busy", "path": adapters["v2"]}).status_code == 201
    body = {"model": "busy", "prompt": "Alice", "max_tokens": 60, "ignore_eos": True, "stream": True}
    started, chunks = threading.Event(), []

    def stream() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    assert http.delete("/admin/adapters/busy", headers=ADMIN).json() == {"deleted": ["busy@1"]}
    assert_openai_error(complete(http, "busy"), 404)  # unservable at once
    reader.join(60)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the running request finished
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
    stats = asyncio.run(server.state.engine.stats())
    assert "busy@1" not in stats.adapters_on_device and stats.adapter_rows_pinned == 0


def test_openai_client_sees_not_found_as_its_exception(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="no-such-adapter", prompt="x")
    assert caught.value.body["param"] == "model"


def test_a_name_version_re_registered_on_another_replica_never_serves_the_old_weights(http, server, tiny):
    """Replica B (same registry) deletes swap@1 and registers other weights under the same name, version and
    path; replica A, which holds the old weights in memory, must serve the new ones."""
    root, _, adapters = tiny
    directory = root / "adapters" / "swap"
    shutil.rmtree(directory, ignore_errors=True)  # the fixture's directory is shared by both databases' runs
    shutil.copytree(adapters["extra"], directory)
    prompt = {"prompt": "Call me", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert http.post("/admin/adapters", headers=ADMIN, json={"name": "swap", "path": str(directory)}).status_code == 201
    old = complete(http, "swap", **prompt).json()
    with ServerThread(server.state.settings) as replica, httpx.Client(base_url=replica.url, timeout=60) as other:
        assert other.delete("/admin/adapters/swap", headers=ADMIN).status_code == 200
        shutil.rmtree(directory)
        shutil.copytree(adapters["v2"], directory)
        body = {"name": "swap", "path": str(directory), "version": "1"}
        assert other.post("/admin/adapters", headers=ADMIN, json=body).status_code == 201
        on_b = complete(other, "swap", **prompt).json()
    on_a = complete(http, "swap", **prompt).json()
    assert on_a["choices"][0]["text"] == on_b["choices"][0]["text"] != old["choices"][0]["text"]
    digest = http.get("/admin/adapters/swap", headers=ADMIN).json()["digest"]
    assert asyncio.run(server.state.engine.digest(lora_request_of("swap@1", directory))) == digest


def lora_request_of(adapter_id: str, path) -> LoRARequest:
    return LoRARequest(adapter_id, str(Path(path).resolve()))


def test_the_single_process_server_is_one_replica_holding_what_its_engine_holds(http):
    assert complete(http, "sql").status_code == 200
    assert http.get("/admin/replicas").status_code == 401  # admin only
    replicas = http.get("/admin/replicas", headers=ADMIN).json()["data"]
    assert [r["replica_id"] for r in replicas] == ["local"]
    assert "sql@1" in replicas[0]["resident_adapters"]
    assert replicas[0]["engine"]["max_loras"] == 2
