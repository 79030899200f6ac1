"""The connector's worker side (gateway/vllm/worker.py) without vLLM, on a real embedded backend
(SQLite registry, memory tier, the backend's own loop thread) and CPU tensors in vLLM's CPU
paged layout: a store loads back bit-exact into other blocks; a ciphertext flipped in the tier
(as an attacker with the tier's credentials would) is a load error from that chunk on, never
scattered into the engine's cache, and the same step's store is cut before it."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
import torch

from gateway.errors import TenantUnavailable
from gateway.types import KVModel
from gateway.vllm.backend import Backend, SharedBackends
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


def _block_first_cache(seed: int) -> dict[str, torch.Tensor]:
    """A GPU layout (block-first, [num_blocks, 2, block_size, heads, head_size]) on the CPU: the
    worker loads it through its compact buffer, as it does a GPU cache."""
    return {name: t.view(NUM_BLOCKS, HEADS, 2, BLOCK, HEAD_SIZE).permute(0, 2, 3, 1, 4).contiguous()
            for name, t in _cpu_cache(seed).items()}


def _untouched(dst: dict[str, torch.Tensor], ids: list[int], before: dict[str, torch.Tensor] | None = None) -> bool:
    before = _cpu_cache(seed=2) if before is None else before
    return all(torch.equal(t[ids], before[name][ids]) for name, t in dst.items())


def _nothing_of_it(dst: dict[str, torch.Tensor], ids: list[int]) -> bool:
    """Each of these blocks is as the engine had it, or zeroed: a chunk that failed
    authentication on a load straight into the cache zeroes the segments it had scattered."""
    before = _cpu_cache(seed=2)
    return all(torch.equal(t[i], before[name][i]) or not t[i].any() for name, t in dst.items() for i in ids)


@pytest.fixture
def backend(tmp_path):
    config = ConnectorConfig.from_extra({"kvgate_settings": {
        "state_dir": str(tmp_path), "tiers": ["memory"], "memory_bytes": 64 << 20, "chunk_tokens": CHUNK,
        "segment_bytes": 4096, "cpu_threads": 1,
    }})
    shared = SharedBackends()
    b = shared.acquire(config)
    try:
        assert shared.acquire(config) is b and shared.users(b) == 2  # one backend per configuration
        shared.release(b)
        assert shared.users(b) == 1 and b.loop.running  # the last user closes it, not the first
        yield b
    finally:
        shared.release(b)
        assert shared.users(b) == 0 and not b.loop.running


def _capability(b: Backend) -> str:
    async def setup() -> str:
        rt = b.runtime  # type: ignore[attr-defined]  # EmbeddedBackend
        await rt.admin.create_tenant("acme")
        cap: str = await rt.gateway.mint_capability("acme", "default", ["lookup", "get", "put"], 600)
        return cap

    return b.loop.call(setup())


def _worker(b: Backend, cache: dict[str, torch.Tensor], tmp_path, layout: str = "cpu") -> WorkerSide:
    w = WorkerSide(b, CHUNK, BLOCK, "tiny", layout=layout, trace=Tracer(str(tmp_path / "trace.jsonl")))
    w.register(cache)
    return w


def _blocks(cache: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t[ids] for t in cache.values()]


def _flip(b: Backend, model: KVModel, chunk: int) -> None:
    async def flip() -> None:
        rt = b.runtime  # type: ignore[attr-defined]
        key = (await rt.gateway.keys_for("acme", "default", model, TOKENS))[chunk]
        for tier in rt.tiers.tiers:
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
    assert writer.wait_stores(30)  # stores are asynchronous: save() only submitted it
    assert writer.model is not None
    if flip_chunk is not None:
        _flip(backend, writer.model, flip_chunk)
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS[:32], dst_ids[:8])])
    # the same step stores the whole prompt (the hit was shorter than its full chunks)
    reader.save([StoreOp("r", cap, TOKENS, dst_ids)])
    assert reader.wait_stores(30)
    return src, dst, src_ids, dst_ids, reader


def test_a_store_loads_back_bit_exact_into_other_blocks(backend, tmp_path):
    src, dst, src_ids, dst_ids, reader = _store_then_load(backend, tmp_path, flip_chunk=None)
    for a, b in zip(_blocks(src, src_ids[:8]), _blocks(dst, dst_ids[:8])):
        assert torch.equal(a, b)
    assert _untouched(dst, dst_ids[8:]) and not _untouched(dst, dst_ids[:8])  # nothing past the load was written
    assert reader.take_load_errors() == set() and reader.stats.failures() == {}
    # what vLLM's metrics get: one load of 32 tokens and one store of the prompt, both ok
    assert reader.stats.take() == {"load/ok": 1, "tokens/loaded": 32, "store/ok": 1, "tokens/stored": len(TOKENS)}
    assert reader.stats.take() == {} and reader.stats.get("load") == 1  # taken once; the totals stay
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("loaded_tokens"), e.get("stored_chunks")) for e in events] == [
        ("store_submit", None, None), ("store", None, 3), ("load", 32, None),
        ("store_submit", None, None), ("store", None, 0),  # the reader's chunks were stored already
    ]


def test_a_flipped_ciphertext_is_a_load_error_and_cuts_the_same_step_store(backend, tmp_path):
    src, dst, src_ids, dst_ids, reader = _store_then_load(backend, tmp_path, flip_chunk=1)
    for a, b in zip(_blocks(src, src_ids[:4]), _blocks(dst, dst_ids[:4])):
        assert torch.equal(a, b)  # chunk 0 authenticated and loaded
    assert _nothing_of_it(dst, dst_ids[4:8]) and not _untouched(dst, dst_ids[4:8])  # loaded in place, then zeroed
    assert _untouched(dst, dst_ids[8:])  # nothing after the tampered chunk reached the cache
    assert reader.take_load_errors() == set(dst_ids[4:8]) and reader.take_load_errors() == set()
    assert reader.stats.failures() == {("load", "integrity"): 1, ("store", "cut_after_failed_load"): 1}
    assert reader.stats.get("load") == 0 and reader.stats.tokens_of("loaded") == 16  # chunk 0 only
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    load = next(e for e in events if e["event"] == "load")
    assert (load["loaded_tokens"], load["failed_blocks"], load["reason"]) == (16, 4, "integrity")
    assert events[-1]["event"] == "store" and events[-1]["tokens"] == 16  # cut before chunk 1
    # the request's mark outlives the step until vLLM reports it finished
    reader.load([])
    assert reader.ledger.store_cut(StoreOp("r", "cap", TOKENS, list(range(12)))) == 16
    reader.finished({"r"})
    assert reader.ledger.store_cut(StoreOp("r", "cap", TOKENS, list(range(12)))) == 48


def test_a_reused_load_buffer_never_scatters_another_loads_bytes(backend, tmp_path):
    """Loads reuse a pooled compact buffer: after a full load of the prompt, a load of the same
    prompt whose chunk 1 fails authentication writes chunk 0 only; the stale (authentic, but
    not authenticated by this load) bytes of chunks 1-2 left in the buffer never reach the cache."""
    cap = _capability(backend)
    src, dst = _block_first_cache(seed=1), _block_first_cache(seed=2)  # a CPU cache loads in place, no buffer
    writer = _worker(backend, src, tmp_path, "block_first")
    src_ids = list(range(3, 15))
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS, src_ids)])
    assert writer.wait_stores(30)
    reader = _worker(backend, dst, tmp_path, "block_first")
    assert reader.blocks is not None and not reader.blocks.native
    first, second = list(range(15, 27)), list(range(20, 32))[::-1]
    reader.load([LoadOp("r1", cap, TOKENS, first)])
    for a, b in zip(_blocks(src, src_ids), _blocks(dst, first)):
        assert torch.equal(a, b)  # positive control: the whole prompt loaded
    assert reader._pool is not None and reader._pool.idle_bytes > 0  # the buffer went back to the pool
    assert writer.model is not None
    _flip(backend, writer.model, 1)
    before = {name: t.clone() for name, t in dst.items()}
    reader.load([LoadOp("r2", cap, TOKENS, second)])
    for a, b in zip(_blocks(src, src_ids[:4]), _blocks(dst, second[:4])):
        assert torch.equal(a, b)  # chunk 0 authenticated and loaded
    assert all(torch.equal(t[second[4:]], before[name][second[4:]]) for name, t in dst.items())
    assert reader.take_load_errors() == set(second[4:])


def test_a_cpu_format_chunk_is_never_read_as_another_format(backend, tmp_path):
    """A CPU cache stores chunks in its own byte order (the CPU chunk format, block size in the
    fingerprint); a worker whose cache is block-first derives another model identity, so the same
    prompt misses there (nothing written), while a CPU worker beside it hits (positive control)."""
    cap = _capability(backend)
    writer = _worker(backend, _cpu_cache(seed=1), tmp_path)
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS, list(range(3, 15)))])
    assert writer.wait_stores(30)
    other = _block_first_cache(seed=2)
    before = {name: t.clone() for name, t in other.items()}
    gpu = _worker(backend, other, tmp_path, "block_first")
    assert writer.model is not None and gpu.model is not None
    assert writer.model.fingerprint_digest != gpu.model.fingerprint_digest
    gpu.load([LoadOp("g", cap, TOKENS, list(range(20, 32)))])
    assert gpu.take_load_errors() == set(range(20, 32)) and _untouched(other, list(range(NUM_BLOCKS)), before)
    cpu = _worker(backend, _cpu_cache(seed=2), tmp_path)
    cpu.load([LoadOp("c", cap, TOKENS, list(range(20, 32)))])
    assert cpu.take_load_errors() == set()


def test_a_partial_last_chunk_is_stored_and_loads_up_to_the_limit(backend, tmp_path):
    """A 44-token prompt (11 blocks: chunks of 16, 16 and a 12-token tail) stores all three
    chunks; a load retrieves all three and fills only the blocks the engine asked for (here 10:
    the last block holds the prompt's last token, which vLLM computes). A load that asks for
    another tail (the 48-token prompt's full third chunk) finds none: blocks past the second
    chunk are load errors, never written."""
    cap = _capability(backend)
    src, dst = _cpu_cache(seed=1), _cpu_cache(seed=2)
    writer = _worker(backend, src, tmp_path)
    src_ids, dst_ids = list(range(3, 15)), list(range(20, 32))
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS[:44], src_ids[:11])])
    assert writer.wait_stores(30)
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS[:44], dst_ids, upto=40)])
    for a, b in zip(_blocks(src, src_ids[:10]), _blocks(dst, dst_ids[:10])):
        assert torch.equal(a, b)  # the tail chunk's first blocks loaded, bit-exact
    assert _untouched(dst, dst_ids[10:])  # the last block (and past it) is the engine's to compute
    assert reader.take_load_errors() == set()
    reader.load([LoadOp("r2", cap, TOKENS, dst_ids, upto=44)])  # the 48-token prompt's third chunk: not stored
    assert reader.take_load_errors() == set(dst_ids[8:11])
    assert _untouched(dst, dst_ids[10:])
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(e["tokens"], e["loaded_tokens"], e["failed_blocks"]) for e in events if e["event"] == "load"] == [
        (40, 40, 0), (44, 32, 3),
    ]


def test_chunks_the_engine_computed_itself_are_neither_fetched_nor_opened(backend, tmp_path):
    """vLLM's own prefix cache held the first 5 blocks (chunk 0 and a block of chunk 1): the load
    opens chunks 1 and 2 only, writes blocks 5.. bit-exact and leaves the engine's blocks 0-4 as
    they were. A tampered chunk 0 cannot fail it (it is not read); a tampered chunk 1 does."""
    cap = _capability(backend)
    src, dst = _cpu_cache(seed=1), _cpu_cache(seed=2)
    writer = _worker(backend, src, tmp_path)
    src_ids, dst_ids = list(range(3, 15)), list(range(20, 32))
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS, src_ids)])
    assert writer.wait_stores(30)
    assert writer.model is not None
    _flip(backend, writer.model, 0)
    metrics = backend.runtime.metrics  # type: ignore[attr-defined]
    before_loaded = metrics.chunks_loaded
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS, dst_ids, skip_blocks=5, upto=44)])
    assert metrics.chunks_loaded - before_loaded == 2  # chunks 1 and 2, not chunk 0
    for a, b in zip(_blocks(src, src_ids[5:11]), _blocks(dst, dst_ids[5:11])):
        assert torch.equal(a, b)
    assert _untouched(dst, dst_ids[:5]) and _untouched(dst, dst_ids[11:])  # the engine's own, and its last block
    assert reader.take_load_errors() == set()
    # positive control of the check above: chunk 1 tampered fails the same load from block 5 on
    _flip(backend, writer.model, 1)
    reader.load([LoadOp("r2", cap, TOKENS, dst_ids, skip_blocks=5, upto=44)])
    assert reader.take_load_errors() == set(dst_ids[5:11])


# -- asynchronous stores ------------------------------------------------------------------------
class _GatedLoop:
    """The backend's loop, with a shorter timeout for submitted stores (when given)."""

    def __init__(self, loop, store_timeout_s: float | None) -> None:
        self._loop, self._timeout = loop, store_timeout_s
        self.timeout_s, self.settle_s = loop.timeout_s, loop.settle_s

    def call(self, coro, timeout=None):
        return self._loop.call(coro, timeout)

    def submit(self, coro, timeout=None):
        return self._loop.submit(coro, self._timeout if self._timeout is not None else timeout)


class GatedBackend:
    """The real embedded backend whose stores wait for ``gate`` (a slow tier, as the engine would
    meet it), then run, or raise ``fail``; everything else goes straight through."""

    def __init__(self, inner: Backend, fail: Exception | None = None, store_timeout_s: float | None = None) -> None:
        self.inner, self.fail = inner, fail
        self.chunk_tokens = inner.chunk_tokens
        self.layerwise = False  # these tests hold stores up; loads go whole, as a synchronous call
        self.loop = _GatedLoop(inner.loop, store_timeout_s)
        self.gate = threading.Event()
        self.started = 0
        self.prepared: list[str] = []

    async def lookup(self, cap, model, tokens):
        return await self.inner.lookup(cap, model, tokens)

    async def retrieve(self, cap, model, tokens, layers, block_ids, first_chunk=0, write_upto=None):
        return await self.inner.retrieve(cap, model, tokens, layers, block_ids, first_chunk, write_upto)

    def prepare(self, cap):
        self.prepared.append(cap)
        self.inner.prepare(cap)

    def copies_behind(self):
        return self.inner.copies_behind()

    def counters(self):
        return self.inner.counters()

    async def copies_written(self):
        await self.inner.copies_written()

    async def store(self, cap, model, tokens, layers, block_ids, first_chunk=0):
        self.started += 1
        await asyncio.to_thread(self.gate.wait, 30)
        if self.fail is not None:
            raise self.fail
        return await self.inner.store(cap, model, tokens, layers, block_ids, first_chunk)


def _events(tmp_path) -> list[dict]:
    path = tmp_path / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _gated_worker(gated: GatedBackend, cache: dict[str, torch.Tensor], tmp_path, **kw) -> WorkerSide:
    w = WorkerSide(gated, CHUNK, BLOCK, "tiny", layout="cpu", trace=Tracer(str(tmp_path / "trace.jsonl")), **kw)
    w.register(cache)
    return w


def test_a_store_is_submitted_without_waiting_and_seals_the_kv_as_it_was_at_submit(backend, tmp_path):
    """wait_for_save returns while the store is still held up; the engine then reuses the blocks
    for another request (overwrites them) before the store runs: what is stored, and loads back,
    is the KV of the request that stored it, never what the blocks hold later."""
    cap = _capability(backend)
    gated = GatedBackend(backend)
    src, dst = _cpu_cache(seed=1), _cpu_cache(seed=2)
    original = {name: t.clone() for name, t in src.items()}
    writer = _gated_worker(gated, src, tmp_path)
    src_ids, dst_ids = list(range(3, 15)), list(range(20, 32))
    writer.save([StoreOp("w", cap, TOKENS, src_ids)])
    assert len(writer.in_flight) == 1 and not writer.wait_stores(0.2)  # still held up: save() did not wait
    assert [e["event"] for e in _events(tmp_path)] == ["store_submit"]
    for t in src.values():  # the blocks, freed, now hold another request's KV
        t[src_ids] = torch.randn_like(t[src_ids])
    gated.gate.set()
    assert writer.wait_stores(30) and len(writer.in_flight) == 0 and writer.in_flight.nbytes == 0
    assert [(e["event"], e.get("stored_chunks")) for e in _events(tmp_path)] == [("store_submit", None), ("store", 3)]
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS, dst_ids)])
    assert reader.take_load_errors() == set()
    for a, b in zip(_blocks(original, src_ids), _blocks(dst, dst_ids)):
        assert torch.equal(a, b)  # the KV at submit time
    for a, b in zip(_blocks(src, src_ids), _blocks(dst, dst_ids)):
        assert not torch.equal(a, b)  # not what the reused blocks hold now


