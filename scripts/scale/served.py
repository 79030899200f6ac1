"""A live ``kvgate serve`` as the chunks it holds and the workers hitting it grow.

One server process (memory tier; its registry and audit log in a Postgres database the caller
creates and drops) through the public REST paths: chunks stored with framed ``PUT /v1/chunks``
(random chained hashes, envelopes of ``ENVELOPE_BYTES``), then per size ``POST /v1/lookup`` of a
stored 32K-token prefix, its latency as a client sees it, the server's CPU time per lookup (steadier
than wall time on a shared machine) and the server's resident memory. Then, with 1, 4, 16, 64
remote workers as processes of their own (``scripts.scale.worker``), each repeating a lookup and a
keyed load for the same time, started together: requests/s, per worker beside one worker's, and
p50/p99 of each call.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.bench.common import percentiles_ms
from gateway.bench.net import _cpu_seconds, _envelope
from scripts.scale import ENVELOPE_BYTES, LOOKUP_CHUNKS, rss_bytes
from scripts.scale.worker import Conn
from tests.support.killed_server import ServeProcess, create_tenant
from tests.support.paths import REPO

__all__ = ["LOAD_BYTES", "LOAD_CHUNKS", "ScaleServer", "served_figures"]

LOAD_CHUNKS = 16  # a worker's load: the first 16 chunks of a prefix ...
LOAD_BYTES = 16 << 10  # ... of 16 KiB envelopes each (256 KiB a load)
_BATCH = 4096  # envelopes per PUT: the server's default max_batch_items
_WARMUP = 20


class ScaleServer(ServeProcess):
    """``kvgate serve`` (``tests.support.killed_server``) with a memory tier of ``memory_bytes``
    and the product's default data-path threads."""

    def __init__(self, state_dir: Path, db_url: str, memory_bytes: int) -> None:
        super().__init__(state_dir, db_url)
        self.memory_bytes = memory_bytes

    def env(self) -> dict[str, str]:
        env = super().env()
        env["KVGATE_MEMORY_BYTES"] = str(self.memory_bytes)
        env.pop("KVGATE_CPU_THREADS", None)
        return env


def _lookup_sweep(server: ScaleServer, conn: Conn, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    assert server.proc is not None
    envelope = _envelope(ENVELOPE_BYTES)
    prefix = [secrets.token_hex(32) for _ in range(LOOKUP_CHUNKS)]
    conn.put(prefix, envelope)
    base = rss_bytes(server.proc.pid)
    stored = LOOKUP_CHUNKS
    rows: list[dict[str, Any]] = []
    for n in sizes:
        while stored < n:
            k = min(_BATCH, n - stored)
            conn.put([secrets.token_hex(32) for _ in range(k)], envelope)
            stored += k
        rss = rss_bytes(server.proc.pid)
        conn.mint(ops=("lookup", "get", "put"))  # a fresh capability per size: a long fill outlives one
        lat = []
        for i in range(reps + _WARMUP):
            if i == _WARMUP:
                cpu0 = _cpu_seconds(server.proc.pid)
            t0 = time.perf_counter()
            hit = conn.lookup(prefix)
            if i >= _WARMUP:
                lat.append(time.perf_counter() - t0)
            if hit != LOOKUP_CHUNKS:
                raise RuntimeError(f"lookup found {hit} of {LOOKUP_CHUNKS} chunks")
        cpu_ms = (_cpu_seconds(server.proc.pid) - cpu0) / reps * 1e3
        per_chunk = (rss - base) / (n - LOOKUP_CHUNKS) if n > LOOKUP_CHUNKS else 0.0
        rows.append({
            "chunks": n, "wall_ms": percentiles_ms(lat), "server_cpu_ms": round(cpu_ms, 3), "rss_bytes": rss,
            "rss_base_bytes": base, "bytes_per_chunk": round(per_chunk, 1),
        })
        print(f"served lookup, {n:>9,} chunks: {rows[-1]['wall_ms']} server cpu {cpu_ms:.3f} ms "
              f"rss {rss / 2**20:,.0f} MiB ({per_chunk:,.0f} B/chunk)", file=sys.stderr, flush=True)
    return rows


def _workers(server: ScaleServer, bearer: str, k: int, duration_s: float, lookup: list[str], load: list[str]) -> dict[str, Any]:
    """``k`` worker processes, released together, for ``duration_s``."""
    assert server.proc is not None
    job = json.dumps({"url": server.base_url, "bearer": bearer, "lookup": lookup, "load": load, "duration_s": duration_s})
    procs = [
        subprocess.Popen([sys.executable, "-m", "scripts.scale.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        for _ in range(k)
    ]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(job + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a worker did not start: {line!r}")
        cpu0, t0 = _cpu_seconds(server.proc.pid), time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(server.proc.pid) - cpu0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    lookups = [s for r in results for s in r["lookup_s"]]
    loads = [s for r in results for s in r["load_s"]]
    errors: dict[str, int] = {}
    for r in results:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    rate = sum((len(r["lookup_s"]) + len(r["load_s"])) / r["window_s"] for r in results)
    requests = len(lookups) + len(loads)
    return {
        "workers": k, "requests": requests, "requests_per_s": round(rate, 1), "per_worker": round(rate / k, 1),
        "lookup_ms": percentiles_ms(lookups) if lookups else None, "load_ms": percentiles_ms(loads) if loads else None,
        "server_cpu_ms_per_request": round(cpu / max(1, requests) * 1e3, 3), "wall_s": round(wall, 2), "errors": errors,
    }


def served_figures(db_url: str, sizes: list[int], reps: int, levels: list[int], duration_s: float) -> dict[str, Any]:
    """The served lookup sweep, then the worker levels, on one server with ``db_url`` as its database."""
    memory = max(sizes) * (ENVELOPE_BYTES + 64) + LOAD_CHUNKS * LOAD_BYTES + (256 << 20)
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-serve-") as tmp:
        server = ScaleServer(Path(tmp) / "state", db_url, memory)
        server.start()
        try:

            asyncio.run(create_tenant(server, "scale"))
            bearer = server.token("scale", ("kv.worker", "kv.admin"))
            conn = Conn(server.base_url, bearer)
            conn.mint(ops=("lookup", "get", "put"))
            lookups = _lookup_sweep(server, conn, sizes, reps)
            load = [secrets.token_hex(32) for _ in range(LOAD_CHUNKS)]
            conn.put(load, _envelope(LOAD_BYTES))
            prefix = [secrets.token_hex(32) for _ in range(LOOKUP_CHUNKS)]
            conn.put(prefix, _envelope(ENVELOPE_BYTES))
            conn.close()
            levels_out = []
            for k in levels:
                row = _workers(server, bearer, k, duration_s, prefix, load)
                levels_out.append(row)
                print(f"served, {k:>2} workers: {row['requests_per_s']:,.0f} req/s ({row['per_worker']:,.0f} each) "
                      f"lookup {row['lookup_ms']} load {row['load_ms']} errors {row['errors']}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    return {"lookup": lookups, "workers": levels_out}
