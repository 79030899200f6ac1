"""The fused CPU data path: seal_pieces_into / open_segments (crypto), chunk pieces and range
scatter (kernels), and the DataPath that wires them (gateway)."""

from __future__ import annotations

import itertools
import os
import random
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto.aead import CpuAesGcm
from crypto.envelope import (
    HEADER_BYTES,
    ChunkCipher,
    DataKey,
    EnvelopeContext,
    read_header,
    segment_scratch_bytes,
)
from crypto.errors import DecryptionFailed, InvalidParameter
from gateway.bench.plaintext import PlaintextCodec
from gateway.datapath import DataPath, OpenJob, SealJob
from kernels.errors import KVLayoutError
from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import pack, slots_from_block_ids, unpack
from kernels.paged import PagedKV
from kernels.pieces import ChunkPieces, FlatKV, chunk_pieces, unpack_range
from storage.types import ChunkKey

DEK = bytes(range(32))
SECRET = b"namespace-binding-secret-0123456"
CTX = EnvelopeContext("tenant-a", "ns-1", "ab" * 32, "model/fp16/tp0", 3)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _salt(seed: int):
    counter = itertools.count(seed)
    return lambda n: next(counter).to_bytes(4, "big") * (n // 4)


class GatheringAead(CpuAesGcm):
    """A real AES-GCM under another factory, so ChunkCipher takes its gather-per-segment path."""


def _split(data: bytes, cuts: list[int]) -> list[memoryview]:
    view = memoryview(data)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [view[a:b] for a, b in itertools.pairwise(points)]


# -- crypto: seal_pieces_into -----------------------------------------------------------------


@FUZZ
@given(
    data=st.binary(min_size=0, max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
    seg=st.one_of(st.none(), st.integers(1, 700)),
    gather=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_seal_pieces_equals_seal_of_the_join(data, cuts, seg, gather, seed):
    factory = GatheringAead if gather else CpuAesGcm
    ref_cipher = ChunkCipher(segment_bytes=97, salt_source=_salt(seed))
    cipher = ChunkCipher(factory, segment_bytes=97, salt_source=_salt(seed))
    size = ref_cipher.envelope_size(len(data), seg)
    ref = bytearray(size)
    assert ref_cipher.seal_into(DataKey(DEK, SECRET), CTX, data, ref, segment_bytes=seg) == size
    pieces: list = _split(data, cuts)
    pieces.insert(len(pieces) // 2, b"")  # empty pieces are allowed anywhere
    out = bytearray(size + 5)
    assert cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, len(data), out, segment_bytes=seg) == size
    assert out[:size] == ref and out[size:] == bytes(5)
    assert read_header(ref).segment_bytes == (seg or 97)
    assert ChunkCipher().open(DataKey(DEK, SECRET), CTX, out[:size]) == data


def test_seal_pieces_rejects_bad_input_and_writes_nothing():
    cipher = ChunkCipher(segment_bytes=64)
    data = os.urandom(200)
    pieces = _split(data, [50, 120])
    out = bytearray(cipher.envelope_size(200))
    with pytest.raises(InvalidParameter):
        cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, 199, out)
    with pytest.raises(InvalidParameter):
        cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, 200, bytearray(len(out) - 1))
    with pytest.raises(InvalidParameter):
        cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, [*pieces, 7], 200, out)
    with pytest.raises(InvalidParameter):
        cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, 200, out, segment_bytes=0)
    with pytest.raises(InvalidParameter):
        cipher.seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, 200, bytes(len(out)))
    assert out == bytearray(len(out))


# -- crypto: open_segments --------------------------------------------------------------------


@FUZZ
@given(n=st.integers(0, 2000), seg=st.integers(1, 600), slack=st.integers(0, 3))
def test_open_segments_delivers_the_plaintext_in_order(n, seg, slack):
    data = os.urandom(n)
    cipher = ChunkCipher(segment_bytes=seg)
    env = cipher.seal(DataKey(DEK, SECRET), CTX, data)
    need = segment_scratch_bytes(env)
    assert need == min(seg, n)
    got: list[tuple[int, int, bytes]] = []
    total = cipher.open_segments(
        DataKey(DEK, SECRET), CTX, env, bytearray(need + slack), lambda a, b, v: got.append((a, b, bytes(v)))
    )
    assert total == n
    assert [g[0] for g in got] == [min(i * seg, n) for i in range(len(got))]
    assert all(b - a == len(p) for a, b, p in got) and (got[-1][1] if got else 0) == n
    assert b"".join(p for _, _, p in got) == data


