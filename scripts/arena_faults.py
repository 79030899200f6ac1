"""Page faults and GB/s of a memory-tier store loop, 2 MiB and 32 MiB envelopes.

Each mode fills the tier once (warm-up: the tier then evicts on every store), then stores
``--gib`` GiB more and reports minor page faults per GB stored (resource.getrusage ru_minflt) and
GB/s. "Writing an envelope" is an np.copyto from a source buffer (what the seal does to its
output buffer).

  fresh    a new np.empty envelope per store, handed to ``put`` (what a tier that keeps the
           buffer it is handed costs; run it against another checkout with PYTHONPATH=<checkout>)
  reuse    one envelope buffer written and ``put`` each time (the arena copies it in)
  reserve  ``reserve`` an extent, write the envelope straight into it, ``commit`` (no copy)

``--groups N`` keeps each group's envelopes in an arena of its own (``group_arenas``, as the
server's memory tier does) and stores runs of ``--run`` chunks, each run of a group drawn at random: tenants' prompts
arriving in no order, a run evicting its own group's oldest envelopes at times and another's at
others, with the tier trimming the arenas whenever the bytes they may hold resident pass its
budget by an eighth.

    PYTHONPATH=$PWD python scripts/arena_faults.py --mode reserve [--prefault] [--groups 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import time

import numpy as np

from storage import ChunkKey, MemoryTier


def key(i: int, groups: int = 0, run: int = 1) -> ChunkKey:
    """Chunk ``i``'s key: with ``groups``, runs of ``run`` chunks each of a group drawn at random
    (seeded), so that a run evicts its own group's envelopes at times and another's at others."""
    if not groups:
        return ChunkKey("aa", "bb", f"{i:064x}")
    return ChunkKey("aa", f"b{random.Random(i // run).randrange(groups):x}", f"{i:064x}")


async def loop(mode: str, size: int, capacity: int, total: int, prefault: bool, groups: int = 0, run: int = 1) -> tuple[float, float]:
    kw: dict[str, bool] = {"prefault": True} if prefault else {}
    if groups:
        kw["group_arenas"] = True
    tier = MemoryTier(capacity, **kw)
    src = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    env = np.empty(size, dtype=np.uint8)
    n_warm, n = capacity // size, total // size

    async def store(i: int) -> None:
        k = key(i, groups, run)
        if mode == "fresh":
            buf = np.empty(size, dtype=np.uint8)
            np.copyto(buf, src)
            await tier.put(k, buf.data)
        elif mode == "reuse":
            np.copyto(env, src)
            await tier.put(k, env.data)
        else:
            res = tier.reserve(k, size)
            np.copyto(np.frombuffer(res.view, dtype=np.uint8), src)
            tier.commit(res)

    for i in range(n_warm):
        await store(i)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for i in range(n_warm, n_warm + n):
        await store(i)
    dt = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    await tier.aclose()
    return faults / (n * size / 1e9), n * size / dt / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fresh", "reuse", "reserve"], required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--capacity-mib", type=int, default=256)
    p.add_argument("--prefault", action="store_true")
    p.add_argument("--groups", type=int, default=0, help="group arenas, this many groups, one drawn at random for each run (0: one arena)")
    p.add_argument("--run", type=int, default=8, help="chunks of one group stored in a row (a run)")
    a = p.parse_args()
    for mib in (2, 32):
        fpg, gbs = asyncio.run(loop(a.mode, mib << 20, a.capacity_mib << 20, int(a.gib * (1 << 30)), a.prefault,
                                    a.groups, a.run))
        print(f"mode={a.mode} groups={a.groups} chunk={mib}MiB faults/GB={fpg:.0f} GB/s={gbs:.2f}")


if __name__ == "__main__":
    main()
