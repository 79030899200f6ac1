"""Layer-wise loads: ``ChunkCipher.iter_segments`` (crypto), ``CpuSealer`` opening a batch layer
by layer across its chunks, ``DataPlane.retrieve(on_layers=)`` through the embedded gateway, and
the connector's ``LayerLoads`` (the waits of the engine's forward).

What must hold: a layer is said to be in place only once it is, in every chunk still loading,
and authentic; the end result is the same bytes as a whole-chunk load; a tampered segment ends
the prefix at its chunk, and neither it nor any chunk after it leaves a byte in the cache, and
no plaintext is left in the scratch."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from crypto.envelope import HEADER_BYTES, ChunkCipher, DataKey, EnvelopeContext, read_header
from crypto.errors import DecryptionFailed
from gateway.bench.plaintext import PlaintextCodec
from gateway.datapath import DataPath, OpenJob, SealJob
from gateway.vllm.layers import LayerLoads
from gateway.vllm.ledger import LoadOp
from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import pack, slots_from_block_ids
from kernels.paged import PagedKV
from tests.gateway.datapath.test_fused_path import _cache, _raw

DEK = bytes(range(32))
SECRET = b"namespace-binding-secret-0123456"
CTX = EnvelopeContext("tenant-a", "ns-1", "ab" * 32, "model/fp16/tp0", 3)
G = KVGeometry(6, 2, 16, torch.float16, 4, KVLayout.CPU)  # a layer of a 4-token block: 512 B


def _layer_bytes(layers: list[torch.Tensor], g: KVGeometry, slots: torch.Tensor, layer: int) -> bytes:
    """Layer ``layer`` of the chunk at ``slots``, in the chunk format (a chunk is layer after layer)."""
    n = 2 * slots.numel() * g.num_kv_heads * g.head_size * g.dtype.itemsize
    return _raw(pack(PagedKV(layers, g), slots, g))[layer * n : (layer + 1) * n]


def _setup(seg: int, chunks: int = 3, codec: object | None = None):
    src = _cache(G, 16, 7)
    blocks = [9, 2, 3, 14, 0, 7, 5, 11, 1, 4, 6, 8][: chunks * 2] + [15]  # two blocks a chunk, and a partial one
    slots = slots_from_block_ids(blocks, 4, 0, chunks * 8 + 2)
    per = [slots[i * 8 : (i + 1) * 8] for i in range(chunks)] + [slots[chunks * 8 :]]
    dp = DataPath(codec or ChunkCipher(segment_bytes=seg), threads=0)
    envs = dp.seal_batch(PagedKV(src, G), [SealJob(s, DataKey(DEK, SECRET), CTX) for s in per])
    return src, per, dp, [bytearray(e) for e in envs]


def _jobs(per, envs):
    return [OpenJob(memoryview(e), s, DataKey(DEK, SECRET), CTX) for e, s in zip(envs, per, strict=True)]


# -- crypto -----------------------------------------------------------------------------------


def test_iter_segments_is_open_segments_step_by_step_and_a_bad_tag_wipes_the_scratch():
    cipher = ChunkCipher(segment_bytes=100)
    data = os.urandom(380)
    env = bytearray(cipher.seal(DataKey(DEK, SECRET), CTX, data))
    scratch = bytearray(100)
    got = b"".join(bytes(v) for _a, _b, v in cipher.iter_segments(DataKey(DEK, SECRET), CTX, env, scratch))
    assert got == data  # the control
    env[HEADER_BYTES + 2 * 116 + 3] ^= 1  # segment 2 of 4
    steps = cipher.iter_segments(DataKey(DEK, SECRET), CTX, env, scratch)
    assert [a for a, _b, _v in [next(steps), next(steps)]] == [0, 100]
    with pytest.raises(DecryptionFailed):
        next(steps)
    assert scratch == bytearray(100)
    # closed before its end (a batch that ended at another chunk): no plaintext left either
    env[HEADER_BYTES + 2 * 116 + 3] ^= 1
    steps = cipher.iter_segments(DataKey(DEK, SECRET), CTX, env, scratch)
    next(steps)
    assert scratch != bytearray(100)
    steps.close()
    assert scratch == bytearray(100)
    # another key version fails at the call; another tenant's context at the first tag, with
    # nothing delivered
    with pytest.raises(DecryptionFailed):
        cipher.iter_segments(DataKey(DEK, SECRET), EnvelopeContext("tenant-a", "ns-1", "ab" * 32, "model/fp16/tp0", 4), env, scratch)
    other = cipher.iter_segments(DataKey(DEK, SECRET), EnvelopeContext("tenant-b", "ns-1", "ab" * 32, "model/fp16/tp0", 3), env, scratch)
    with pytest.raises(DecryptionFailed):
        next(other)
    assert scratch == bytearray(100)


# -- the CPU sealer, layer by layer -----------------------------------------------------------


@pytest.mark.parametrize("seg", [512, 1024, 3 * 512, 1 << 20])
@pytest.mark.parametrize("plain", [False, True])
def test_a_batch_opens_layer_by_layer_and_each_layer_said_is_in_place(seg, plain):
    src, per, dp, envs = _setup(seg, codec=PlaintextCodec(seg) if plain else None)
    dst = [torch.zeros_like(x) for x in src]
    said: list[int] = []

    def on_layers(n: int) -> None:
        for layer in range(n):  # every layer said is in place in every chunk, right now
            for s in per:
                assert _layer_bytes(dst, G, s, layer) == _layer_bytes(src, G, s, layer)
        said.append(n)

    assert dp.open_batch(PagedKV(dst, G), _jobs(per, envs), on_layers) == (len(per), False)
    assert said == list(range(1, G.num_layers + 1))
    whole = [torch.zeros_like(x) for x in src]  # the control: a whole-chunk load, same bytes
    assert dp.open_batch(PagedKV(whole, G), _jobs(per, envs)) == (len(per), False)
    assert all(_raw(a) == _raw(b) for a, b in zip(dst, whole, strict=True))


@pytest.mark.parametrize("bad_chunk", [0, 1, 3])
@pytest.mark.parametrize("bad_segment", [0, 1, 2])
def test_a_tampered_segment_ends_the_prefix_and_nothing_of_it_or_after_it_stays(bad_chunk, bad_segment):
    src, per, dp, envs = _setup(1024)  # two layers a segment: three segments a chunk
    header = read_header(envs[bad_chunk])
    if bad_segment >= header.segment_count:
        bad_segment = header.segment_count - 1
    envs[bad_chunk][HEADER_BYTES + bad_segment * (header.segment_bytes + 16) + 1] ^= 1
    dst = [torch.zeros_like(x) for x in src]
    said: list[int] = []
    assert dp.open_batch(PagedKV(dst, G), _jobs(per, envs), said.append) == (bad_chunk, True)
    assert said == list(range(1, G.num_layers + 1))  # the chunks before it went on to the end
    for i, s in enumerate(per):
        for layer in range(G.num_layers):
            got = _layer_bytes(dst, G, s, layer)
            if i < bad_chunk:
                assert got == _layer_bytes(src, G, s, layer)
            else:  # the bad chunk, and the ones after it whose first layers had landed
                assert got == bytes(len(got))
    scratch = dp.pool.scratch(1)
    assert not any(scratch)  # no plaintext left in it


@pytest.mark.parametrize("bad_chunk", [0, 2])
@pytest.mark.parametrize("bad_segment", [0, 2])
def test_a_tampered_segment_is_never_in_the_cache_when_a_layer_is_said(bad_chunk, bad_segment):
    """A segment is decrypted in place before its tag is known; the engine may read a layer only
    once it is said. An attacker flips one bit, so the rest of the segment decrypts to real KV:
    at every ``on_layers`` call (and after), the bad segment's layers hold only the sentinel the
    cache held before or zeros, never that KV. The chunks before it are the control; after the
    load, nothing of the bad chunk is left at any layer."""
    src, per, dp, envs = _setup(1024)
    header = read_header(envs[bad_chunk])
    envs[bad_chunk][HEADER_BYTES + bad_segment * (header.segment_bytes + 16) + 1] ^= 1
    dst = [torch.full_like(x.view(torch.uint8), 0x5A).view(x.dtype) for x in src]
    per_segment = header.segment_bytes * G.num_layers // header.plaintext_length
    bad_layers = range(bad_segment * per_segment, (bad_segment + 1) * per_segment)
    layers = range(G.num_layers)
    seen: list[bytes] = []

    def said(n: int) -> None:
        seen.extend(_layer_bytes(dst, G, per[bad_chunk], layer) for layer in bad_layers)

    assert dp.open_batch(PagedKV(dst, G), _jobs(per, envs), said) == (bad_chunk, True)
    assert len(seen) == G.num_layers * len(bad_layers)
    for got in seen:
        assert set(got) <= {0, 0x5A}
    assert all(set(_layer_bytes(dst, G, per[bad_chunk], layer)) <= {0, 0x5A} for layer in layers)
    for i in range(bad_chunk):
        assert all(_layer_bytes(dst, G, per[i], layer) == _layer_bytes(src, G, per[i], layer) for layer in layers)


# -- through the embedded gateway -------------------------------------------------------------


async def test_retrieve_on_layers_through_the_gateway_matches_a_whole_load(tmp_path):
    from gateway.config import Settings
    from gateway.services import dbschema
    from gateway.services.runtime import open_embedded
    from gateway.types import KVModel

    url = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    await asyncio.to_thread(dbschema.upgrade, url)
    g = KVGeometry(6, 2, 16, torch.float16, 4, KVLayout.KV_FIRST)
    model = KVModel("layered", g)
    rt = await open_embedded(Settings(state_dir=tmp_path, database_url=url, chunk_tokens=8, cpu_threads=2, tiers=["memory"]))
    try:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ["put", "get", "lookup"], 600)
        src = _cache(g, 16, 9)
        blocks, tokens = [9, 2, 3, 14, 0, 7, 5, 11, 1], list(range(100, 134))
        assert (await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)).stored == 5
        seen: list[tuple[int, str]] = []
        dst = [torch.zeros_like(x) for x in src]
        res = await rt.gateway.retrieve(
            cap, model, tokens, dst, block_ids=blocks, on_layers=lambda n: seen.append((n, threading.current_thread().name))
        )
        assert res.loaded_tokens == 34
        said = [n for n, _ in seen]
        assert said == sorted(set(said)) and said[-1] == g.num_layers  # in order, to the last layer
        whole = [torch.zeros_like(x) for x in src]
        assert (await rt.gateway.retrieve(cap, model, tokens, whole, block_ids=blocks)).loaded_tokens == 34
        assert all(_raw(a) == _raw(b) for a, b in zip(dst, whole, strict=True))
        # another tenant's capability loads nothing, and is still told every layer (it ended)
        await rt.admin.create_tenant("globex")
        other = await rt.gateway.mint_capability("globex", "default", ["get"], 600)
        seen.clear()
        none = [torch.zeros_like(x) for x in src]
        assert (await rt.gateway.retrieve(other, model, tokens, none, block_ids=blocks, on_layers=lambda n: seen.append((n, "")))).loaded_tokens == 0
        assert [n for n, _ in seen] == [g.num_layers] and not any(x.any() for x in none)
    finally:
        await rt.aclose()


# -- the connector's waits --------------------------------------------------------------------


def _op() -> LoadOp:
    return LoadOp(req_id="r", capability="c", tokens=list(range(32)), block_ids=list(range(4)))


def test_the_forward_waits_for_each_layer_and_goes_layer_wise_only_after_a_whole_step_of_hooks():
    names = [f"layers.{i}.attn" for i in range(4)]
    loads = LayerLoads(wait_s=10.0)
    loads.register(names)
    loads.new_step()
    assert not loads.ready()  # never seen the hook yet
    for n in names[:3]:
        loads.wait(n)
    loads.new_step()
    assert not loads.ready()  # a step that skipped a layer proves nothing
    for n in names:
        loads.wait(n)
    loads.new_step()
    assert loads.ready()
    load = loads.start(_op(), 8, time.perf_counter())
    load.future = Future()
    load.future.add_done_callback(load.ended)
    passed: list[str] = []

    def forward() -> None:
        for n in names:
            loads.wait(n)
            passed.append(n)

    t = threading.Thread(target=forward)
    t.start()
    time.sleep(0.2)
    assert passed == []  # layer 0 is not in yet
    load.at(2)
    _until(lambda: passed == names[:2])
    time.sleep(0.1)
    assert passed == names[:2]  # layer 2 is not in yet
    load.future.set_result(None)  # the load ended (short or whole): nothing more to wait for
    t.join(5)
    assert passed == names
    taken, complete, waited = loads.take()
    assert taken == [load] and complete and waited > 0.2
    assert LayerLoads(enabled=False).ready() is False


def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)
