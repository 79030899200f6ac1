"""The prefix-cache timing attack, reproduced the way the published audits run it.

Gu et al., "Auditing Prompt Caching in Language Model APIs" (ICML 2025): 250 ``hit`` prompts sharing a
long prefix (95%) with the victim's and 250 ``miss`` prompts sharing nothing, shuffled; a one-sided
two-sample Kolmogorov-Smirnov test of their latencies gives a tiny p-value when the cache leaks whether
the victim's prompt is cached. The victim is tenant A; the attacker times ``lookup`` then ``retrieve``
of the candidate (what a worker does before prefill). Here a hit is *slower* (the load moves and
decrypts its chunks): the alternative is "hit samples are stochastically larger". Before every sample
the victim stores a fresh prompt (untimed), so only whether the probe shares its prefix differs.

Targets (expected p): ``shared-baseline`` (isolation off, ``baselines.shared_tenant_runtime``; tiny),
``kvgate`` (as shipped: B's storage keys are HMACs under B's namespace secret; >= 0.01) and
``same-tenant-control`` (the victim times its own prompts; tiny); ``kvgate-published`` and
``same-tenant-control-published`` are the last two behind a prefix published to both tenants
(``published_hit_tokens``; their set-up: docs/architecture.md, section 5)."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from scipy.stats import ks_2samp

from gateway.bench.baselines import shared_tenant_runtime
from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.prefixes import chain_from_digest
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from kernels.layouts import KVGeometry, KVLayout
from storage.base import Tier
from storage.memory import MemoryTier

__all__ = ["TARGETS", "AttackResult", "run_attack", "run_attacks"]

TARGETS = ("shared-baseline", "kvgate", "same-tenant-control", "kvgate-published", "same-tenant-control-published")
# a small model so 500 samples of long prompts fit in seconds: 2 KiB of KV per token
ATTACK_GEOMETRY = KVGeometry(4, 2, 64, torch.float16, 16, KVLayout.KV_FIRST)
ATTACK_MODEL = KVModel("bench-attack-model", ATTACK_GEOMETRY)
_SHARED = "shared-pseudo-tenant"
_SCOPE = "attack-scope"


@dataclass(frozen=True, slots=True)
class AttackResult:
    name: str
    target: str
    p_value: float
    samples: int  # per class (hit and miss each)
    hit_median_ms: float
    miss_median_ms: float
    direct_hits: int  # hit probes whose RetrieveResult itself reported loaded tokens beyond a published prefix
    published_hit_tokens: int | None = None  # the attacker's load of the published prefix (published targets)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


async def run_attack(
    target: str,
    *,
    samples: int = 250,
    prompt_tokens: int = 4096,
    shared_fraction: float = 0.95,
    chunk_tokens: int = 256,
    seed: int = 0,
    base: Path | None = None,
) -> AttackResult:
    """One attack against one target; ``samples`` hit and ``samples`` miss probes, shuffled."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    own_base = base is None
    base = Path(tempfile.mkdtemp(prefix="kvgate-attack-")) if base is None else base
    state = base / f"attack-{target}"
    shutil.rmtree(state, ignore_errors=True)
    db_url = f"sqlite+aiosqlite:///{state / 'bench.db'}"
    state.mkdir(parents=True, mode=0o700)
    await asyncio.to_thread(dbschema.upgrade, db_url)
    g = ATTACK_GEOMETRY
    prompt_bytes = g.chunk_nbytes(prompt_tokens)
    settings = Settings(state_dir=state, database_url=db_url, chunk_tokens=chunk_tokens, cpu_threads=1, tiers=["memory"])
    tiers: list[Tier] = [MemoryTier(max(64 << 20, prompt_bytes * 24))]
    if target == "shared-baseline":  # the baseline: isolation OFF
        rt = await shared_tenant_runtime(settings, tiers=tiers, pseudo_tenant=_SHARED)
    else:
        rt = await open_embedded(settings, tiers=tiers)
    try:
        for t in ("tenant-a", "tenant-b"):
            await rt.admin.create_tenant(t)
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        blocks_n = -(-prompt_tokens // g.block_size)
        src = [torch.randn(g.layer_shape(blocks_n), generator=gen).to(g.dtype) for _ in range(g.num_layers)]
        dst = [torch.zeros_like(x) for x in src]
        blocks = list(range(blocks_n))
        shared = int(prompt_tokens * shared_fraction)

        # published targets: every prompt starts with the published prefix (one chunk), so hit and
        # miss probes both load it and differ only in the victim's private part
        published = target.endswith("-published")
        lead = chunk_tokens if published else 0
        if published and prompt_tokens < 2 * chunk_tokens:
            raise ValueError(f"a published target needs prompts of at least {2 * chunk_tokens} tokens")
        prefix = [rng.randrange(32000) for _ in range(lead)]

        def fresh() -> list[int]:
            return prefix + [rng.randrange(32000) for _ in range(prompt_tokens - lead)]

        if published:  # before the capabilities are minted, so that they list the scope
            await _publish_and_warm(rt, prefix, src, blocks[: -(-lead // g.block_size)], chunk_tokens)
        victim = await rt.gateway.mint_capability("tenant-a", "default", ["put", "get", "lookup"], 600)
        attacker_tenant = "tenant-a" if target.startswith("same-tenant-control") else "tenant-b"
        attacker = await rt.gateway.mint_capability(attacker_tenant, "default", ["get", "lookup"], 600)

        async def probe(prompt: list[int]) -> tuple[int, int]:
            t0 = time.perf_counter_ns()
            await rt.gateway.lookup(attacker, ATTACK_MODEL, prompt)
            res = await rt.gateway.retrieve(attacker, ATTACK_MODEL, prompt, dst, block_ids=blocks)
            return time.perf_counter_ns() - t0, res.loaded_tokens

        published_hit: int | None = None
        if published:  # the scope is live for the attacker: the published prefix loads
            _, published_hit = await probe(prefix)
            if published_hit != lead:
                raise RuntimeError(f"the attacker loaded {published_hit} tokens of the published prefix")
        # warm-up: staging buffers, key caches, the first namespace derivations
        for _ in range(5):
            p = fresh()
            await rt.gateway.store(victim, ATTACK_MODEL, p, src, block_ids=blocks)
            await probe(p[:shared] + fresh()[shared:])
            await probe(fresh())

        order = [True] * samples + [False] * samples
        rng.shuffle(order)
        hits: list[int] = []
        misses: list[int] = []
        direct = 0
        for is_hit in order:
            victim_prompt = fresh()
            await rt.gateway.store(victim, ATTACK_MODEL, victim_prompt, src, block_ids=blocks)
            candidate = victim_prompt[:shared] + fresh()[shared:] if is_hit else fresh()
            ns, loaded = await probe(candidate)
            (hits if is_hit else misses).append(ns)
            if is_hit and loaded > lead:
                direct += 1
        p_value = float(ks_2samp(hits, misses, alternative="less").pvalue)
        return AttackResult(
            name=f"prefix-timing-{prompt_tokens}tok-{int(shared_fraction * 100)}pct",
            target=target,
            p_value=p_value,
            samples=samples,
            hit_median_ms=round(sorted(hits)[len(hits) // 2] / 1e6, 4),
            miss_median_ms=round(sorted(misses)[len(misses) // 2] / 1e6, 4),
            direct_hits=direct,
            published_hit_tokens=published_hit,
        )
    finally:
        await rt.aclose()
        if own_base:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(state, ignore_errors=True)


async def _publish_and_warm(
    rt: EmbeddedRuntime, prefix: list[int], kv: list[torch.Tensor], blocks: list[int], chunk_tokens: int,
) -> None:
    """A scope of both tenants, ``prefix`` published into it and stored by a worker holding the
    publish answer's capability, as an operator's warm-up does (docs/prefixes.md)."""
    await rt.prefixes.create_scope(_SCOPE, members=["tenant-a", "tenant-b"])
    pub = await rt.prefixes.publish(_SCOPE, ATTACK_MODEL.name, prefix)
    digest = ATTACK_MODEL.fingerprint_digest
    raw = b"".join(t.to_bytes(4, "little") for t in prefix)
    await rt.prefixes.warm(pub.capability, pub.publication.id, digest, chain_from_digest(digest, raw, chunk_tokens))
    res = await rt.gateway.store(pub.capability, ATTACK_MODEL, prefix, kv, block_ids=blocks)
    if res.stored != pub.whole_chunks:
        raise RuntimeError(f"the warm-up stored {res.stored} of {pub.whole_chunks} published chunks")


async def run_attacks(*, samples: int = 250, prompt_tokens: int = 4096, seed: int = 0) -> list[AttackResult]:
    """Every target in turn, each in a fresh runtime."""
    return [await run_attack(t, samples=samples, prompt_tokens=prompt_tokens, seed=seed + i) for i, t in enumerate(TARGETS)]
