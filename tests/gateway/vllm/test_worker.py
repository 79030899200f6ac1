"""The connector's worker side (gateway/vllm/worker.py) without vLLM, on a real embedded backend
(SQLite registry, memory tier, the backend's own loop thread) and CPU tensors in vLLM's CPU
paged layout: a store loads back bit-exact into other blocks; a ciphertext flipped in the tier
(as an attacker with the tier's credentials would) is a load error from that chunk on, never
scattered into the engine's cache, and the same step's store is cut before it."""

from __future__ import annotations

import json

import pytest
import torch

from gateway.types import KVModel
from gateway.vllm.backend import Backend, backend_for, release
from gateway.vllm.config import ConnectorConfig
from gateway.vllm.ledger import LoadOp, StoreOp
from gateway.vllm.logs import Tracer
from gateway.vllm.worker import WorkerSide
from storage.types import ChunkNotFound

CHUNK, BLOCK, HEADS, HEAD_SIZE, LAYERS, NUM_BLOCKS = 16, 4, 2, 8, 3, 32
TOKENS = list(range(500, 548))  # 3 chunks, 12 blocks


def _cpu_cache(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: [num_blocks, heads, block_size, 2 * head_size] per layer."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen) for i in range(LAYERS)}


def _untouched(dst: dict[str, torch.Tensor], ids: list[int]) -> bool:
    before = _cpu_cache(seed=2)
    return all(torch.equal(t[ids], before[name][ids]) for name, t in dst.items())


@pytest.fixture
def backend(tmp_path):
    config = ConnectorConfig.from_extra({"kvgate_settings": {
        "state_dir": str(tmp_path), "tiers": ["memory"], "memory_bytes": 64 << 20, "chunk_tokens": CHUNK,
        "segment_bytes": 4096, "cpu_threads": 1,
    }})
    b = backend_for(config)
    try:
        assert backend_for(config) is b  # one backend per configuration and process
        release(b)
        yield b
    finally:
        release(b)


def _capability(b: Backend) -> str:
    async def setup() -> str:
        rt = b.runtime  # type: ignore[attr-defined]  # EmbeddedBackend
        await rt.admin.create_tenant("acme")
        cap: str = await rt.gateway.mint_capability("acme", "default", ["lookup", "get", "put"], 600)
        return cap

    return b.loop.call(setup())


def _worker(b: Backend, cache: dict[str, torch.Tensor], tmp_path) -> WorkerSide:
    w = WorkerSide(b, CHUNK, BLOCK, "tiny", layout="cpu", trace=Tracer(str(tmp_path / "trace.jsonl")))
    w.register(cache)
    return w


def _blocks(cache: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t[ids] for t in cache.values()]


def _flip(b: Backend, model: KVModel, chunk: int) -> None:
    async def flip() -> None:
        rt = b.runtime  # type: ignore[attr-defined]
        key = (await rt.gateway.keys_for("acme", "default", model, TOKENS))[chunk]
        for tier in rt.gateway.tiers.tiers:
            try:
                raw = bytearray((await tier.get(key)).data)
            except ChunkNotFound:
                continue
            raw[-20] ^= 0x80
            await tier.put(key, raw)

    b.loop.call(flip())


def _store_then_load(backend: Backend, tmp_path, flip_chunk: int | None):
    cap = _capability(backend)
    src, dst = _cpu_cache(seed=1), _cpu_cache(seed=2)  # dst: the engine's own (other) KV
    writer = _worker(backend, src, tmp_path)
    src_ids, dst_ids = list(range(3, 15)), list(range(20, 32))
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS, src_ids)])
    assert writer.model is not None
    if flip_chunk is not None:
        _flip(backend, writer.model, flip_chunk)
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS[:32], dst_ids[:8])])
    # the same step stores the whole prompt (the hit was shorter than its full chunks)
    reader.save([StoreOp("r", cap, TOKENS, dst_ids)])
    return src, dst, src_ids, dst_ids, reader


def test_a_store_loads_back_bit_exact_into_other_blocks(backend, tmp_path):
    src, dst, src_ids, dst_ids, reader = _store_then_load(backend, tmp_path, flip_chunk=None)
    for a, b in zip(_blocks(src, src_ids[:8]), _blocks(dst, dst_ids[:8])):
        assert torch.equal(a, b)
    assert _untouched(dst, dst_ids[8:]) and not _untouched(dst, dst_ids[:8])  # nothing past the load was written
    assert reader.take_load_errors() == set() and reader.stats == {}
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("loaded_tokens"), e.get("stored_chunks")) for e in events] == [
        ("store", None, 3), ("load", 32, None), ("store", None, 0),  # the reader's chunks were stored already
    ]


def test_a_flipped_ciphertext_is_a_load_error_and_cuts_the_same_step_store(backend, tmp_path):
    src, dst, src_ids, dst_ids, reader = _store_then_load(backend, tmp_path, flip_chunk=1)
    for a, b in zip(_blocks(src, src_ids[:4]), _blocks(dst, dst_ids[:4])):
        assert torch.equal(a, b)  # chunk 0 authenticated and loaded
    assert _untouched(dst, dst_ids[4:])  # nothing of the tampered chunk (or after it) reached the cache
    assert reader.take_load_errors() == set(dst_ids[4:8]) and reader.take_load_errors() == set()
    assert reader.stats == {"load_integrity": 1, "store_cut_after_failed_load": 1}
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    load = next(e for e in events if e["event"] == "load")
    assert (load["loaded_tokens"], load["failed_blocks"], load["reason"]) == (16, 4, "integrity")
    assert events[-1]["event"] == "store" and events[-1]["tokens"] == 16  # cut before chunk 1
    # the request's mark outlives the step until vLLM reports it finished
    reader.load([])
    assert reader.ledger.store_cut(StoreOp("r", "cap", TOKENS, list(range(12)))) == 16
    reader.finished({"r"})
    assert reader.ledger.store_cut(StoreOp("r", "cap", TOKENS, list(range(12)))) == 48
