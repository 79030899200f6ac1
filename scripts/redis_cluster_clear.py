"""Fill 1,000,000 tiny chunks of one namespace in a throwaway 6-node Redis Cluster, then time
RedisClusterTier.delete_group and check that nothing of the namespace is left on any node.
The single-node figure comes from scripts/redis_million_clear.py. From the repository root:

    PYTHONPATH=. python scripts/redis_cluster_clear.py [N]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import redis.asyncio as aioredis

from storage.redis_cluster import RedisClusterTier
from tests.support.redis_cluster import fill, replication_caught_up, start_cluster

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000


async def dbsizes(ports: list[int]) -> dict[int, int]:
    out = {}
    for port in ports:
        r = aioredis.Redis(host="127.0.0.1", port=port)
        out[port] = await r.dbsize()
        await r.aclose()
    return out


async def main() -> None:
    cluster = start_cluster()
    try:
        t = time.perf_counter()
        await fill(cluster.url, "m:", "0a", "01", N)
        print(f"fill {N} chunks: {time.perf_counter() - t:.1f} s", flush=True)
        replication_caught_up(cluster, timeout=300)
        print("keys per node before", await dbsizes(cluster.ports), flush=True)
        tier = RedisClusterTier(cluster.url, prefix="m:", clear_batch=int(os.environ.get("BATCH", "2000")),
                                clear_timeout_s=30)
        await tier.start()
        t = time.perf_counter()
        n = await tier.delete_group("01")
        print(f"delete_group removed {n} chunks in {time.perf_counter() - t:.2f} s (cluster, 3 masters)", flush=True)
        replication_caught_up(cluster, timeout=300)
        after = await dbsizes(cluster.ports)
        print("keys per node after (the 16 counter shards remain)", after, "used_bytes", await tier.refresh_used_bytes())
        await tier.aclose()
    finally:
        cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
