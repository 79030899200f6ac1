"""The rest of `kvgate bench`, called from :func:`gateway.bench.run.run_bench`:

- ``concurrency``: 2..16 tenants storing then loading at once through one gateway (memory tier,
  encrypted, 2 MiB chunks): aggregate GB/s and per-tenant fairness (Jain's index, min/max).
- ``latency.lookup_ms_by_tier``: lookup p50/p99 of a 32K-token prefix (128 chunks) per tier.
- ``comparisons``: kvgate beside LMCache on the same chunk sizes and bytes, from
  :mod:`gateway.bench.peers` (``scripts/lmcache_runner.py`` in ``.venv-lmcache``; a peer that
  fails fails the run, ``--no-peers`` skips it).
- ``workloads``: :mod:`gateway.bench.workloads` (multi-round QA, long-document QA, eviction flood).
- ``attacks``: :mod:`gateway.bench.attack` (prefix-cache timing attack, three targets).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from gateway.bench import attack as bench_attack
from gateway.bench import workloads as bench_workloads
from gateway.bench.common import GEOMETRY, MODEL, percentiles_ms
from gateway.bench.peers import comparisons
from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from storage.base import Tier
from storage.disk import DiskTier
from storage.memory import MemoryTier

__all__ = ["comparisons", "jain_index", "run_suite"]


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index: 1.0 when every tenant got the same, 1/n when one got everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


async def _runtime(base: Path, name: str, tiers: list[Tier], chunk_tokens: int = 16) -> EmbeddedRuntime:
    state = base / name
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, mode=0o700)
    url = f"sqlite+aiosqlite:///{state / 'bench.db'}"
    await asyncio.to_thread(dbschema.upgrade, url)
    settings = Settings(state_dir=state, database_url=url, chunk_tokens=chunk_tokens, cpu_threads=2, tiers=["memory"])
    return await open_embedded(settings, tiers=tiers)


async def concurrency(base: Path, tenant_counts: list[int], chunks_per_tenant: int) -> list[dict[str, Any]]:
    """Each tenant stores then loads ``chunks_per_tenant`` 2 MiB chunks; all tenants at once."""
    tokens_n = 16 * chunks_per_tenant
    blocks_n = tokens_n // GEOMETRY.block_size
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(GEOMETRY.layer_shape(blocks_n), generator=gen).half() for _ in range(GEOMETRY.num_layers)]
    dst = [torch.zeros_like(x) for x in src]
    blocks = list(range(blocks_n))
    tenant_bytes = GEOMETRY.chunk_nbytes(16) * chunks_per_tenant
    out = []
    for n in tenant_counts:
        rt = await _runtime(base, f"conc-{n}", [MemoryTier(tenant_bytes * n * 2 + (64 << 20))])
        try:
            caps, prompts = [], []
            for i in range(n):
                await rt.admin.create_tenant(f"t{i}")
                caps.append(await rt.gateway.mint_capability(f"t{i}", "default", ["put", "get", "lookup"], 600))
                prompts.append(torch.randint(0, 32000, (tokens_n,), generator=gen).tolist())
            for i in range(n):  # warm-up, untimed: namespace keys, the tenant's data key, staging buffers
                warm = torch.randint(0, 32000, (16,), generator=gen).tolist()
                await rt.gateway.store(caps[i], MODEL, warm, src, block_ids=blocks[:1])
            row: dict[str, Any] = {"tenants": n, "tenant_bytes": tenant_bytes, "encrypted": True, "chunk_bytes": GEOMETRY.chunk_nbytes(16)}
            for op in ("store", "load"):
                async def one(
                    i: int, op: str = op, rt: EmbeddedRuntime = rt, caps: list[str] = caps, prompts: list[Any] = prompts
                ) -> float:
                    t0 = time.perf_counter()
                    if op == "store":
                        await rt.gateway.store(caps[i], MODEL, prompts[i], src, block_ids=blocks, skip_existing=False)
                    else:
                        r = await rt.gateway.retrieve(caps[i], MODEL, prompts[i], dst, block_ids=blocks)
                        if r.loaded_tokens != tokens_n:
                            raise RuntimeError(f"tenant {i} loaded {r.loaded_tokens} of {tokens_n}")
                    return time.perf_counter() - t0

                t0 = time.perf_counter()
                per = await asyncio.gather(*(one(i) for i in range(n)))
                wall = time.perf_counter() - t0
                rates = [tenant_bytes / s / 1e9 for s in per]
                row[op] = {
                    "aggregate_gbps": round(tenant_bytes * n / wall / 1e9, 3),
                    "per_tenant_gbps_min": round(min(rates), 3), "per_tenant_gbps_max": round(max(rates), 3),
                    "jain_fairness": round(jain_index(rates), 4),
                }
            out.append(row)
        finally:
            await rt.aclose()
    return out


async def lookup_by_tier(base: Path, tiers: list[str], redis_url: str | None, reps: int) -> dict[str, dict[str, float]]:
    """Lookup of a 32K-token prefix (128 chunks of 256 tokens, all present) per tier, p50/p99 ms."""
    out = {}
    for name in tiers:
        if name == "memory":
            tier: Tier = MemoryTier(1 << 30)
        elif name == "disk":
            tier = await DiskTier.open(base / "lookup-disk", fsync=False)
        else:
            from storage.redis import RedisTier

            assert redis_url is not None, "the redis tier needs redis_url"
            tier = RedisTier(redis_url, prefix=f"kvgate-bench-lookup:{os.urandom(4).hex()}:")
        rt = await _runtime(base, f"lookup-{name}", [tier], chunk_tokens=256)
        try:
            await rt.admin.create_tenant("bench-lookup")
            cap = await rt.gateway.mint_capability("bench-lookup", "default", ["lookup"], 600)
            tokens = list(range(32768))
            keys = await rt.gateway.keys_for("bench-lookup", "default", MODEL, tokens)
            for k in keys:  # presence is all a lookup reads
                await rt.tiers.put(k, b"x")
            lat = []
            for i in range(reps + 10):
                t0 = time.perf_counter()
                res = await rt.gateway.lookup(cap, MODEL, tokens)
                if i >= 10:
                    lat.append(time.perf_counter() - t0)
            if res.hit_tokens != 32768:
                raise RuntimeError(f"lookup on {name} hit {res.hit_tokens} tokens")
            out[name] = percentiles_ms(lat)
            if name == "redis":
                await tier.delete_owner(keys[0].owner)
        finally:
            await rt.aclose()
    return out


async def run_suite(
    results: list[dict[str, Any]], *, quick: bool, redis_url: str | None, console: Console, lmcache: dict[str, Any],
) -> dict[str, Any]:
    """``lmcache``: what :func:`gateway.bench.peers.run_lmcache` returned (measured first, on the
    same chunk sizes and bytes as ``results``)."""
    base = Path(tempfile.mkdtemp(prefix="kvgate-bench-suite-"))
    lm = lmcache
    try:
        console.print("bench: concurrent tenants")
        conc = await concurrency(base, [2, 4] if quick else [2, 4, 8, 16], 4 if quick else 8)
        console.print("bench: lookup latency per tier")
        tiers = ["memory"] if quick else ["memory", "disk"] + (["redis"] if redis_url else [])
        lookups = await lookup_by_tier(base, tiers, redis_url, 50 if quick else 300)
        console.print("bench: workloads")
        work = await bench_workloads.run_workloads(base, quick=quick)
        console.print("bench: prefix-cache timing attack")
        attacks = await bench_attack.run_attacks(samples=60 if quick else 250, prompt_tokens=2048 if quick else 4096)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for a in attacks:
        console.print(f"attack on {a.target}: p = {a.p_value:.3g} ({a.samples}+{a.samples} samples)")
    return {
        "concurrency": conc,
        "lookup_ms_by_tier": lookups,
        "lmcache": {k: v for k, v in lm.items() if k != "results"} | {"results": lm.get("results", [])},
        "comparisons": comparisons(results, lm.get("results", [])),
        "workloads": work,
        "attacks": [a.as_json() for a in attacks],
    }
