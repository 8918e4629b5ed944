"""The Ray Serve mode's parts that need no Ray instance: the cluster's merged engine numbers, the adapter files sent
for validation, the round-robin baseline router, the application's checks, and the one-line error without Ray.
(tests/test_ray_cluster.py runs the whole thing on a local Ray instance.)"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from types import SimpleNamespace

import pytest

from engine.interface import AdapterError, EngineSnapshot
from loraplex import cli

pytest.importorskip("ray.serve", reason="the Ray Serve mode needs the ray extra (deploy/requirements-dev.txt has it)")

from gateway.cluster.remote_engine import merged_snapshot, read_adapter_files
from gateway.cluster.round_robin import RoundRobinRouter


def snapshot(**values) -> EngineSnapshot:
    numbers = {f.name: 0 for f in dataclasses.fields(EngineSnapshot) if f.type in ("int", "float")}
    tuples = {"adapters_on_device": (), "adapters_on_host": ()}
    return EngineSnapshot(**{**numbers, **tuples, **values})


def test_the_clusters_engine_numbers_are_the_replicas_summed_and_merged():
    merged = merged_snapshot(
        [
            snapshot(num_requests=2, kv_blocks_total=100, adapter_loads=3, adapter_load_seconds=0.5,
                     adapters_on_device=("a@1",), adapters_on_host=("a@1", "b@1"), tenant_service={"t": 1.5}),
            snapshot(num_requests=1, kv_blocks_total=100, adapter_loads=4, adapter_load_seconds=0.25,
                     adapters_on_device=("c@1",), adapters_on_host=("b@1", "c@1"), tenant_service={"t": 1, "u": 2}),
        ]
    )  # fmt: skip
    assert (merged.num_requests, merged.kv_blocks_total, merged.adapter_loads) == (3, 200, 7)
    assert merged.adapter_load_seconds == pytest.approx(0.75)
    assert merged.adapters_on_device == ("a@1", "c@1")
    assert merged.adapters_on_host == ("a@1", "b@1", "c@1")
    assert merged.tenant_service == {"t": 2.5, "u": 2.0}


def test_an_adapter_travels_to_a_replica_as_its_top_level_files(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00\x01")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "old.bin").write_bytes(b"x")
    files = read_adapter_files(str(tmp_path))
    assert files == {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\x00\x01"}
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter_files(str(tmp_path / "missing"))


def test_round_robin_takes_the_replicas_in_turn_and_offers_the_others_behind():
    def replica(name: str):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))

    router = object.__new__(RoundRobinRouter)
    candidates = [replica("b"), replica("a"), replica("c")]
    firsts = []
    for _ in range(6):
        first, rest = asyncio.run(router.choose_replicas(candidates))
        firsts.append(first[0].replica_id.unique_id)
        assert sorted(r.replica_id.unique_id for r in [*first, *rest]) == ["a", "b", "c"]
    assert sorted(firsts[:3]) == ["a", "b", "c"] and firsts[3:] == firsts[:3]
    assert asyncio.run(router.choose_replicas([])) == []


def test_the_application_needs_a_model_and_replicas():
    from gateway.cluster.serve_app import app_builder

    with pytest.raises(ValueError, match="needs `model`"):
        app_builder({"replicas": 2, "database_url": "sqlite:///x.db"})
    with pytest.raises(ValueError, match="replicas"):
        app_builder({"model": "/models/m", "replicas": 0, "database_url": "sqlite:///x.db"})


def test_serve_with_replicas_says_how_to_get_ray_when_it_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit, match=r"pip install 'loraplex\[ray\]'"):
        cli.main(["serve", "--replicas", "2", "--model", str(tmp_path)])


def test_replicas_reserve_a_gpu_where_the_engine_runs_on_cuda(monkeypatch):
    from gateway.cluster.serve_app import replica_gpus
    from gateway.settings import ServeSettings

    def gpus(**values) -> float:
        return replica_gpus(ServeSettings(database_url="sqlite:///x.db", **values))

    assert gpus(device="cuda") == 1 and gpus(device="cpu") == 0 and gpus(device="cuda", replica_num_gpus=0.5) == 0.5
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert gpus(device="auto") == 1 and gpus(device="auto", replica_num_gpus=0) == 0
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpus(device="auto") == 0


def test_ready_batches_carry_everything_waiting_in_order_then_the_error():
    from gateway.cluster.ready_batches import ready_batches

    async def source():
        for i in range(3):
            yield i
            await asyncio.sleep(0.01)  # the consumer keeps up: one item a pull
        for i in range(3, 8):
            yield i  # a burst while the consumer is busy
        await asyncio.sleep(0.05)
        yield 8
        raise ValueError("bad request")

    async def consume():
        batches = []
        with pytest.raises(ValueError, match="bad request"):
            async for batch in ready_batches(source()):
                batches.append(batch)
                if batch[-1] == 2:
                    await asyncio.sleep(0.03)  # busy: the burst waits
        return batches

    batches = asyncio.run(consume())
    assert [i for batch in batches for i in batch] == list(range(9))
    assert batches[:3] == [[0], [1], [2]] and [3, 4, 5, 6, 7] in batches and all(batches)


def test_leaving_ready_batches_early_runs_the_sources_cleanup():
    from gateway.cluster.ready_batches import ready_batches

    cleaned = asyncio.Event()

    async def source():
        try:
            for i in range(1000):
                yield i
                await asyncio.sleep(0.001)
        finally:
            cleaned.set()  # the engine stream aborts its request here

    async def consume():
        batches = ready_batches(source())
        first = await anext(batches)
        await batches.aclose()
        return first, cleaned.is_set()

    assert asyncio.run(consume()) == ([0], True)
