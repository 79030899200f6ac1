"""The bench's two baselines (gateway/bench/baselines.py) do what their figures claim, beside the
product as shipped (positive controls): the plaintext runtime leaves the KV's bytes readable in
the tier, the product does not; the shared-tenant runtime lets tenant B load tenant A's prompt,
the product does not. Whoever re-implements them on public seams keeps these true."""

from __future__ import annotations

import asyncio

import torch

from gateway.bench.baselines import plaintext_runtime, shared_tenant_runtime
from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.runtime import open_embedded
from kernels.layouts import KVGeometry, KVLayout
from storage.memory import MemoryTier

G = KVGeometry(2, 2, 64, torch.float16, 16, KVLayout.KV_FIRST)
MODEL = KVModel("bench-baseline-model", G)
TOKENS = 64


async def _settings(tmp_path, name: str) -> Settings:
    state = tmp_path / name
    state.mkdir(mode=0o700)
    url = f"sqlite+aiosqlite:///{state / 'b.db'}"
    await asyncio.to_thread(dbschema.upgrade, url)
    return Settings(state_dir=state, database_url=url, chunk_tokens=16, cpu_threads=1, tiers=["memory"])


def _kv() -> tuple[list[torch.Tensor], list[int]]:
    gen = torch.Generator().manual_seed(5)
    blocks = TOKENS // G.block_size
    return [torch.randn(G.layer_shape(blocks), generator=gen).half() for _ in range(G.num_layers)], list(range(blocks))


async def _tier_bytes(tier: MemoryTier) -> bytes:
    return b"".join([bytes((await tier.get(k)).data) for k in await tier.list_keys()])


async def test_plaintext_baseline_stores_readable_kv_the_product_does_not(tmp_path):
    layers, blocks = _kv()
    probe = layers[0].flatten()[:64].numpy().tobytes()  # 128 bytes of the first layer's KV
    prompt = list(range(TOKENS))
    for name, opener, readable in (("plain", plaintext_runtime, True), ("product", open_embedded, False)):
        tier = MemoryTier(64 << 20)
        rt = await opener(await _settings(tmp_path, name), tiers=[tier])
        try:
            await rt.admin.create_tenant("a")
            cap = await rt.gateway.mint_capability("a", "default", ["put", "get", "lookup"], 600)
            await rt.gateway.store(cap, MODEL, prompt, layers, block_ids=blocks)
            stored = await _tier_bytes(tier)
            assert stored, name
            assert (probe in stored) is readable, name
            dst = [torch.zeros_like(x) for x in layers]
            res = await rt.gateway.retrieve(cap, MODEL, prompt, dst, block_ids=blocks)
            assert res.loaded_tokens == TOKENS and all(torch.equal(a, b) for a, b in zip(dst, layers)), name
        finally:
            await rt.aclose()


async def test_shared_tenant_baseline_lets_b_load_a_the_product_does_not(tmp_path):
    layers, blocks = _kv()
    prompt = list(range(100, 100 + TOKENS))
    for name, shared in (("shared", True), ("product", False)):
        settings = await _settings(tmp_path, name)
        tiers = [MemoryTier(64 << 20)]
        if shared:
            rt = await shared_tenant_runtime(settings, tiers=tiers, pseudo_tenant="everyone")
        else:
            rt = await open_embedded(settings, tiers=tiers)
        try:
            for t in ("a", "b"):
                await rt.admin.create_tenant(t)
            a = await rt.gateway.mint_capability("a", "default", ["put"], 600)
            b = await rt.gateway.mint_capability("b", "default", ["get", "lookup"], 600)
            await rt.gateway.store(a, MODEL, prompt, layers, block_ids=blocks)
            hit = (await rt.gateway.lookup(b, MODEL, prompt)).hit_tokens
            dst = [torch.zeros_like(x) for x in layers]
            loaded = (await rt.gateway.retrieve(b, MODEL, prompt, dst, block_ids=blocks)).loaded_tokens
            assert (hit, loaded) == ((TOKENS, TOKENS) if shared else (0, 0)), name
            assert all(torch.equal(x, y) for x, y in zip(dst, layers)) is shared, name
        finally:
            await rt.aclose()
