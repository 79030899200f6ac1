"""Helpers to build a real gateway (SQLite or Postgres registry, memory and disk tiers) in tests."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import pack, slots_from_block_ids

ALL_OPS = ["lookup", "get", "put", "pin"]


def small_geometry(layout: KVLayout = KVLayout.KV_FIRST, dtype: torch.dtype = torch.float16) -> KVGeometry:
    return KVGeometry(num_layers=4, num_kv_heads=2, head_size=16, dtype=dtype, block_size=4, layout=layout)


def model_for(geometry: KVGeometry, name: str = "test-model") -> KVModel:
    return KVModel(name, geometry)


def random_cache(geometry: KVGeometry, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(geometry.layer_shape(num_blocks), generator=gen).to(geometry.dtype)
        for _ in range(geometry.num_layers)
    ]


def zero_cache(geometry: KVGeometry, num_blocks: int) -> list[torch.Tensor]:
    return [torch.zeros(geometry.layer_shape(num_blocks), dtype=geometry.dtype) for _ in range(geometry.num_layers)]


def gathered(cache: list[torch.Tensor], geometry: KVGeometry, blocks, num_tokens: int) -> torch.Tensor:
    """The KV of the first num_tokens tokens of a block table, as bytes (bit-exact comparisons)."""
    slots = slots_from_block_ids(blocks, geometry.block_size, 0, num_tokens)
    return pack(cache, slots, geometry).view(torch.uint8)


def settings_for(state_dir: Path, db_url: str | None = None, **kw) -> Settings:
    kw.setdefault("tiers", ["memory", "disk"])
    kw.setdefault("memory_bytes", 256 << 20)
    kw.setdefault("chunk_tokens", 16)
    kw.setdefault("segment_bytes", 4096)
    kw.setdefault("cpu_threads", 2)
    return Settings(state_dir=state_dir, database_url=db_url, **kw)


async def migrate(url: str) -> None:
    await asyncio.to_thread(dbschema.upgrade, url)


@asynccontextmanager
async def gateway_runtime(state_dir: Path, db_url: str | None = None, *, migrate_first: bool = True, **kw):
    settings = settings_for(state_dir, db_url, **kw)
    if migrate_first:
        await migrate(settings.db_url)
    rt: EmbeddedRuntime = await open_embedded(settings)
    try:
        yield rt
    finally:
        await rt.aclose()


async def store_and_load_back(
    rt: EmbeddedRuntime, cap: str, geometry: KVGeometry, tokens: list[int], src: list[torch.Tensor], blocks: int,
    cache_blocks: int,
) -> None:
    """Store ``tokens``' KV from the first ``blocks`` blocks of ``src`` (a cache of ``cache_blocks``),
    load it into a zeroed cache, and check that every token came back exact (each chunk stored)."""
    model = model_for(geometry)
    res = await rt.gateway.store(cap, model, tokens, src, block_ids=list(range(blocks)))
    assert res.stored == res.chunks
    dst = zero_cache(geometry, cache_blocks)
    got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=list(range(blocks)))
    assert got.loaded_tokens == len(tokens)
    assert torch.equal(gathered(src, geometry, range(blocks), len(tokens)), gathered(dst, geometry, range(blocks), len(tokens)))
