"""`kvgate bench`: store and load throughput through the gateway core, beside ceilings measured
in the same run on the same bytes with the same number of threads.

- ``aes_gcm``: cryptography's AESGCM ``encrypt_into`` / ``decrypt_into`` into preallocated output,
  the irreducible cost of an encrypted store / load; bounds the encrypted results.
- ``memcpy``: a plain copy of the same bytes (torch ``copy_`` into a preallocated tensor); bounds
  the plaintext results.

Both ceilings run over as many distinct buffers as the gateway run has chunks (the same bytes, the
same amount of memory streamed), never one buffer that stays hot in the CPU cache.

Each figure is the median of ``reps`` repetitions (the machine is small and noisy). Chunk sizes
are those of Llama-3-8B geometry (32 layers, 8 KV heads, head size 128, fp16): 16 tokens = 2 MiB
and 256 tokens = 32 MiB (33.5 MB). Results use the JSON shape later benchmarks extend:
``{"results": [{"op", "tier", "encrypted", "chunk_bytes", "threads", "gbps", "ceiling": {"name", "gbps"}}]}``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gateway import bench_net, bench_suite, dbschema
from gateway.config import Settings
from gateway.core import KVModel
from gateway.runtime import open_runtime
from kernels.layouts import KVGeometry, KVLayout
from storage.disk import DiskTier
from storage.memory import MemoryTier

__all__ = ["run_bench"]

GEOMETRY = KVGeometry(32, 8, 128, torch.float16, 16, KVLayout.KV_FIRST)
MODEL = KVModel("bench-llama-3-8b", GEOMETRY)


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up (page faults, caches, staging buffers)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parallel(threads: int, work: Callable[[int], None]) -> Callable[[], None]:
    """A callable that runs work(i) on ``threads`` threads at once (GIL released inside)."""

    def run() -> None:
        if threads == 1:
            work(0)
            return
        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return run


def aes_ceiling(total_bytes: int, chunk_bytes: int, threads: int, reps: int) -> tuple[float, float]:
    """GB/s of AES-256-GCM seal and open over ``total_bytes`` in ``chunk_bytes`` pieces.

    The same bytes as the gateway run: as many distinct source and output buffers as the run has
    chunks (not one hot buffer encrypted again and again, which stays in the CPU cache and would
    measure the cache, not the memory the gateway actually streams through)."""
    import numpy as np

    aead = AESGCM(os.urandom(32))
    n_chunks = max(1, total_bytes // chunk_bytes)
    per_thread = [list(range(i, n_chunks, threads)) for i in range(threads)]
    rng = np.random.default_rng(0)
    src = [memoryview(rng.integers(0, 256, chunk_bytes, dtype=np.uint8)) for _ in range(n_chunks)]
    sealed = [memoryview(np.empty(chunk_bytes + 16, np.uint8)) for _ in range(n_chunks)]
    opened = [memoryview(np.empty(chunk_bytes, np.uint8)) for _ in range(n_chunks)]
    nonce = os.urandom(12)

    def seal(i: int) -> None:
        for k in per_thread[i]:
            aead.encrypt_into(nonce, src[k], None, sealed[k])

    def open_(i: int) -> None:
        for k in per_thread[i]:
            aead.decrypt_into(nonce, sealed[k], None, opened[k])

    done = n_chunks * chunk_bytes
    return (
        done / _median_time(_parallel(threads, seal), reps) / 1e9,
        done / _median_time(_parallel(threads, open_), reps) / 1e9,
    )


def memcpy_ceiling(total_bytes: int, chunk_bytes: int, threads: int, reps: int) -> float:
    """GB/s of a plain copy of the same bytes (distinct buffers, as above)."""
    n_chunks = max(1, total_bytes // chunk_bytes)
    per_thread = [list(range(i, n_chunks, threads)) for i in range(threads)]
    src = [torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8) for _ in range(n_chunks)]
    dst = [torch.empty_like(s) for s in src]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def copy(i: int) -> None:
            for k in per_thread[i]:
                dst[k].copy_(src[k])

        return n_chunks * chunk_bytes / _median_time(_parallel(threads, copy), reps) / 1e9
    finally:
        torch.set_num_threads(old)


async def _gateway_figures(
    base: Path, db_url: str, tier: str, encrypted: bool, chunk_tokens: int, threads: int, n_chunks: int, reps: int,
    redis_url: str | None = None,
) -> tuple[float, float]:
    """(store GB/s, load GB/s) through the gateway core for one configuration."""
    settings = Settings(
        state_dir=base, database_url=db_url, chunk_tokens=chunk_tokens, cpu_threads=threads, tiers=[tier],
        redis_url=redis_url if tier == "redis" else None,  # the redis tier now requires its URL in Settings
    )
    chunk_bytes = GEOMETRY.chunk_nbytes(chunk_tokens)
    tokens_n = chunk_tokens * n_chunks
    if tier == "memory":
        tiers = [MemoryTier(chunk_bytes * n_chunks * 3 + (64 << 20))]
    elif tier == "redis":
        from storage.redis import RedisTier

        tiers = [RedisTier(redis_url, prefix=f"kvgate-bench:{os.urandom(4).hex()}:", op_timeout_s=2.0, put_timeout_s=10.0)]
    else:
        shutil.rmtree(base / "bench-disk", ignore_errors=True)
        tiers = [await DiskTier.open(base / "bench-disk", fsync=True)]
    rt = await open_runtime(settings, tiers=tiers, encrypt=encrypted)
    try:
        tenant = f"bench-{tier}-{int(encrypted)}-{chunk_tokens}-{threads}"
        await rt.admin.create_tenant(tenant)
        cap = await rt.gateway.mint_capability(tenant, "default", ["put", "get", "lookup"], 600)
        blocks_n = tokens_n // GEOMETRY.block_size
        gen = torch.Generator().manual_seed(1)
        layers = [torch.randn(GEOMETRY.layer_shape(blocks_n * 2), generator=gen).half() for _ in range(GEOMETRY.num_layers)]
        dst = [torch.zeros_like(x) for x in layers]
        blocks = torch.randperm(blocks_n * 2, generator=gen)[:blocks_n]
        prompt = torch.randint(0, 32000, (tokens_n,), generator=gen).tolist()
        loop = asyncio.get_running_loop()

        async def timed(coro_fn) -> float:
            await coro_fn()
            times = []
            for _ in range(reps):
                t0 = loop.time()
                await coro_fn()
                times.append(loop.time() - t0)
            return statistics.median(times)

        store_s = await timed(lambda: rt.gateway.store(cap, MODEL, prompt, layers, block_ids=blocks, skip_existing=False))
        res = await rt.gateway.retrieve(cap, MODEL, prompt, dst, block_ids=blocks)
        if res.loaded_tokens != tokens_n:
            raise RuntimeError(f"bench load came back short: {res}")
        load_s = await timed(lambda: rt.gateway.retrieve(cap, MODEL, prompt, dst, block_ids=blocks))
        total = chunk_bytes * n_chunks
        return total / store_s / 1e9, total / load_s / 1e9
    finally:
        if tier == "redis":
            for t in rt.gateway.tiers.tiers:
                await t.delete_owner(rt.gateway.deriver.owner_label(tenant))
        await rt.aclose()


async def _lookup_latency(base: Path, db_url: str, reps: int = 300) -> dict[str, float]:
    """In-process lookup of a 32K-token prefix (128 chunks of 256 tokens), all stored: p50/p99 ms."""
    settings = Settings(state_dir=base, database_url=db_url, tiers=["memory"], chunk_tokens=256)
    rt = await open_runtime(settings, tiers=[MemoryTier(1 << 30)])
    try:
        await rt.admin.create_tenant("bench-lookup")
        cap = await rt.gateway.mint_capability("bench-lookup", "default", ["lookup", "put"], 600)
        tokens = list(range(32768))
        keys = await rt.gateway.keys_for("bench-lookup", "default", MODEL, tokens)
        for k in keys:  # presence is all a lookup reads
            await rt.gateway.tiers.put(k, b"x")
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            res = await rt.gateway.lookup(cap, MODEL, tokens)
            lat.append(time.perf_counter() - t0)
        assert res.hit_tokens == 32768
        lat.sort()
        return {"p50": round(lat[len(lat) // 2] * 1e3, 3), "p99": round(lat[int(len(lat) * 0.99)] * 1e3, 3)}
    finally:
        await rt.aclose()


def _redis_url() -> str | None:
    url = os.environ.get("KVGATE_BENCH_REDIS_URL") or os.environ.get("KVGATE_REDIS_URL") or "redis://127.0.0.1:6379/0"
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        import socket

        socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), 1).close()
        return url
    except OSError:
        return None


async def run_bench(*, quick: bool = False, reps: int = 7, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    reps = 3 if quick else reps
    sizes = [16, 256]
    thread_counts = [1] if quick else [1, 2]
    redis_url = _redis_url()
    tiers = ["memory"] if quick else ["memory", "disk"] + (["redis"] if redis_url else [])
    target_bytes = 64 << 20 if quick else 256 << 20
    results: list[dict[str, Any]] = []
    base = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    db_url = f"sqlite+aiosqlite:///{base / 'bench.db'}"
    try:
        await asyncio.to_thread(dbschema.upgrade, db_url)
        configs = [
            (c, t, tier, e) for c in sizes for t in thread_counts for tier in tiers for e in (True, False)
            if tier != "redis" or t == 1  # the raw redis-py ceiling is one client: compare like with like
        ]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("bench", total=len(configs))
            ceilings: dict[tuple[int, int], dict[str, float]] = {}
            for chunk_tokens, threads, tier, encrypted in configs:
                chunk_bytes = GEOMETRY.chunk_nbytes(chunk_tokens)
                n_chunks = max(2, target_bytes // chunk_bytes) if tier == "memory" else max(2, (target_bytes // 4) // chunk_bytes)
                if tier == "redis" and ("redis", chunk_tokens) not in ceilings:
                    rs, rg = await bench_net.redis_ceilings(redis_url, chunk_bytes, n_chunks, reps)
                    ceilings[("redis", chunk_tokens)] = {"redis_set": rs, "redis_get": rg}
                total = chunk_bytes * n_chunks
                if (chunk_tokens, threads) not in ceilings:
                    seal, open_ = aes_ceiling(total, chunk_bytes, threads, reps)
                    ceilings[(chunk_tokens, threads)] = {
                        "aes_gcm_seal": seal, "aes_gcm_open": open_,
                        "memcpy": memcpy_ceiling(total, chunk_bytes, threads, reps),
                    }
                ceil = ceilings[(chunk_tokens, threads)]
                progress.update(task, description=f"{tier} {chunk_bytes >> 20} MiB x{threads} {'enc' if encrypted else 'plain'}")
                store, load = await _gateway_figures(
                    base, db_url, tier, encrypted, chunk_tokens, threads, n_chunks, reps, redis_url
                )
                for op, gbps in (("store", store), ("load", load)):
                    if tier == "redis":
                        name = "redis_set" if op == "store" else "redis_get"
                        ceiling = {"name": name, "gbps": round(ceilings[("redis", chunk_tokens)][name], 3)}
                    elif encrypted:
                        ceiling = {"name": "aes_gcm", "gbps": round(ceil["aes_gcm_seal" if op == "store" else "aes_gcm_open"], 3)}
                    else:
                        ceiling = {"name": "memcpy", "gbps": round(ceil["memcpy"], 3)}
                    results.append({
                        "op": op, "tier": tier, "encrypted": encrypted, "chunk_bytes": chunk_bytes,
                        "threads": threads, "gbps": round(gbps, 3), "ceiling": ceiling,
                    })
                progress.advance(task)
            latency = {"lookup_32k_tokens_in_process_ms": await _lookup_latency(base, db_url)}
            if not quick:
                progress.update(task, description="REST data plane")
                byte_sizes = [GEOMETRY.chunk_nbytes(c) for c in sizes]
                counts = {b: max(2, (target_bytes // 4) // b) for b in byte_sizes}
                rest = await bench_net.rest_figures(base, byte_sizes, counts, reps)
                latency["lookup_32k_tokens_rest_ms"] = rest["lookup_ms"]
                for b in byte_sizes:
                    send, recv = bench_net.socket_ceiling(rest["bytes"][b], counts[b], reps)
                    for op, gbps, ceil in (("store", rest["put"][b], send), ("load", rest["get"][b], recv)):
                        results.append({
                            "op": op, "tier": "rest", "encrypted": True, "chunk_bytes": b, "threads": 1,
                            "gbps": round(gbps, 3), "ceiling": {"name": "socket", "gbps": round(ceil, 3)},
                        })
    finally:
        shutil.rmtree(base, ignore_errors=True)
    # issue 9: tenants, lookups per tier, LMCache side by side, workloads, the timing attack
    suite = await bench_suite.run_suite(results, quick=quick, redis_url=redis_url, console=console)
    latency["lookup_ms_by_tier"] = suite.pop("lookup_ms_by_tier")
    if "lookup_32k_tokens_rest_ms" in latency:
        latency["lookup_ms_by_tier"]["rest"] = latency["lookup_32k_tokens_rest_ms"]
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "reps": reps,
        "results": results,
        "latency": latency,
        **suite,
    }
    _print_table(console, results)
    for name, v in latency.items():
        if name == "lookup_ms_by_tier":
            continue
        console.print(f"{name}: p50 {v['p50']} ms, p99 {v['p99']} ms")
    return out


def _print_table(console: Console, results: list[dict[str, Any]]) -> None:
    table = Table("op", "tier", "enc", "chunk", "thr", "GB/s", "ceiling", "ceil GB/s", "ratio", "enc/plain",
                  title="kvgate bench (medians)")
    plain = {(r["op"], r["tier"], r["chunk_bytes"], r["threads"]): r["gbps"] for r in results if not r["encrypted"]}
    for r in results:
        ratio = r["gbps"] / r["ceiling"]["gbps"] if r["ceiling"]["gbps"] else 0.0
        key = (r["op"], r["tier"], r["chunk_bytes"], r["threads"])
        ep = f"{r['gbps'] / plain[key]:.2f}" if r["encrypted"] and plain.get(key) else ""
        table.add_row(r["op"], r["tier"], "yes" if r["encrypted"] else "no", f"{r['chunk_bytes'] / 2**20:.0f} MiB",
                      str(r["threads"]), f"{r['gbps']:.2f}", r["ceiling"]["name"], f"{r['ceiling']['gbps']:.2f}",
                      f"{ratio:.2f}", ep)
    console.print(table)
