"""`kvgate bench`: store and load throughput through the gateway core, beside ceilings measured
in the same run on the same bytes with the same number of threads (:mod:`gateway.bench.ceilings`):
``aes_gcm`` bounds the encrypted results, ``memcpy`` the plaintext ones, and every encrypted
memory-tier result is also reported against ``single_pass`` = min(AES-256-GCM, memcpy) (its
``single_pass`` field: the ceiling's GB/s and the result's ratio to it).

Each figure is the median of ``reps`` repetitions (the machine is small and noisy). Chunk sizes
are those of Llama-3-8B geometry (32 layers, 8 KV heads, head size 128, fp16): 16 tokens = 2 MiB
and 256 tokens = 32 MiB (33.5 MB). Results use the JSON shape later benchmarks extend:
``{"results": [{"op", "tier", "encrypted", "chunk_bytes", "threads", "gbps", "ceiling": {"name",
"gbps"}, "single_pass"?: {"gbps", "ratio"}}]}``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, cast

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gateway.bench import net as bench_net
from gateway.bench import suite as bench_suite
from gateway.bench.baselines import plaintext_runtime
from gateway.bench.ceilings import Ceilings, measure_ceilings
from gateway.bench.common import GEOMETRY, MODEL, percentiles_ms
from gateway.bench.peers import PeerConfig, run_lmcache
from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.runtime import open_embedded
from storage.base import Tier
from storage.disk import DiskTier
from storage.memory import MemoryTier

__all__ = ["run_bench"]


async def _gateway_figures(
    base: Path, db_url: str, tier: str, encrypted: bool, chunk_tokens: int, threads: int, n_chunks: int, reps: int,
    redis_url: str | None = None,
) -> tuple[float, float]:
    """(store GB/s, load GB/s) through the gateway core for one configuration."""
    settings = Settings(
        state_dir=base, database_url=db_url, chunk_tokens=chunk_tokens, cpu_threads=threads, tiers=[cast(Literal["memory", "disk", "redis"], tier)],  # Settings validates the name
        redis_url=redis_url if tier == "redis" else None,  # the redis tier requires its URL in Settings
    )
    chunk_bytes = GEOMETRY.chunk_nbytes(chunk_tokens)
    tokens_n = chunk_tokens * n_chunks
    tiers: list[Tier]
    if tier == "memory":
        # prefaulted (KVGATE_MEMORY_PREFAULT): the steady state a serving tier reaches after its
        # first fill; a fresh tier per configuration would otherwise time first-touch page faults
        tiers = [MemoryTier(chunk_bytes * n_chunks * 3 + (64 << 20), prefault=True)]
    elif tier == "redis":
        from storage.redis import RedisTier

        assert redis_url is not None, "the redis tier needs redis_url"
        tiers = [RedisTier(redis_url, prefix=f"kvgate-bench:{os.urandom(4).hex()}:", op_timeout_s=2.0, put_timeout_s=10.0)]
    else:
        shutil.rmtree(base / "bench-disk", ignore_errors=True)
        tiers = [await DiskTier.open(base / "bench-disk", fsync=True)]
    rt = await (open_embedded(settings, tiers=tiers) if encrypted else plaintext_runtime(settings, tiers=tiers))
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

        async def timed(coro_fn: Callable[[], Awaitable[Any]]) -> float:
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
            for t in rt.tiers.tiers:
                await t.delete_owner(rt.deriver.owner_label(tenant))
        await rt.aclose()


async def _lookup_latency(base: Path, db_url: str, reps: int = 300) -> dict[str, float]:
    """In-process lookup of a 32K-token prefix (128 chunks of 256 tokens), all stored: p50/p99 ms."""
    settings = Settings(state_dir=base, database_url=db_url, tiers=["memory"], chunk_tokens=256)
    rt = await open_embedded(settings, tiers=[MemoryTier(1 << 30)])
    try:
        await rt.admin.create_tenant("bench-lookup")
        cap = await rt.gateway.mint_capability("bench-lookup", "default", ["lookup", "put"], 600)
        tokens = list(range(32768))
        keys = await rt.gateway.keys_for("bench-lookup", "default", MODEL, tokens)
        for k in keys:  # presence is all a lookup reads
            await rt.tiers.put(k, b"x")
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            res = await rt.gateway.lookup(cap, MODEL, tokens)
            lat.append(time.perf_counter() - t0)
        if res.hit_tokens != 32768:
            raise RuntimeError(f"bench lookup hit {res.hit_tokens} of 32768 tokens")
        return percentiles_ms(lat)
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


async def run_bench(
    *, quick: bool = False, reps: int = 7, console: Console | None = None, peers: PeerConfig | None = None
) -> dict[str, Any]:
    """Every figure of `kvgate bench` as one JSON-able dict; :class:`gateway.bench.peers.PeerFailed`
    when a peer asked for fails to run."""
    console = console or Console()
    peers = peers or PeerConfig()
    reps = 3 if quick else reps
    sizes = [16, 256]
    thread_counts = [1] if quick else [1, 2]
    redis_url = _redis_url()
    tiers = ["memory"] if quick else ["memory", "disk"] + (["redis"] if redis_url else [])
    target_bytes = 64 << 20 if quick else 256 << 20
    # the peer first, on the same chunk sizes and bytes: one that fails ends the run before the rest
    console.print("bench: LMCache side by side" if peers.enabled else "bench: peers skipped (--no-peers)")
    lm = await asyncio.to_thread(
        run_lmcache, peers, [GEOMETRY.chunk_nbytes(c) for c in sizes], target_bytes, reps, redis_url,
        ["memory"] if quick else ["memory", "disk"] + (["redis"] if redis_url else []) + ["rest"],
    )
    if lm.get("skipped") and peers.enabled:
        console.print(f"[yellow]bench: LMCache skipped: {lm['skipped']}[/yellow]")
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
            ceilings: dict[tuple[int, int], Ceilings] = {}
            net_ceilings: dict[int, dict[str, float]] = {}
            for chunk_tokens, threads, tier, encrypted in configs:
                chunk_bytes = GEOMETRY.chunk_nbytes(chunk_tokens)
                n_chunks = max(2, target_bytes // chunk_bytes) if tier == "memory" else max(2, (target_bytes // 4) // chunk_bytes)
                if tier == "redis" and chunk_tokens not in net_ceilings:
                    assert redis_url is not None  # the redis tier runs only with a server
                    rs, rg = await bench_net.redis_ceilings(redis_url, chunk_bytes, n_chunks, reps)
                    net_ceilings[chunk_tokens] = {"redis_set": rs, "redis_get": rg}
                total = chunk_bytes * n_chunks
                if (chunk_tokens, threads) not in ceilings:
                    ceilings[(chunk_tokens, threads)] = measure_ceilings(total, chunk_bytes, threads, reps)
                ceil = ceilings[(chunk_tokens, threads)]
                progress.update(task, description=f"{tier} {chunk_bytes >> 20} MiB x{threads} {'enc' if encrypted else 'plain'}")
                store, load = await _gateway_figures(
                    base, db_url, tier, encrypted, chunk_tokens, threads, n_chunks, reps, redis_url
                )
                for op, gbps in (("store", store), ("load", load)):
                    if tier == "redis":
                        name = "redis_set" if op == "store" else "redis_get"
                        ceiling = {"name": name, "gbps": round(net_ceilings[chunk_tokens][name], 3)}
                    elif encrypted:
                        aes = ceil.aes_gcm_seal if op == "store" else ceil.aes_gcm_open
                        ceiling = {"name": "aes_gcm", "gbps": round(aes, 3)}
                    else:
                        ceiling = {"name": "memcpy", "gbps": round(ceil.memcpy, 3)}
                    row: dict[str, Any] = {
                        "op": op, "tier": tier, "encrypted": encrypted, "chunk_bytes": chunk_bytes,
                        "threads": threads, "gbps": round(gbps, 3), "ceiling": ceiling,
                    }
                    if tier == "memory" and encrypted:  # against the one-pass ceiling
                        sp = ceil.single_pass(op)
                        row["single_pass"] = {"gbps": round(sp, 3), "ratio": round(gbps / sp, 3) if sp else 0.0}
                    results.append(row)
                progress.advance(task)
            latency: dict[str, Any] = {"lookup_32k_tokens_in_process_ms": await _lookup_latency(base, db_url)}
            fast_paths: list[dict[str, Any]] = []
            if not quick:
                progress.update(task, description="REST data plane")
                byte_sizes = [GEOMETRY.chunk_nbytes(c) for c in sizes]
                counts = {b: max(2, (target_bytes // 4) // b) for b in byte_sizes}
                # loopback TCP, then the server's Unix socket (a server on the workers' host),
                # each against a raw socket of its own transport
                for uds in (False, True):
                    rest = await bench_net.rest_figures(base, byte_sizes, counts, reps, uds=uds)
                    if not uds:  # the raw paths and the wire client beside the public routes, same run
                        routed = await bench_net.rest_figures(base, byte_sizes, counts, reps, raw=False)
                        fast_paths = bench_net.fast_paths(rest, routed)
                    sfx = "_uds" if uds else ""
                    latency[f"lookup_32k_tokens_rest{sfx}_ms"] = rest["lookup_ms"]  # as a remote worker asks
                    if not uds:
                        latency["lookup_32k_tokens_rest_httpx_ms"] = rest["lookup_ms_httpx"]
                    for b in byte_sizes:
                        send, recv = bench_net.socket_ceiling(rest["bytes"][b], counts[b], reps, uds=uds)
                        # a remote worker's store and load: one frame each way, keys in the fetch stream
                        rows = [("rest", "store", "put", send), ("rest", "load", "get_keyed", recv)]
                        if uds:  # the load with a shared-memory region lent (rest_keyed_shm_uds)
                            rows += [("rest_keyed_shm", "load", "get_keyed_shm", recv)]
                        for tier, op, name, sock in rows:
                            results.append({
                                "op": op, "tier": tier + sfx, "encrypted": True, "chunk_bytes": b, "threads": 1,
                                "gbps": round(rest[name][b], 3), "ceiling": {"name": "socket" + sfx, "gbps": round(sock, 3)},
                                "cpu_s_per_gb": rest["cpu_s_per_gb"][name][b],
                            })
    finally:
        shutil.rmtree(base, ignore_errors=True)
    # the suite: tenants, lookups per tier, LMCache side by side, workloads, the timing attack
    suite = await bench_suite.run_suite(results, quick=quick, redis_url=redis_url, console=console, lmcache=lm)
    latency["lookup_ms_by_tier"] = suite.pop("lookup_ms_by_tier")
    if "lookup_32k_tokens_rest_ms" in latency:
        latency["lookup_ms_by_tier"]["rest"] = latency["lookup_32k_tokens_rest_ms"]
    if "lookup_32k_tokens_rest_uds_ms" in latency:
        latency["lookup_ms_by_tier"]["rest_uds"] = latency["lookup_32k_tokens_rest_uds_ms"]
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "reps": reps,
        "results": results,
        "latency": latency,
        "fast_paths": fast_paths,
        **suite,
    }
    _print_table(console, results)
    _print_comparisons(console, out["comparisons"])
    for name, v in latency.items():
        if name == "lookup_ms_by_tier":
            continue
        console.print(f"{name}: p50 {v['p50']} ms, p99 {v['p99']} ms")
    return out


def _print_table(console: Console, results: list[dict[str, Any]]) -> None:
    table = Table("op", "tier", "enc", "chunk", "thr", "GB/s", "ceiling", "ceil GB/s", "ratio", "single_pass GB/s",
                  "vs single_pass", "enc/plain", title="kvgate bench (medians)")
    plain = {(r["op"], r["tier"], r["chunk_bytes"], r["threads"]): r["gbps"] for r in results if not r["encrypted"]}
    for r in results:
        ratio = r["gbps"] / r["ceiling"]["gbps"] if r["ceiling"]["gbps"] else 0.0
        key = (r["op"], r["tier"], r["chunk_bytes"], r["threads"])
        ep = f"{r['gbps'] / plain[key]:.2f}" if r["encrypted"] and plain.get(key) else ""
        sp = r.get("single_pass")
        table.add_row(r["op"], r["tier"], "yes" if r["encrypted"] else "no", f"{r['chunk_bytes'] / 2**20:.0f} MiB",
                      str(r["threads"]), f"{r['gbps']:.2f}", r["ceiling"]["name"], f"{r['ceiling']['gbps']:.2f}",
                      f"{ratio:.2f}", f"{sp['gbps']:.2f}" if sp else "", f"{sp['ratio']:.2f}" if sp else "", ep)
    console.print(table)


def _print_comparisons(console: Console, comps: list[dict[str, Any]]) -> None:
    if not comps:
        return
    table = Table("figure", "kvgate GB/s", "LMCache GB/s", "kvgate / LMCache", "single_pass GB/s",
                  title="kvgate beside LMCache (same bytes, 1 thread, medians)")
    for c in comps:
        sp = c.get("single_pass_gbps")
        table.add_row(c["figure"], f"{c['kvgate']:.2f}", f"{c['peer_value']:.2f}", f"{c['ratio']:.2f}",
                      f"{sp:.2f}" if sp is not None else "")
    console.print(table)
