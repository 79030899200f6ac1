"""A layer-wise load of bench-e2e's model alone, outside any engine: the embedded core's public
``Gateway.retrieve(on_layers=)`` of an N-token hit into a CPU-layout fp32 cache (12 layers, 8 KV
heads of 64, blocks of 32, chunks of 256), memory tier. Per run: the lead (until the first layer
is in, in every chunk: what an engine's forward waits before its first layer) and the whole
load, medians of ``--reps``, for each thread count and segment size asked. It is the ceiling a
load inside the engine is measured against (there it shares two cores with the forward).

    PYTHONPATH=$PWD python scripts/retrieve_lead.py [--tokens 4096,8192] [--threads 2,0]
        [--segments 2097152,1048576] [--reps 15] [--json out.json]

``--threads 0`` opens on the event loop's thread (one core, and cProfile sees all of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.runtime import open_embedded
from kernels.layouts import KVGeometry, KVLayout
from scripts.bench_e2e.model import SIZES
from storage.memory import MemoryTier

_FULL = SIZES["full"]
GEOMETRY = KVGeometry(_FULL.layers, _FULL.kv_heads, _FULL.head_size, torch.float32, 32, KVLayout.CPU)  # vLLM's CPU cache
MODEL = KVModel("bench-llama", GEOMETRY)


async def one(base: Path, tokens: int, threads: int, segment: int, reps: int) -> dict[str, Any]:
    state = base / f"{tokens}-{threads}-{segment}"
    state.mkdir(parents=True, mode=0o700)
    url = f"sqlite+aiosqlite:///{state / 'bench.db'}"
    await asyncio.to_thread(dbschema.upgrade, url)
    settings = Settings(state_dir=state, database_url=url, chunk_tokens=256, cpu_threads=threads,
                        segment_bytes=segment, tiers=["memory"])
    rt = await open_embedded(settings, tiers=[MemoryTier(4 << 30)])
    try:
        await rt.admin.create_tenant("a")
        cap = await rt.gateway.mint_capability("a", "default", ["lookup", "get", "put"], 600)
        blocks = list(range(tokens // GEOMETRY.block_size + 1))
        src = [torch.randn(GEOMETRY.layer_shape(len(blocks))) for _ in range(GEOMETRY.num_layers)]
        dst = [torch.zeros_like(x) for x in src]
        prompt = [random.randrange(30000) for _ in range(tokens)]
        await rt.gateway.store(cap, MODEL, prompt, src, block_ids=blocks)
        leads, totals = [], []
        for _ in range(reps):
            first: list[float] = []

            def on_layers(n: int, first: list[float] = first) -> None:
                if not first:
                    first.append(time.perf_counter())

            t0 = time.perf_counter()
            got = await rt.gateway.retrieve(cap, MODEL, prompt, dst, block_ids=blocks,
                                            write_upto=tokens - GEOMETRY.block_size, on_layers=on_layers)
            t1 = time.perf_counter()
            if got.loaded_tokens != tokens:
                raise SystemExit(f"loaded {got.loaded_tokens} of {tokens} tokens")
            leads.append((first[0] - t0) * 1e3)
            totals.append((t1 - t0) * 1e3)
        total = statistics.median(totals)
        return {"tokens": tokens, "threads": threads, "segment_bytes": segment, "reps": reps,
                "lead_ms": round(statistics.median(leads), 2), "load_ms": round(total, 2),
                "load_gbps": round(GEOMETRY.chunk_nbytes(tokens) / total / 1e6, 2)}
    finally:
        await rt.aclose()


async def main(a: argparse.Namespace) -> None:
    from gateway.bench.ceilings import aes_ceiling

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in a.tokens:
            for threads in a.threads:
                for segment in a.segments:
                    row = await one(Path(tmp), tokens, threads, segment, a.reps)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    _seal, open_ = aes_ceiling(192 << 20, 2 << 20, 1, 5)
    if a.json:
        a.json.write_text(json.dumps({"aes_gcm_open_gbps_one_core": round(open_, 2), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    p.add_argument("--tokens", type=ints, default=[4096, 8192, 16384])
    p.add_argument("--threads", type=ints, default=[2, 0])
    p.add_argument("--segments", type=ints, default=[2 << 20, 1 << 20])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", type=Path)
    asyncio.run(main(p.parse_args()))