def test_a_step_that_ends_in_stores_gets_the_backend_ready_for_each_capability_before_its_forward(backend, tmp_path):
    cap = _capability(backend)
    gated = GatedBackend(backend)
    w = _gated_worker(gated, _cpu_cache(seed=1), tmp_path)
    w.forward_begins()  # the control: a step with no store asks for nothing
    w.save([])
    assert gated.prepared == []
    w.forward_begins([StoreOp("a", cap, TOKENS, list(range(3, 15))), StoreOp("b", cap, TOKENS, list(range(20, 32)))])
    assert gated.prepared == [cap] and gated.started == 0  # once per capability, before any store
    w.save([])


def test_a_store_past_the_in_flight_cap_is_dropped_and_counted(backend, tmp_path, caplog):
    cap = _capability(backend)
    gated = GatedBackend(backend)
    writer = _gated_worker(gated, _cpu_cache(seed=1), tmp_path, max_in_flight_bytes=1)
    other = list(range(900, 948))
    with caplog.at_level(logging.DEBUG, logger="kvgate.vllm"):
        writer.save([StoreOp("a", cap, TOKENS, list(range(3, 15)))])  # none in flight: admitted past the cap
        writer.save([StoreOp("b", cap, other, list(range(15, 27)))])  # dropped, not waited for
    assert writer.stats.failures() == {("store", "dropped_in_flight"): 1} and len(writer.in_flight) == 1
    assert "kvgate store for b dropped" in caplog.text
    gated.gate.set()
    assert writer.wait_stores(30)
    assert [(e["event"], e["req"]) for e in _events(tmp_path)] == [
        ("store_submit", "a"), ("store_dropped", "b"), ("store", "a"),
    ]
    assert writer.model is not None
    assert backend.loop.call(backend.lookup(cap, writer.model, TOKENS)).hit_tokens == 48
    assert backend.loop.call(backend.lookup(cap, writer.model, other)).hit_tokens == 0
    # the cap is on what is in flight: with "a" ended, "b" is admitted again
    writer.save([StoreOp("b", cap, other, list(range(15, 27)))])
    assert writer.wait_stores(30) and writer.stats.failures() == {("store", "dropped_in_flight"): 1}
    assert backend.loop.call(backend.lookup(cap, writer.model, other)).hit_tokens == 48


