"""RoundRobinRouter: a Ray Serve request router that ignores where adapters are resident and takes replicas in turn.

It exists as the baseline of `loraplex bench replicas` (`--replica-routing round-robin`): Ray's default router with
multiplexing (`--replica-routing adapter`) is what serving uses.
"""

from __future__ import annotations

import itertools

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class RoundRobinRouter(RequestRouter):
    _turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[ordered[start]], ordered[start + 1 :] + ordered[:start]]  # the next in turn; the others if it is full