@pytest.mark.parametrize("bad", [0, 1, 3])
def test_open_segments_stops_at_a_tampered_segment(bad):
    seg, data = 100, os.urandom(380)  # four segments
    cipher = ChunkCipher(segment_bytes=seg)
    env = bytearray(cipher.seal(DataKey(DEK, SECRET), CTX, data))
    env[HEADER_BYTES + bad * (seg + 16) + 5] ^= 1
    got: list[tuple[int, int]] = []
    scratch = bytearray(seg)
    with pytest.raises(DecryptionFailed):
        cipher.open_segments(DataKey(DEK, SECRET), CTX, env, scratch, lambda a, b, v: got.append((a, b)))
    assert got == [(i * seg, (i + 1) * seg) for i in range(bad)]
    assert scratch == bytearray(seg)


def _targets_of(out: bytearray, cuts: list[int], drops: set[int]):
    """``targets(start, end)`` over ``out``: the range cut at ``cuts``, the pieces whose index is in
    ``drops`` handed over as byte counts (authenticated, dropped) instead of views."""
    view = memoryview(out)

    def targets(start: int, end: int) -> list[memoryview | int]:
        points = sorted({start, end, *(c for c in cuts if start < c < end)})
        return [b - a if k in drops else view[a:b] for k, (a, b) in enumerate(itertools.pairwise(points))]

    return targets


@FUZZ
@given(
    n=st.integers(1, 2000),
    seg=st.integers(1, 600),
    cuts=st.lists(st.integers(0, 2000), max_size=40),
    drops=st.sets(st.integers(0, 8), max_size=3),
    gather=st.booleans(),
)
def test_iter_segments_into_writes_each_segment_in_place(n, seg, cuts, drops, gather):
    data = os.urandom(n)
    cipher = ChunkCipher(GatheringAead if gather else CpuAesGcm, segment_bytes=seg)
    env = cipher.seal(DataKey(DEK, SECRET), CTX, data)
    out = bytearray(b"\x5a" * n)
    targets = _targets_of(out, cuts, drops)
    scratch = bytearray(max(64, segment_scratch_bytes(env)))
    got = list(cipher.iter_segments_into(DataKey(DEK, SECRET), CTX, env, targets, scratch))
    assert got == [(a, min(a + seg, n)) for a in range(0, n, seg)]
    for a, b in got:  # what was dropped is left as it was, the rest is the plaintext
        pos = a
        for t in targets(a, b):
            size = t if isinstance(t, int) else t.nbytes
            assert out[pos : pos + size] == (b"\x5a" * size if isinstance(t, int) else data[pos : pos + size])
            pos += size
    assert scratch == bytearray(len(scratch))  # no plaintext left behind in the bounce or scratch


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("bad", [0, 1, 3])
def test_iter_segments_into_zeroes_the_failing_segment_where_it_landed(gather, bad):
    seg, data = 100, os.urandom(380)  # four segments
    cipher = ChunkCipher(GatheringAead if gather else CpuAesGcm, segment_bytes=seg)
    env = bytearray(cipher.seal(DataKey(DEK, SECRET), CTX, data))
    env[HEADER_BYTES + bad * (seg + 16) + 5] ^= 1  # one bit: the rest of its plaintext decrypts as it was
    out = bytearray(b"\x5a" * 380)
    scratch = bytearray(seg)
    steps = cipher.iter_segments_into(DataKey(DEK, SECRET), CTX, env, _targets_of(out, [7, 50, 113, 250, 251], set()), scratch)
    done = []
    with pytest.raises(DecryptionFailed):
        for a, b in steps:
            done.append((a, b))
            # the caller sees a segment only once it is authentic: the next one is not in out yet
            assert out[b : b + seg] == b"\x5a" * len(out[b : b + seg])
    assert done == [(i * seg, (i + 1) * seg) for i in range(bad)]
    assert out[: bad * seg] == data[: bad * seg]  # the authentic segments before it
    bad_range = out[bad * seg : (bad + 1) * seg]
    # the attacker's segment: its plaintext was written before its tag was known, and is gone
    assert bad_range == (bytes(len(bad_range)) if not gather else b"\x5a" * len(bad_range))
    assert out[(bad + 1) * seg :] == b"\x5a" * len(out[(bad + 1) * seg :])  # never reached
    assert scratch == bytearray(seg)