def test_a_store_past_the_cap_waits_for_room_and_is_stored(backend, tmp_path):
    """The step's end waits while the store in flight ends (here: its tier lets it go after a
    moment), then submits the next: both stored, nothing dropped."""
    cap = _capability(backend)
    gated = GatedBackend(backend)
    writer = _gated_worker(gated, _cpu_cache(seed=1), tmp_path, max_in_flight_bytes=1, store_wait_s=30)
    other = list(range(900, 948))
    writer.save([StoreOp("a", cap, TOKENS, list(range(3, 15)))])  # none in flight: admitted past the cap
    threading.Timer(0.3, gated.gate.set).start()
    t0 = time.monotonic()
    writer.save([StoreOp("b", cap, other, list(range(15, 27)))])  # waits for "a" to end
    waited = time.monotonic() - t0
    assert 0.2 < waited < 25 and writer.stats.failures() == {}
    assert writer.wait_stores(30) and writer.model is not None
    events = [(e["event"], e["req"], e.get("admitted")) for e in _events(tmp_path)]
    assert events == [("store_submit", "a", None), ("store", "a", None), ("store_wait", "b", True),
                      ("store_submit", "b", None), ("store", "b", None)]
    for tokens in (TOKENS, other):
        assert backend.loop.call(backend.lookup(cap, writer.model, tokens)).hit_tokens == 48


