"""The embedded core as the chunks it holds grow: lookup latency and resident memory, clear time.

Run in a process of its own, so its resident memory is these figures' (``__main__`` does):
``python -m scripts.scale.embedded --sizes 1000 10000`` prints one JSON object. Chunks go in
through the core's own storage keys (``NamespaceResolver.chunk_keys`` of random chained hashes,
``TierManager.put``, as ``scripts/lookup_latency.py`` stores its prefix) as envelopes of
``ENVELOPE_BYTES``; the Redis tier is filled with the tier's own layout through pipelines
(``tests.support.redis_server.fill``), on a redis-server this process starts on a port of its own.
A clear's time is the whole admin call (registry, epoch, audit, tiers); the clear of an empty
namespace in the same run is its fixed part, and a raw pipelined UNLINK of the same keys is the
Redis tier's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.bench.common import MODEL, percentiles_ms
from gateway.bench.net import _envelope
from gateway.config import Settings
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from scripts.scale import ENVELOPE_BYTES, LOOKUP_CHUNKS, median, rss_bytes
from storage.base import Tier
from storage.memory import MemoryTier

__all__ = ["clear_sweep", "fill", "lookup_sweep", "main"]

_SPAN = -(-ENVELOPE_BYTES // 64) * 64  # an envelope's room in the memory tier's arena (64-byte extents)
_WARMUP = 20


async def fill(rt: EmbeddedRuntime, tenant: str, namespace: str, n: int, envelope: bytes, batch: int = 4096) -> None:
    """Store ``n`` chunks of random chained hashes in ``tenant``/``namespace`` (every tier)."""
    ns = await rt.gateway.namespace_keys(tenant, namespace)
    for start in range(0, n, batch):
        hashes = [os.urandom(32) for _ in range(min(batch, n - start))]
        for key in rt.resolver.chunk_keys(ns, hashes):
            await rt.tiers.put(key, envelope)


async def _open(base: Path, settings: dict[str, Any], memory_bytes: int | None = None) -> EmbeddedRuntime:
    tiers: list[Tier] | None = None if memory_bytes is None else [MemoryTier(memory_bytes)]
    return await open_embedded(Settings(state_dir=base, chunk_tokens=256, **settings), tiers=tiers, auto_migrate=True)


async def lookup_sweep(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per size (ascending, one process, chunks only added): ``Gateway.lookup`` of a stored
    32K-token prefix, wall and thread-CPU p50/p99, and this process's resident memory."""
    envelope = _envelope(ENVELOPE_BYTES)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-") as tmp:
        memory = max(sizes) * _SPAN + (64 << 20)
        rt = await _open(Path(tmp), {"tiers": ["memory"], "memory_bytes": memory}, memory)
        try:
            tier = rt.tiers.tiers[0]
            assert isinstance(tier, MemoryTier)
            await rt.admin.create_tenant("scale")
            tokens = list(range(LOOKUP_CHUNKS * 256))
            for key in await rt.gateway.keys_for("scale", "default", MODEL, tokens):
                await rt.tiers.put(key, envelope)
            gc.collect()
            base = rss_bytes()
            stored = LOOKUP_CHUNKS
            for n in sizes:
                await fill(rt, "scale", "default", n - stored, envelope)
                stored = n
                if tier.stats().chunks != n:
                    raise RuntimeError(f"the memory tier holds {tier.stats().chunks} chunks, not {n}")
                gc.collect()
                rss = rss_bytes()
                cap = await rt.gateway.mint_capability("scale", "default", ["lookup"], 600)
                wall, cpu = [], []
                for i in range(reps + _WARMUP):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    res = await rt.gateway.lookup(cap, MODEL, tokens)
                    if i >= _WARMUP:
                        wall.append(time.perf_counter() - t0)
                        cpu.append(time.thread_time() - c0)
                if res.hit_chunks != LOOKUP_CHUNKS:
                    raise RuntimeError(f"lookup found {res.hit_chunks} of {LOOKUP_CHUNKS} chunks")
                per_chunk = (rss - base) / (n - LOOKUP_CHUNKS) if n > LOOKUP_CHUNKS else 0.0
                rows.append({
                    "chunks": n, "wall_ms": percentiles_ms(wall), "cpu_ms": percentiles_ms(cpu),
                    "rss_bytes": rss, "rss_base_bytes": base, "bytes_per_chunk": round(per_chunk, 1),
                    "overhead_per_chunk": round(per_chunk - _SPAN, 1),
                })
                print(f"embedded lookup, {n:>9,} chunks: {rows[-1]['wall_ms']} cpu {rows[-1]['cpu_ms']} "
                      f"rss {rss / 2**20:,.0f} MiB ({per_chunk:,.0f} B/chunk)", file=sys.stderr, flush=True)
        finally:
            await rt.aclose()
    return rows


