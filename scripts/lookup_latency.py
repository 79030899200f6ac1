"""In-process lookup of a 32K-token prefix (128 chunks of 256 tokens, all present) through the
public ``Gateway.lookup``: wall and CPU-time p50/p99 ms, and a profile. It uses only public
seams, so it runs against another checkout too (PYTHONPATH=<checkout>).

    PYTHONPATH=$PWD python scripts/lookup_latency.py [--tiers memory,disk] [--reps 500] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import tempfile
import time

SORT = os.environ.get("SORT", "tottime")
from pathlib import Path

from gateway.bench import MODEL
from gateway.config import Settings
from gateway.services.runtime import open_embedded
from storage.base import Tier
from storage.disk import DiskTier
from storage.memory import MemoryTier


async def main(tiers: list[str], reps: int, profile: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        made: list[Tier] = []
        for name in tiers:
            if name == "memory":
                made.append(MemoryTier(1 << 30))
            else:
                made.append(await DiskTier.open(base / "disk", fsync=False))
        rt = await open_embedded(Settings(state_dir=base, tiers=tiers, chunk_tokens=256), tiers=made, auto_migrate=True)
        try:
            await rt.admin.create_tenant("bench-lookup")
            cap = await rt.gateway.mint_capability("bench-lookup", "default", ["lookup"], 600)
            tokens = list(range(32768))
            keys = await rt.gateway.keys_for("bench-lookup", "default", MODEL, tokens)
            for k in keys:
                await rt.tiers.put(k, b"x")
            if hasattr(rt.tiers, "flush"):
                await rt.tiers.flush()
            lat, cpu = [], []
            for i in range(reps + 20):
                t0, c0 = time.perf_counter(), time.thread_time()
                res = await rt.gateway.lookup(cap, MODEL, tokens)
                if i >= 20:
                    lat.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
            assert res.hit_tokens == 32768, res
            lat.sort()
            cpu.sort()
            # wall time suffers from the other processes on a loaded box; CPU time much less
            print(f"tiers={','.join(tiers)} reps={reps} wall p50={lat[len(lat) // 2] * 1e3:.3f} ms "
                  f"p99={lat[int(len(lat) * 0.99)] * 1e3:.3f} ms | cpu p50={cpu[len(cpu) // 2] * 1e3:.3f} ms "
                  f"p99={cpu[int(len(cpu) * 0.99)] * 1e3:.3f} ms")
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    await rt.gateway.lookup(cap, MODEL, tokens)
                prof.disable()
                pstats.Stats(prof).sort_stats(SORT).print_stats(25)
        finally:
            await rt.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tiers", default="memory")
    p.add_argument("--reps", type=int, default=500)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    asyncio.run(main(a.tiers.split(","), a.reps, a.profile))