def test_a_wait_that_finds_no_room_drops_and_the_next_stores_drop_without_waiting(backend, tmp_path):
    """A tier that holds every store: one bounded wait, then drops at once (the engine is not held
    up again) until a store fits, which then waits again when it must."""
    cap = _capability(backend)
    gated = GatedBackend(backend)
    writer = _gated_worker(gated, _cpu_cache(seed=1), tmp_path, max_in_flight_bytes=1, store_wait_s=0.3)
    writer.save([StoreOp("a", cap, TOKENS, list(range(3, 15)))])
    t0 = time.monotonic()
    writer.save([StoreOp("b", cap, list(range(900, 948)), list(range(15, 27)))])  # waits 0.3 s, dropped
    writer.save([StoreOp("c", cap, list(range(700, 748)), list(range(15, 27)))])  # dropped at once
    assert 0.25 < time.monotonic() - t0 < 5
    assert writer.stats.failures() == {("store", "dropped_in_flight"): 2}
    assert [e["req"] for e in _events(tmp_path) if e["event"] == "store_wait"] == ["b"]
    gated.gate.set()
    assert writer.wait_stores(30)
    writer.save([StoreOp("c", cap, list(range(700, 748)), list(range(15, 27)))])  # fits: admitted
    writer.save([StoreOp("d", cap, list(range(600, 648)), list(range(3, 15)))])  # waits again, fits
    assert writer.wait_stores(30) and writer.stats.failures() == {("store", "dropped_in_flight"): 2}
    assert [(e["req"], e["admitted"]) for e in _events(tmp_path) if e["event"] == "store_wait"] == [
        ("b", False), ("d", True),
    ]