def test_iter_segments_into_rejects_a_short_scratch_and_another_context():
    cipher = ChunkCipher(segment_bytes=64)
    env = cipher.seal(DataKey(DEK, SECRET), CTX, os.urandom(300))
    out = bytearray(300)
    with pytest.raises(InvalidParameter):
        next(cipher.iter_segments_into(DataKey(DEK, SECRET), CTX, env, _targets_of(out, [], set()), bytearray(63)))
    other = EnvelopeContext("tenant-b", "ns-1", "ab" * 32, "model/fp16/tp0", 3)
    with pytest.raises(DecryptionFailed):
        next(cipher.iter_segments_into(DataKey(DEK, SECRET), other, env, _targets_of(out, [], set()), bytearray(64)))
    assert out == bytearray(300)  # the other context's segment 0 landed, failed, and was zeroed


def test_open_segments_rejects_wrong_context_scratch_and_propagates_callback_errors():
    cipher = ChunkCipher(segment_bytes=64)
    env = cipher.seal(DataKey(DEK, SECRET), CTX, os.urandom(300))
    calls: list[int] = []
    other = EnvelopeContext("tenant-b", "ns-1", "ab" * 32, "model/fp16/tp0", 3)
    with pytest.raises(DecryptionFailed):
        cipher.open_segments(DataKey(DEK, SECRET), other, env, bytearray(64), lambda a, b, v: calls.append(a))
    with pytest.raises(DecryptionFailed):
        cipher.open_segments(DataKey(DEK, SECRET), CTX, env[:-1], bytearray(64), lambda a, b, v: calls.append(a))
    assert calls == []
    with pytest.raises(InvalidParameter):
        cipher.open_segments(DataKey(DEK, SECRET), CTX, env, bytearray(63), lambda a, b, v: calls.append(a))

    def boom(a: int, b: int, v: memoryview) -> None:
        raise RuntimeError("engine gone")

    scratch = bytearray(64)
    with pytest.raises(RuntimeError, match="engine gone"):
        cipher.open_segments(DataKey(DEK, SECRET), CTX, env, scratch, boom)
    assert scratch == bytearray(64)


# -- kernels: pieces and range scatter ---------------------------------------------------------


