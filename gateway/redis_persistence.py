"""A start-up check that the configured Redis keeps what it is given: usage counted but not yet flushed into the
registry (up to `--usage-flush-interval` seconds of it) and the rate limits' windows live there.

With `appendonly yes` (the deploy/ files set it, with `appendfsync everysec`) a Redis process that is killed and
restarted loses nothing; without persistence it comes back empty and that usage is gone. The check only warns:
a managed Redis may refuse CONFIG, and that is said too.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)
TIMEOUT_S = 3.0


async def redis_persistence(redis_url: str) -> str | None:
    """Redis's `appendonly` setting ("yes" / "no"), or None when it cannot be read."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.from_url(redis_url, socket_timeout=TIMEOUT_S)
    try:
        reply = await asyncio.wait_for(client.config_get("appendonly"), TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as e:
        logger.info("could not read Redis's persistence setting (%s: %s)", type(e).__name__, e)
        return None
    finally:
        await client.aclose()
    value = reply.get("appendonly", reply.get(b"appendonly"))
    return value.decode() if isinstance(value, bytes) else value


async def warn_unless_persistent(redis_url: str) -> None:
    if await redis_persistence(redis_url) == "no":
        logger.warning(
            "Redis at %s has appendonly=no: if it restarts, the usage not yet flushed into the registry and the "
            "rate limits' windows are lost. Run it with --appendonly yes (deploy/ does)",
            redis_url.split("@")[-1],
        )
