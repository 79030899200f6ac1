"""Throughput of the Redis Cluster tier beside raw redis-py ``RedisCluster`` SET/GET of the same
bytes, in the same run, on a throwaway 6-node cluster. From the repository root:

    PYTHONPATH=. python scripts/redis_cluster_throughput.py [--rounds 3] [--mib 96]

For each chunk size: ``--mib`` MiB of chunks put then got by the tier (``concurrency`` coroutines,
keys of many namespaces so every master works), then the same bytes SET then GET by a plain
``RedisCluster`` client under keys in the same slots. Rounds alternate tier and raw; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

from redis.asyncio.cluster import ClusterNode, RedisCluster

from storage._cluster_client import parse_cluster_url
from storage.redis_cluster import RedisClusterTier
from storage.types import ChunkKey
from tests.support.redis_cluster import start_cluster

MiB = 1024 * 1024


async def run(fn, items, concurrency: int) -> float:
    queue = list(items)

    async def worker() -> None:
        while queue:
            await fn(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def measure(url: str, size: int, total: int, concurrency: int) -> dict[str, float]:
    n = max(concurrency, total // size)
    payload = bytearray(os.urandom(size))
    keys = [ChunkKey("0a", secrets.token_hex(2), secrets.token_hex(32)) for _ in range(n)]
    tier = RedisClusterTier(url, prefix=f"bench:{secrets.token_hex(3)}:", op_timeout_s=5, read_timeout_s=10,
                            put_timeout_s=30)
    await tier.start()
    raw = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in parse_cluster_url(url).nodes])
    await raw.initialize()
    names = [tier._layout.head(k) + ":raw" for k in keys]  # same slots as the tier's chunks
    out: dict[str, float] = {}
    try:
        out["tier_put"] = n * size / await run(lambda k: tier.put(k, payload), keys, concurrency) / MiB
        out["tier_get"] = n * size / await run(tier.get, keys, concurrency) / MiB
        out["raw_set"] = n * size / await run(lambda k: raw.set(k, payload), names, concurrency) / MiB
        out["raw_get"] = n * size / await run(raw.get, names, concurrency) / MiB
        for k in keys:
            got = await tier.get(k)
            assert got.nbytes == size
    finally:
        await tier.delete_owner("0a")
        for i in range(0, len(names), 100):
            await asyncio.gather(*(raw.delete(x) for x in names[i:i + 100]))
        await tier.aclose()
        await raw.aclose()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sizes", default="65536,2097152,8388608")
    args = ap.parse_args()
    cluster = start_cluster()
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            rounds = [await measure(cluster.url, size, args.mib * MiB, args.concurrency) for _ in range(args.rounds)]
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(f"chunk {size / MiB:.3g} MiB, {args.concurrency} in flight, median of {args.rounds} (MiB/s): "
                  f"put {med['tier_put']:.0f} vs raw SET {med['raw_set']:.0f} "
                  f"({med['tier_put'] / med['raw_set']:.2f}x); get {med['tier_get']:.0f} vs raw GET "
                  f"{med['raw_get']:.0f} ({med['tier_get'] / med['raw_get']:.2f}x)", flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