def test_a_store_seals_only_the_chunks_after_those_its_lookup_found(backend, tmp_path):
    """``skip_tokens``: the leading chunks are stored already; their blocks are neither gathered
    nor sealed (here they hold other KV, which never reaches the tier), the rest chain onto them."""
    cap = _capability(backend)
    src, dst = _cpu_cache(seed=1), _cpu_cache(seed=2)
    original = {name: t.clone() for name, t in src.items()}
    writer = _worker(backend, src, tmp_path)
    ids = list(range(3, 15))
    writer.save([StoreOp("w", cap, TOKENS[:CHUNK], ids[: CHUNK // BLOCK])])  # the first chunk, stored
    assert writer.wait_stores(30)
    for t in src.values():  # the first chunk's blocks now hold other KV
        t[ids[: CHUNK // BLOCK]] = torch.randn_like(t[ids[: CHUNK // BLOCK]])
    writer.save([StoreOp("x", cap, TOKENS, ids, skip_tokens=CHUNK)])
    assert writer.wait_stores(30)
    ends = [e for e in _events(tmp_path) if e["event"] == "store"]
    assert [e["stored_chunks"] for e in ends] == [1, 2]
    submits = [e["in_flight_bytes"] for e in _events(tmp_path) if e["event"] == "store_submit"]
    assert submits[1] < 3 * submits[0]  # eight blocks gathered (pooled), not twelve
    reader = _worker(backend, dst, tmp_path)
    reader.load([LoadOp("r", cap, TOKENS, list(range(20, 32)))])
    assert reader.take_load_errors() == set()
    for a, b in zip(_blocks(original, ids), _blocks(dst, list(range(20, 32)))):
        assert torch.equal(a, b)  # chunk 0 as first stored, chunks 1 and 2 from the second store
    # control: with nothing stored before it, what is skipped is missing, so nothing after it hits
    writer.save([StoreOp("y", cap, list(range(800, 848)), ids, skip_tokens=CHUNK)])
    assert writer.wait_stores(30) and writer.model is not None
    assert backend.loop.call(backend.lookup(cap, writer.model, list(range(800, 848)))).hit_tokens == 0
    writer.save([StoreOp("z", cap, TOKENS, ids, skip_tokens=48)])  # every chunk found: nothing gathered
    assert writer.wait_stores(30)
    last = _events(tmp_path)[-1]
    # nothing submitted: a store of 0 tokens, which trace readers (wait_for_stores) count as no store
    assert (last["event"], last["req"], last["tokens"]) == ("store", "z", 0)


def test_a_failing_store_ends_counted_and_frees_its_place(backend, tmp_path):
    cap = _capability(backend)
    gated = GatedBackend(backend, fail=TenantUnavailable("acme is disabled"))
    one_store = 16 * LAYERS * HEADS * BLOCK * 2 * HEAD_SIZE * 4  # 12 blocks, pooled as 16
    writer = _gated_worker(gated, _cpu_cache(seed=1), tmp_path, max_in_flight_bytes=one_store)
    writer.save([StoreOp("a", cap, TOKENS, list(range(3, 15)))])
    writer.save([StoreOp("b", cap, TOKENS, list(range(3, 15)))])  # control: "a" holds the place
    assert writer.stats.failures() == {("store", "dropped_in_flight"): 1}
    gated.gate.set()
    assert writer.wait_stores(30) and writer.in_flight.nbytes == 0
    assert writer.stats.failures() == {("store", "dropped_in_flight"): 1, ("store", "tenant_unavailable"): 1}
    assert [(e["event"], e.get("reason")) for e in _events(tmp_path)][-1] == ("store", "tenant_unavailable")
    assert writer._pool is not None and writer._pool.idle_bytes > 0  # its buffer serves the next store
    writer.save([StoreOp("b", cap, TOKENS, list(range(3, 15)))])  # admitted: nothing in flight any more
    assert writer.wait_stores(30)
    assert writer.stats.failures() == {("store", "dropped_in_flight"): 1, ("store", "tenant_unavailable"): 2}


def test_a_timed_out_store_never_lends_its_buffer_again(backend, tmp_path):
    """A store cut off by its timeout may still have a seal job reading its buffer: the buffer
    is dropped, not pooled, so the next gather cannot overwrite KV that is being sealed."""
    cap = _capability(backend)
    gated = GatedBackend(backend, store_timeout_s=0.2)
    writer = _gated_worker(gated, _cpu_cache(seed=1), tmp_path)
    try:
        writer.save([StoreOp("a", cap, TOKENS, list(range(3, 15)))])
        assert writer.wait_stores(30)
        assert writer.stats.failures() == {("store", "gateway_timeout"): 1}
        assert writer._pool is not None and writer._pool.idle_bytes == 0
    finally:
        gated.gate.set()
    # positive control: a store that ends in time gives its buffer back
    writer.save([StoreOp("b", cap, TOKENS, list(range(3, 15)))])
    assert writer.wait_stores(30) and writer._pool.idle_bytes > 0


def test_the_trace_says_when_write_behind_copies_are_in_and_wait_for_stores_waits_for_them(tmp_path):
    """With a memory and a disk tier written behind (the default), a store ends when the memory
    tier has it, but the scheduler's process sees it only in the shared tier. The trace marks the
    store ``copies_behind`` and adds ``store_copies`` once the slower tiers hold it;
    ``wait_for_stores`` (the engine tests' and bench-e2e's settle) waits for that line: held
    back (the copies gated), it times out; let go, it returns. The memory-only worker's store
    (the control, every other test here) has no such line to wait for."""
    from gateway.vllm.logs import wait_for_stores

    config = ConnectorConfig.from_extra({"kvgate_settings": {
        "state_dir": str(tmp_path), "tiers": ["memory", "disk"], "memory_bytes": 64 << 20, "chunk_tokens": CHUNK,
        "segment_bytes": 4096, "cpu_threads": 1,
    }})
    shared = SharedBackends()
    b = shared.acquire(config)
    try:
        cap = _capability(b)
        gated = GatedBackend(b)
        gated.gate.set()  # stores run at once; the copies wait below
        copies = threading.Event()
        inner = gated.copies_written

        async def held() -> None:
            await asyncio.to_thread(copies.wait, 30)
            await inner()

        gated.copies_written = held
        w = _gated_worker(gated, _cpu_cache(seed=5), tmp_path)
        w.save([StoreOp("w", cap, TOKENS, list(range(3, 15)))])
        assert w.wait_stores(30)
        trace = str(tmp_path / "trace.jsonl")
        with pytest.raises(TimeoutError):
            wait_for_stores(trace, timeout_s=0.5)
        store = [e for e in _events(tmp_path) if e["event"] == "store"]
        assert [(e["stored_chunks"], e["copies_behind"]) for e in store] == [(3, True)]
        copies.set()
        assert wait_for_stores(trace, timeout_s=30) < 30
        assert [e["event"] for e in _events(tmp_path)] == ["store_submit", "store", "store_copies"]
        async def on_disk() -> int:
            return len(await b.runtime.tiers.tier("disk").list_keys())

        assert b.loop.call(on_disk()) == 3  # the disk holds the three chunks when the line says so
    finally:
        shared.release(b)


# -- layer-wise loads -------------------------------------------------------------------------


def _stored(backend: Backend, tmp_path) -> tuple[str, dict[str, torch.Tensor], list[int]]:
    cap = _capability(backend)
    src = _cpu_cache(seed=1)
    writer = _worker(backend, src, tmp_path)
    src_ids = list(range(3, 15))
    writer.load([])
    writer.save([StoreOp("w", cap, TOKENS, src_ids)])
    assert writer.wait_stores(30)
    return cap, src, src_ids


def _step(worker: WorkerSide, loads: list[LoadOp], layers: list[str], forward=None) -> set[int]:
    """One engine step: start_load_kv, the forward asking for ``layers`` in order (``forward``
    runs at each, as the attention would), then the step's last hooks."""
    worker.load(loads)
    for name in layers:
        worker.wait_for_layer(name)
        if forward is not None:
            forward(name)
    worker.save([])
    worker.finished([])
    return worker.take_load_errors()


def test_a_layer_wise_load_is_in_place_at_each_layer_the_forward_reaches(backend, tmp_path):
    cap, src, src_ids = _stored(backend, tmp_path)
    dst = _cpu_cache(seed=2)
    reader = _worker(backend, dst, tmp_path)
    names = list(dst)
    dst_ids = list(range(20, 32))
    assert _step(reader, [], names) == set()  # a step without loads: the hook shows it is called
    seen: list[str] = []

    def attention(name: str) -> None:  # the layer the forward reads now holds the stored KV
        assert torch.equal(dst[name][dst_ids[:8]], src[name][src_ids[:8]])
        seen.append(name)

    assert _step(reader, [LoadOp("r", cap, TOKENS[:32], dst_ids[:8])], names, attention) == set()
    assert seen == names and _untouched(dst, dst_ids[8:])
    loads = [e for e in _events(tmp_path) if e["event"] == "load"]
    assert loads[-1]["layerwise"] is True and loads[-1]["loaded_tokens"] == 32
    # its lead (until its first layer was in place, every chunk fetched) is part of its time
    assert 0 < loads[-1]["lead_ms"] <= loads[-1]["ms"]
    waits = [e for e in _events(tmp_path) if e["event"] == "layer_wait"]
    assert waits[-1]["hooks_complete"] is True and waits[-1]["loads"] == 1


def test_the_first_load_is_whole_and_a_step_that_skips_a_layer_loses_its_layer_wise_blocks(backend, tmp_path):
    cap, src, src_ids = _stored(backend, tmp_path)
    dst = _cpu_cache(seed=2)
    reader = _worker(backend, dst, tmp_path)
    names = list(dst)
    dst_ids = list(range(20, 32))
    # no step has shown the hook yet: the load is whole, in start_load_kv (the control)
    assert _step(reader, [LoadOp("r0", cap, TOKENS[:32], dst_ids[:8])], names) == set()
    whole = [e for e in _events(tmp_path) if e["event"] == "load"][-1]
    assert "layerwise" not in whole and whole["lead_ms"] == whole["ms"]  # all of it before the forward
    # now layer-wise; a forward that skips the last layer's hook may have read it before it was
    # in place: every block of the load is a load error (vLLM recomputes them)
    errors = _step(reader, [LoadOp("r1", cap, TOKENS[:32], dst_ids[:8])], names[:-1])
    assert errors == set(dst_ids[:8]) and reader.stats.get("load", "layer_hooks_missed") == 1
    last = [e for e in _events(tmp_path) if e["event"] == "load"][-1]
    assert last["layerwise"] is True and last["reason"] == "layer_hooks_missed" and last["loaded_tokens"] == 0


def test_a_tampered_chunk_in_a_layer_wise_load_ends_the_prefix_there(backend, tmp_path):
    cap, src, src_ids = _stored(backend, tmp_path)
    dst = _cpu_cache(seed=2)
    reader = _worker(backend, dst, tmp_path)
    assert reader.model is not None
    _flip(backend, reader.model, 1)
    names, dst_ids = list(dst), list(range(20, 32))
    _step(reader, [], names)
    errors = _step(reader, [LoadOp("r", cap, TOKENS, dst_ids)], names)
    assert errors == set(dst_ids[4:])  # chunk 1 on
    for a, b in zip(_blocks(src, src_ids[:4]), _blocks(dst, dst_ids[:4])):
        assert torch.equal(a, b)  # chunk 0 loaded
    assert _nothing_of_it(dst, dst_ids[4:])  # chunk 1 and chunk 2 (whose first layers had landed) left nothing
    last = [e for e in _events(tmp_path) if e["event"] == "load"][-1]
    assert last["layerwise"] is True and last["integrity_failures"] == 1 and last["loaded_tokens"] == 16
