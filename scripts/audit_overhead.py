"""Store and load throughput through the gateway core with the audit writer on Postgres versus an
audit sink that drops events (the budget: auditing costs the data path at most 2%).

    python scripts/audit_overhead.py [postgresql+asyncpg://postgres@127.0.0.1:5432/postgres]

Creates a scratch database, runs both configurations interleaved (median of 9 rounds each),
prints the ratio, drops the database."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import torch

from gateway.bench import GEOMETRY, MODEL
from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.runtime import open_embedded
from storage.memory import MemoryTier


class DropSink:
    def emit(self, event) -> None:  # the "audit off" baseline
        pass


async def main(admin_url: str) -> None:
    name = f"kvgate_audit_overhead_{secrets.token_hex(4)}"
    plain = admin_url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(plain)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        await asyncio.to_thread(dbschema.upgrade, url)
        base = Path(tempfile.mkdtemp())
        rt = await open_embedded(Settings(state_dir=base, database_url=url, tiers=["memory"], chunk_tokens=256),
                                 tiers=[MemoryTier(2 << 30)])
        real = rt.audit
        await rt.admin.create_tenant("t")
        cap = await rt.gateway.mint_capability("t", "default", ["put", "get", "lookup"], 600)
        n_tokens = 256 * 8
        layers = [torch.randn(GEOMETRY.layer_shape(n_tokens // 16 * 2)).half() for _ in range(GEOMETRY.num_layers)]
        dst = [torch.zeros_like(x) for x in layers]
        blocks = torch.randperm(n_tokens // 16 * 2)[: n_tokens // 16]
        prompt = list(range(n_tokens))
        nbytes = GEOMETRY.chunk_nbytes(n_tokens)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(9):
            for label, sink in (("on", real), ("off", DropSink())):
                rt.access.audit = rt.chunks.audit = sink  # the services that audit data operations
                t0 = time.perf_counter()
                await rt.gateway.store(cap, MODEL, prompt, layers, block_ids=blocks, skip_existing=False)
                times.setdefault((label, "store"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await rt.gateway.retrieve(cap, MODEL, prompt, dst, block_ids=blocks)
                times.setdefault((label, "load"), []).append(time.perf_counter() - t0)
                # a denial per round: the one audited event on the data path
                try:
                    await rt.gateway.lookup("garbage", MODEL, prompt)
                except Exception:
                    pass
        rt.access.audit = rt.chunks.audit = real
        for op in ("store", "load"):
            on = nbytes / statistics.median(times[("on", op)]) / 1e9
            off = nbytes / statistics.median(times[("off", op)]) / 1e9
            print(f"{op}: audit on {on:.2f} GB/s, off {off:.2f} GB/s, on/off = {on / off:.3f}")
        await rt.aclose()
    finally:
        conn = await asyncpg.connect(plain)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"))