def _cache(g: KVGeometry, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    *lead, last = g.layer_shape(num_blocks)
    return [
        torch.randint(0, 256, (*lead, last * g.dtype.itemsize), generator=gen, dtype=torch.uint8).view(g.dtype)
        for _ in range(g.num_layers)
    ]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _case(seed: int) -> tuple[KVGeometry, list[torch.Tensor], torch.Tensor]:
    rng = random.Random(seed)
    g = KVGeometry(
        num_layers=rng.randint(1, 4), num_kv_heads=rng.randint(1, 3), head_size=rng.choice([4, 8, 16]),
        dtype=rng.choice(DTYPES), block_size=rng.choice([1, 2, 4, 5]), layout=rng.choice(list(KVLayout)),
    )
    num_blocks = rng.randint(2, 12)
    layers = _cache(g, num_blocks, seed)
    used = rng.randint(1, num_blocks)
    if rng.random() < 0.3:  # consecutive blocks, in order (coalesces for KV_FIRST)
        first = rng.randint(0, num_blocks - used)
        blocks = list(range(first, first + used))
    else:  # random order with gaps
        blocks = rng.sample(range(num_blocks), used)
    tokens = rng.randint(max(1, (used - 1) * g.block_size + 1), used * g.block_size)  # partial last block
    start = rng.randint(0, max(0, tokens - 1)) if rng.random() < 0.3 else 0
    slots = slots_from_block_ids(blocks, g.block_size, start, tokens - start)
    return g, layers, slots


@pytest.mark.parametrize("seed", range(40))
def test_pieces_concatenate_to_pack(seed):
    g, layers, slots = _case(seed)
    kv = PagedKV(layers, g)
    pieces = chunk_pieces(kv, slots, g)
    assert b"".join(pieces) == _raw(pack(kv, slots, g))
    assert all(p.nbytes > 0 for p in pieces)
    # gather allows repeated slots
    twice = torch.cat((slots, slots[:1]))
    assert b"".join(chunk_pieces(layers, twice, g)) == _raw(pack(layers, twice, g))


@pytest.mark.parametrize("layout", list(KVLayout))
def test_pieces_coalesce_runs(layout):
    g = KVGeometry(3, 2, 8, torch.float16, 4, layout)
    layers = _cache(g, 8, 1)
    one_block = chunk_pieces(layers, list(range(8, 12)), g)
    assert len(one_block) == (6 if layout is KVLayout.KV_FIRST else 3)  # K and V, or K+V in one
    two_blocks = chunk_pieces(layers, list(range(8, 16)), g)
    # block-first: K and V of each block apart; kv-first: all K, all V; cpu: the blocks' own bytes
    assert len(two_blocks) == {KVLayout.BLOCK_FIRST: 12, KVLayout.KV_FIRST: 6, KVLayout.CPU: 3}[layout]
    assert [p.nbytes for p in two_blocks[:2]] == {
        KVLayout.BLOCK_FIRST: [4 * g.row_nbytes] * 2, KVLayout.KV_FIRST: [8 * g.row_nbytes] * 2,
        KVLayout.CPU: [16 * g.row_nbytes] * 2,
    }[layout]
    if layout is KVLayout.CPU:  # a chunk of whole, consecutive blocks is those blocks, byte for byte
        assert bytes(two_blocks[0]) == _raw(layers[0][2:4])
        gap = chunk_pieces(layers, [*range(8, 12), *range(20, 24)], g)  # blocks 2 and 5: a run each
        assert [p.nbytes for p in gap[:2]] == [8 * g.row_nbytes] * 2 and len(gap) == 6


@pytest.mark.parametrize("seed", range(30))
def test_unpack_range_over_any_partition_equals_unpack(seed):
    g, layers, slots = _case(seed)
    chunk = pack(layers, slots, g)
    raw = _raw(chunk)
    want = [torch.zeros_like(x) for x in layers]
    unpack(chunk, want, slots, g)
    got = [torch.zeros_like(x) for x in layers]
    rng = random.Random(seed)
    cuts = sorted({0, len(raw), *(rng.randint(0, len(raw)) for _ in range(rng.randint(0, 6)))})
    if rng.random() < 0.5:  # whole layers, as the data path cuts them
        layer = len(raw) // g.num_layers
        cuts = list(range(0, len(raw) + 1, layer))
    pieces = ChunkPieces(FlatKV(PagedKV(got, g)), slots, unique=True)
    for a, b in itertools.pairwise(cuts):
        if rng.random() < 0.5:
            unpack_range(memoryview(raw)[a:b], a, b, got, slots, g)
        else:
            pieces.scatter(raw[a:b], a, b)
    assert all(_raw(x) == _raw(y) for x, y in zip(want, got, strict=True))


def test_unpack_range_rejects_bad_input_and_writes_nothing():
    g = KVGeometry(2, 1, 4, torch.float32, 2, KVLayout.KV_FIRST)
    layers = [torch.zeros(g.layer_shape(4)) for _ in range(2)]
    raw = bytes(range(64))
    for args in (
        (raw[:10], 0, 11),  # src shorter than the range
        (raw[:10], 125, 135),  # past the chunk (2 slots x 2 x 16 B x 2 layers = 128 B)
        (raw[:10], 0, 10.0),
    ):
        with pytest.raises(KVLayoutError):
            unpack_range(args[0], args[1], args[2], layers, [0, 1], g)
    with pytest.raises(KVLayoutError):
        unpack_range(raw[:16], 0, 16, layers, [1, 1], g)  # repeated slots cannot be scattered
    with pytest.raises(KVLayoutError):
        unpack_range(raw[:16], 0, 16, layers, [0, 8], g)  # out of range
    with pytest.raises(KVLayoutError):
        chunk_pieces(layers, [-1], g)
    assert not any(x.any() for x in layers)


# -- gateway: the DataPath --------------------------------------------------------------------


def _jobs(g: KVGeometry, slots: torch.Tensor, n: int) -> list[SealJob]:
    per = slots.numel() // n
    return [SealJob(slots[i * per : (i + 1) * per], DataKey(DEK, SECRET), CTX) for i in range(n)]


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_datapath_round_trip(encrypt, layout):
    g = KVGeometry(4, 2, 16, torch.bfloat16, 4, layout)
    layers = _cache(g, 16, 3)
    kv = PagedKV(layers, g)
    slots = slots_from_block_ids([9, 2, 3, 14, 0, 7, 5, 11], 4, 0, 32)
    dp = DataPath(ChunkCipher(segment_bytes=3000) if encrypt else PlaintextCodec(3000), threads=0)
    jobs = _jobs(g, slots, 2)
    envs = dp.seal_batch(kv, jobs)
    for job, env in zip(jobs, envs, strict=True):
        want = _raw(pack(kv, job.slots, g))
        if encrypt:
            header = read_header(env)
            assert header.segment_bytes == 2048  # a layer is 2 x 16 x 32 B = 1 KiB: two layers
            assert ChunkCipher().open(DataKey(DEK, SECRET), CTX, env) == want
        else:
            assert bytes(env) == want
    dst = [torch.zeros_like(x) for x in layers]
    opened = [OpenJob(e, j.slots, j.keys, j.ctx) for e, j in zip(envs, jobs, strict=True)]
    assert dp.open_batch(PagedKV(dst, g), opened) == (2, False)
    want_dst = [torch.zeros_like(x) for x in layers]
    unpack(pack(kv, slots, g), want_dst, slots, g)
    assert all(_raw(x) == _raw(y) for x, y in zip(want_dst, dst, strict=True))


def test_datapath_failed_chunk_leaves_nothing_of_itself():
    g = KVGeometry(4, 2, 16, torch.float16, 4, KVLayout.KV_FIRST)
    layers = _cache(g, 16, 4)
    slots = slots_from_block_ids(list(range(8)), 4, 0, 32)
    dp = DataPath(ChunkCipher(segment_bytes=2048), threads=0)
    jobs = _jobs(g, slots, 2)
    envs = [bytearray(e) for e in dp.seal_batch(PagedKV(layers, g), jobs)]
    assert read_header(envs[1]).segment_count == 4
    envs[1][-20] ^= 1  # the last segment of chunk 1: segments 0..2 were scattered first
    dst = [torch.full_like(x, 0.0) for x in layers]
    opened = [OpenJob(memoryview(e), j.slots, j.keys, j.ctx) for e, j in zip(envs, jobs, strict=True)]
    assert dp.open_batch(PagedKV(dst, g), opened) == (1, True)
    assert all(x[:, 0:4].any() for x in dst)  # chunk 0 (blocks 0..3) loaded
    assert not any(x[:, 4:].any() for x in dst)  # chunk 1 left nothing behind
    # a plaintext envelope of the wrong size is a failure, not a partial load
    plain = DataPath(PlaintextCodec(), threads=0)
    short = OpenJob(memoryview(bytes(100)), jobs[0].slots, DataKey(DEK, SECRET), CTX)
    assert plain.open_batch(PagedKV(dst, g), [short]) == (0, True)


async def test_envelope_buffers_are_reused_only_once_no_one_holds_them():
    g = KVGeometry(2, 2, 16, torch.float16, 4, KVLayout.KV_FIRST)
    kv = PagedKV(_cache(g, 8, 5), g)
    jobs = _jobs(g, slots_from_block_ids([1, 4, 6, 2], 4, 0, 16), 2)
    dp = DataPath(ChunkCipher(), threads=0)
    # a holder that keeps references (the memory tier copies into its arena)
    tier: dict[ChunkKey, memoryview] = {}
    keys = [ChunkKey("ab", "cd", f"{i:064x}") for i in range(2)]
    first = dp.seal_batch(kv, jobs)
    for key, env in zip(keys, first, strict=True):
        tier[key] = env
    kept = [bytes(e) for e in first]
    arrays = [weakref.ref(e.obj) for e in first]  # weak: the test must not hold them
    del first, env
    second = dp.seal_batch(kv, jobs)  # the tier still holds the first envelopes
    assert not any(e.obj is a() for e in second for a in arrays)
    assert [bytes(tier[k]) for k in keys] == kept
    del second
    view = tier[keys[0]][10:20]  # a slice is a reference too
    del tier[keys[0]]
    assert not any(e.obj is arrays[0]() for e in dp.seal_batch(kv, jobs))
    del view
    again = dp.seal_batch(kv, jobs[:1])
    assert again[0].obj is arrays[0]()  # released by everyone: its pages are reused
    assert ChunkCipher().open(DataKey(DEK, SECRET), CTX, again[0]) == _raw(pack(kv, jobs[0].slots, g))
    assert [bytes(tier[k]) for k in keys[1:]] == kept[1:]
