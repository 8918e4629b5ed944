"""`/admin/replicas`: each engine replica as it reports itself — the adapters it holds, the requests it ran by
adapter, the adapters it fetched from the registry, its engine snapshot. One entry (`local`) for `loraplex serve`,
one per Ray Serve replica with `--replicas N`. Needs the admin key."""

from __future__ import annotations

import os

from fastapi import APIRouter

from gateway.auth import AdminDep
from gateway.cluster.replica_stats import ReplicaStats
from gateway.state import StateDep

router = APIRouter(prefix="/admin/replicas", tags=["admin"], dependencies=[AdminDep])


@router.get("")
async def list_replicas(state: StateDep):
    replica_stats = getattr(state.engine, "replica_stats", None)  # RemoteEngine's; a local engine is one replica
    if replica_stats is not None:
        replicas = await replica_stats()
    else:
        snapshot = await state.engine.stats()
        replicas = [
            ReplicaStats(
                replica_id="local",
                actor_name="",
                pid=os.getpid(),
                resident_adapters=tuple(sorted({*snapshot.adapters_on_device, *snapshot.adapters_on_host})),
                engine=snapshot,
            )
        ]
    return {"object": "list", "data": [replica.to_json() for replica in replicas]}
