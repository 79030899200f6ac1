"""Workloads shaped like LMCache's own benchmarks, through the gateway core, and an eviction flood.

- ``multi-round-qa`` (LMCache ``benchmarks/multi_round_qa``): users of several tenants, each
  user's context is the tenant's shared system prompt, the user's own history and a new question;
  every round does what a worker does: lookup, retrieve the stored prefix, (prefill the rest),
  store the whole context.
- ``long-doc-qa`` (LMCache ``benchmarks/long_doc_qa``): documents of 20K tokens per tenant, a
  warm-up pass that stores each, then a query pass (document + a question) that should hit it.
- ``eviction-flood``: tenant B writes far more than the memory tier holds while tenant A keeps
  re-reading its working set; A's hit ratio with and without per-tenant quotas
  (``MemoryTier(owner_quota_bytes=...)``).

Synthetic KV: Llama-3-8B heads (8 KV heads x 128, fp16) on ``WORKLOAD_LAYERS`` of its 32 layers so
a run fits the machine (bytes scale linearly with layers). Reported per tenant: requests, prompt
and hit tokens, hit ratio, bytes loaded and stored, seconds spent in the gateway."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from kernels.layouts import KVGeometry, KVLayout
from storage.memory import MemoryTier

__all__ = ["eviction_flood", "long_doc_qa", "multi_round_qa", "run_workloads"]

WORKLOAD_LAYERS = 2
WORKLOAD_GEOMETRY = KVGeometry(WORKLOAD_LAYERS, 8, 128, torch.float16, 16, KVLayout.KV_FIRST)
WORKLOAD_MODEL = KVModel(f"bench-llama-3-8b-{WORKLOAD_LAYERS}-layers", WORKLOAD_GEOMETRY)
FLOOD_GEOMETRY = KVGeometry(4, 2, 64, torch.float16, 16, KVLayout.KV_FIRST)
FLOOD_MODEL = KVModel("bench-flood-model", FLOOD_GEOMETRY)


@dataclass
class _Tally:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0


class _Engine:
    """What a worker does per request: lookup, load the stored prefix, store the whole context."""

    def __init__(self, rt: EmbeddedRuntime, model: KVModel, max_tokens: int) -> None:
        self.rt, self.model = rt, model
        g = model.geometry
        blocks_n = -(-max_tokens // g.block_size)
        gen = torch.Generator().manual_seed(7)
        self.src = [torch.randn(g.layer_shape(blocks_n), generator=gen).to(g.dtype) for _ in range(g.num_layers)]
        self.dst = [torch.zeros_like(x) for x in self.src]
        self.blocks = list(range(blocks_n))
        self.caps: dict[str, str] = {}
        self.tally: dict[str, _Tally] = defaultdict(_Tally)

    async def tenant(self, name: str) -> None:
        await self.rt.admin.create_tenant(name)
        self.caps[name] = await self.rt.gateway.mint_capability(name, "default", ["lookup", "get", "put"], 600)

    async def request(self, tenant: str, tokens: list[int]) -> int:
        cap, g, t = self.caps[tenant], self.model.geometry, self.tally[tenant]
        blocks = self.blocks[: -(-len(tokens) // g.block_size)]
        t0 = time.perf_counter()
        hit = (await self.rt.gateway.lookup(cap, self.model, tokens)).hit_tokens
        loaded = 0
        if hit:
            loaded = (await self.rt.gateway.retrieve(cap, self.model, tokens[:hit], self.dst, block_ids=blocks)).loaded_tokens
        stored = await self.rt.gateway.store(cap, self.model, tokens, self.src, block_ids=blocks)
        t.seconds += time.perf_counter() - t0
        t.requests += 1
        t.prompt_tokens += len(tokens)
        t.hit_tokens += loaded
        t.bytes_loaded += g.chunk_nbytes(loaded) if loaded else 0
        t.bytes_stored += stored.bytes_stored
        return loaded

    def report(self, workload: str) -> list[dict[str, Any]]:
        return [
            {
                "workload": workload, "tenant": name, "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                "hit_tokens": t.hit_tokens, "hit_ratio": round(t.hit_tokens / max(1, t.prompt_tokens), 4),
                "bytes_loaded": t.bytes_loaded, "bytes_stored": t.bytes_stored, "seconds": round(t.seconds, 3),
            }
            for name, t in sorted(self.tally.items())
        ]


async def _runtime(base: Path, name: str, tier: MemoryTier) -> EmbeddedRuntime:
    state = base / name
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, mode=0o700)
    url = f"sqlite+aiosqlite:///{state / 'bench.db'}"
    await asyncio.to_thread(dbschema.upgrade, url)
    settings = Settings(state_dir=state, database_url=url, chunk_tokens=256, cpu_threads=2, tiers=["memory"])
    return await open_embedded(settings, tiers=[tier])


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


async def multi_round_qa(
    base: Path, *, tenants: int = 2, users: int = 4, rounds: int = 4, system_tokens: int = 1024,
    question_tokens: int = 64, answer_tokens: int = 192, seed: int = 0,
) -> list[dict[str, Any]]:
    """Users take turns (round-robin, as LMCache's benchmark interleaves sessions)."""
    rng = random.Random(seed)
    max_tokens = system_tokens + rounds * (question_tokens + answer_tokens) + 16
    rt = await _runtime(base, "mrqa", MemoryTier(4 << 30))
    try:
        eng = _Engine(rt, WORKLOAD_MODEL, max_tokens)
        histories: dict[tuple[str, int], list[int]] = {}
        for t in range(tenants):
            name = f"tenant-{t}"
            await eng.tenant(name)
            system = _words(rng, system_tokens)  # shared by the tenant's users, not across tenants
            for u in range(users):
                histories[(name, u)] = list(system)
        for _ in range(rounds):
            for (name, _u), history in histories.items():
                history.extend(_words(rng, question_tokens))
                await eng.request(name, history)
                history.extend(_words(rng, answer_tokens))  # the answer becomes history next round
        return eng.report("multi-round-qa")
    finally:
        await rt.aclose()


async def long_doc_qa(
    base: Path, *, tenants: int = 2, documents: int = 2, doc_tokens: int = 20_000, question_tokens: int = 64,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Warm-up pass (each document once, stores it), then a query pass that should hit it."""
    rng = random.Random(seed)
    rt = await _runtime(base, "ldqa", MemoryTier(8 << 30))
    try:
        eng = _Engine(rt, WORKLOAD_MODEL, doc_tokens + question_tokens + 16)
        docs: dict[str, list[list[int]]] = {}
        for t in range(tenants):
            await eng.tenant(f"tenant-{t}")
            docs[f"tenant-{t}"] = [_words(rng, doc_tokens) for _ in range(documents)]
        for name, ds in docs.items():
            for d in ds:
                await eng.request(name, d)
        warm = eng.report("long-doc-qa-warmup")
        eng.tally.clear()
        for name, ds in docs.items():
            for d in ds:
                await eng.request(name, d + _words(rng, question_tokens))
        return warm + eng.report("long-doc-qa-query")
    finally:
        await rt.aclose()


async def eviction_flood(
    base: Path, *, capacity_bytes: int = 32 << 20, rounds: int = 6, flood_factor: int = 4, prompt_tokens: int = 1024,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Tenant A keeps a working set of a quarter of the tier and re-reads it after each flood of
    ``flood_factor`` x capacity from tenant B; with quotas, each owner gets half the tier."""
    out = []
    prompt_bytes = FLOOD_GEOMETRY.chunk_nbytes(prompt_tokens)
    a_prompts = max(1, capacity_bytes // 4 // prompt_bytes)
    b_prompts = max(1, flood_factor * capacity_bytes // prompt_bytes)
    for quota in (None, capacity_bytes // 2):
        rng = random.Random(seed)
        rt = await _runtime(base, f"flood-{bool(quota)}", MemoryTier(capacity_bytes, owner_quota_bytes=quota))
        try:
            eng = _Engine(rt, FLOOD_MODEL, prompt_tokens)
            await eng.tenant("tenant-a")
            await eng.tenant("tenant-b")
            working = [_words(rng, prompt_tokens) for _ in range(a_prompts)]
            for p in working:
                await eng.request("tenant-a", p)
            eng.tally.clear()
            for _ in range(rounds):
                for _ in range(b_prompts):
                    await eng.request("tenant-b", _words(rng, prompt_tokens))
                for p in working:
                    await eng.request("tenant-a", p)
            rows = {r["tenant"]: r for r in eng.report("eviction-flood")}
            memory = rt.tiers.tier("memory")
            assert isinstance(memory, MemoryTier)
            stats = memory.stats()
            out.append({
                "quota_bytes": quota, "capacity_bytes": capacity_bytes,
                "tenant_a_hit_ratio": rows["tenant-a"]["hit_ratio"],
                "tenant_a_working_set_bytes": a_prompts * prompt_bytes,
                "tenant_b_bytes_written": rows["tenant-b"]["bytes_stored"],
                "evictions": stats.evictions,
            })
        finally:
            await rt.aclose()
    return out


async def run_workloads(base: Path, *, quick: bool = False) -> dict[str, Any]:
    if quick:
        mr = await multi_round_qa(base, tenants=1, users=2, rounds=2, system_tokens=512)
        ld = await long_doc_qa(base, tenants=1, documents=1, doc_tokens=4096)
        fl = await eviction_flood(base, capacity_bytes=8 << 20, rounds=2, flood_factor=2)
    else:
        mr = await multi_round_qa(base)
        ld = await long_doc_qa(base)
        fl = await eviction_flood(base)
    return {
        "geometry": {"model": WORKLOAD_MODEL.name, "layers": WORKLOAD_LAYERS, "kv_heads": 8, "head_size": 128,
                     "dtype": "float16", "chunk_tokens": 256},
        "tenants": mr + ld,
        "eviction_flood": fl,
    }