async def clear_sweep(sizes: list[int], reps: int, redis_url: str | None = None) -> list[dict[str, Any]]:
    """Per size (0 first: the fixed part): the median of ``reps`` namespace clears and tenant
    clears of that many chunks, memory tier (``redis_url`` None) or Redis tier; every clear must
    report all of them deleted. Redis rows add a raw pipelined UNLINK of the same layout."""
    envelope = _envelope(ENVELOPE_BYTES)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-") as tmp:
        if redis_url is None:
            memory = max(sizes) * _SPAN + (64 << 20)
            rt = await _open(Path(tmp), {"tiers": ["memory"], "memory_bytes": memory}, memory)
        else:
            rt = await _open(Path(tmp), {"tiers": ["redis"], "redis_url": redis_url, "redis_prefix": "kvgate-scale:"})
        try:
            await rt.admin.create_tenant("clear-warmup")  # first calls pay for imports and cold caches
            await rt.admin.clear("clear-warmup", "default")
            await rt.admin.clear("clear-warmup")
            for n in [0, *sizes]:
                timed: dict[str, list[float]] = {"namespace": [], "tenant": [], "raw_unlink": []}
                for r in range(reps):
                    tenant = f"clear-{n}-{r}"
                    await rt.admin.create_tenant(tenant)
                    for scope in ("namespace", "tenant"):
                        await _fill_any(rt, tenant, n, envelope, redis_url)
                        t0 = time.perf_counter()
                        res = await rt.admin.clear(tenant, "default" if scope == "namespace" else None)
                        timed[scope].append(time.perf_counter() - t0)
                        if res.deleted_chunks != n:
                            raise RuntimeError(f"a {scope} clear of {n} chunks deleted {res.deleted_chunks}")
                    if redis_url is not None and n:
                        timed["raw_unlink"].append(await _raw_unlink(rt, tenant, n, redis_url))
                row: dict[str, Any] = {"chunks": n, "reps": reps}
                for name, values in timed.items():
                    if values:
                        row[f"{name}_ms"] = round(median(values) * 1e3, 3)
                rows.append(row)
                print(f"clear {'redis' if redis_url else 'memory'}, {n:>9,} chunks: {row}", file=sys.stderr, flush=True)
        finally:
            await rt.aclose()
    return rows


async def _fill_any(rt: EmbeddedRuntime, tenant: str, n: int, envelope: bytes, redis_url: str | None) -> None:
    if redis_url is None:
        await fill(rt, tenant, "default", n, envelope)
        return
    from tests.support.redis_server import fill as redis_fill

    ns = await rt.gateway.namespace_keys(tenant, "default")
    if n:
        await redis_fill(redis_url, rt.settings.redis_prefix, ns.owner, ns.group, n, batch=5000)


async def _raw_unlink(rt: EmbeddedRuntime, tenant: str, n: int, redis_url: str) -> float:
    """Seconds for redis-py to UNLINK the same layout (``n`` heads and their group set) in
    pipelined batches of the tier's clear batch: what the tier's clear could cost at the least."""
    import redis.asyncio as aioredis

    from storage import ChunkKey
    from storage._redis_layout import Layout
    from tests.support.redis_server import fill as redis_fill

    await rt.admin.create_tenant(tenant + "-raw")
    ns = await rt.gateway.namespace_keys(tenant + "-raw", "default")
    prefix = rt.settings.redis_prefix
    await redis_fill(redis_url, prefix, ns.owner, ns.group, n, batch=5000)
    lay = Layout(prefix)
    heads = [lay.head(ChunkKey(ns.owner, ns.group, f"{i:064x}")) for i in range(n)]
    client = aioredis.from_url(redis_url)
    try:
        t0 = time.perf_counter()
        for start in range(0, n, 2000):
            pipe = client.pipeline(transaction=False)
            pipe.unlink(*heads[start:start + 2000])
            await pipe.execute()
        await client.unlink(lay.group_set(ns.owner, ns.group))
        seconds = time.perf_counter() - t0
    finally:
        await client.aclose()
    await rt.admin.clear(tenant + "-raw")  # the owner's index sets
    return seconds


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"lookup": await lookup_sweep(args.sizes, args.reps)}
    out["clear_memory"] = await clear_sweep(args.clear_sizes, args.clear_reps)
    if args.redis_sizes:
        from tests.support.redis_server import Server

        server = Server()
        server.start()
        try:
            out["clear_redis"] = await clear_sweep(args.redis_sizes, args.clear_reps, server.url)
        finally:
            server.kill()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.scale.embedded", description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    p.add_argument("--reps", type=int, default=500, help="lookups timed per size")
    p.add_argument("--clear-sizes", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    p.add_argument("--redis-sizes", type=int, nargs="*", default=[10**3, 10**4, 10**5])
    p.add_argument("--clear-reps", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.sizes) < LOOKUP_CHUNKS or args.sizes != sorted(args.sizes):
        p.error(f"--sizes must be ascending, each at least {LOOKUP_CHUNKS} (the looked-up prefix)")
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
