"""Scale-out on Ray Serve: the gateway as a Ray Serve ingress in front of N engine replicas.

    ingress (LoraplexIngress: the FastAPI app — auth, tenancy, limits, usage, the registry)
        │  RemoteEngine: AsyncEngine's surface over a Ray Serve handle; multiplexed model id = adapter name@version
        ▼
    EngineReplica × N (one AsyncEngine each; Ray's multiplexed LRU = the engine's adapter tiers)

Shared state: the registry database (adapters, their files by content digest, tenants, usage rollups) and Redis
(usage counters, rate limits). Ray (`pip install loraplex[ray]`) is imported only by this package.
"""
