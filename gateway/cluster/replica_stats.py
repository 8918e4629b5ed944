"""ReplicaStats: what one engine replica reports about itself (which adapters it holds, what it ran), so an operator
(`GET /admin/replicas`) and the tests can see where Ray routed each adapter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.interface import EngineSnapshot


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: str  # Ray Serve's replica id ("local" in the single-process server)
    actor_name: str  # the replica's Ray actor ("" in the single-process server)
    pid: int
    resident_adapters: tuple[str, ...]  # adapter ids this replica holds for Ray's multiplexed routing
    requests_by_adapter: dict[str, int] = field(default_factory=dict)  # requests run here, by adapter id ("" = base)
    adapter_files_fetched: int = 0  # adapters copied here from the registry database
    engine: EngineSnapshot | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
