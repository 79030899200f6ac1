"""``kernels.triton_gcm`` (the device AES-GCM in Triton) against ``cryptography``, on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set here when there is no CUDA device) and on CUDA
unchanged: random lengths, AADs and key versions, NIST CAVP and Wycheproof vectors, tampering
(nothing scattered on a bad tag), and the fused gather/scatter for both paged layouts and every
KV dtype. Interpreter speed bounds the sizes; the long vector sweeps are ``slow``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels are decorated at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext, IssuedKey
from crypto.errors import DecryptionFailed
from crypto.segments import derive_segment_key
from kernels.aes_gcm import TagMismatch, TorchAesGcm
from kernels.device_aead import triton_available
from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import chunk_rows, pack, slots_from_block_ids
from kernels.paged import PagedKV
from tests.support.services import missing
from tests.support.vectors import AeadVector, load_nist_gcm, load_wycheproof_gcm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def tg() -> Iterator[object]:
    if not triton_available():
        missing("triton is not installed (pip install -e .[test])")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops; a second OpenMP thread only contends on a shared box
    from kernels import triton_gcm

    yield triton_gcm
    torch.set_num_threads(before)


def _t(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[: len(data)].clone().to(DEV)


def _b(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


# -- the cipher, in place --------------------------------------------------------------------------


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    key=st.binary(min_size=32, max_size=32),
    nonce=st.binary(min_size=12, max_size=12),
    aad=st.binary(max_size=40),
    data=st.one_of(st.binary(max_size=40), st.binary(min_size=250, max_size=300)),
)
@example(key=b"\0" * 32, nonce=b"\0" * 12, aad=b"", data=b"")  # the empty message: the tag only
@example(key=b"\1" * 32, nonce=b"\2" * 12, aad=b"a" * 17, data=b"x" * 1041)  # GHASH over two levels
def test_equals_cryptography(tg, key: bytes, nonce: bytes, aad: bytes, data: bytes) -> None:
    expected = AESGCM(key).encrypt(nonce, data, aad)
    aes = tg.TritonAesGcm(key, DEV)
    buf = _t(data)
    tag = aes.encrypt_(buf, nonce, aad)
    assert _b(buf) + tag == expected
    aes.decrypt_(buf, nonce, aad, tag)
    assert _b(buf) == data


def test_small_tiles_and_groups_change_no_bit(tg) -> None:
    """Many CTR programs and three GHASH levels (group 4: 4^3 < 70 blocks) give the same bytes."""
    key, nonce, aad, data = os.urandom(32), os.urandom(12), os.urandom(33), os.urandom(1111)
    aes = tg.TritonAesGcm(key, DEV, block_tile=4, group=4)
    buf = _t(data)
    tag = aes.encrypt_(buf, nonce, aad)
    assert _b(buf) + tag == AESGCM(key).encrypt(nonce, data, aad)


def test_bit_serial_gf_products_as_compiled(tg) -> None:
    """The compiled kernels multiply in GF(2^128) bit by bit (``gf_table=False``); the interpreter
    defaults to byte tables. Both give cryptography's bytes."""
    key, nonce, aad, data = os.urandom(32), os.urandom(12), os.urandom(19), os.urandom(77)
    aes = tg.TritonAesGcm(key, DEV, gf_table=False, group=8)
    buf = _t(data)
    tag = aes.encrypt_(buf, nonce, aad)
    assert _b(buf) + tag == AESGCM(key).encrypt(nonce, data, aad)


def test_equals_the_torch_reference(tg) -> None:
    key, nonce, aad, data = os.urandom(32), os.urandom(12), os.urandom(20), os.urandom(517)
    a, b = _t(data), _t(data)
    assert tg.TritonAesGcm(key, DEV).encrypt_(a, nonce, aad) == TorchAesGcm(key, DEV).encrypt_(b, nonce, aad)
    assert torch.equal(a, b)


def test_open_into_raises_the_callers_failure_and_zeroes(tg) -> None:
    key, nonce = os.urandom(32), os.urandom(12)
    sealed = bytearray(AESGCM(key).encrypt(nonce, b"secret kv bytes", b"aad"))
    aes = tg.TritonAesGcm(key, DEV, failure=DecryptionFailed)
    out = bytearray(len(sealed) - 16)
    aes.open_into(nonce, bytes(sealed), b"aad", out)
    assert bytes(out) == b"secret kv bytes"
    sealed[3] ^= 1
    with pytest.raises(DecryptionFailed):
        aes.open_into(nonce, bytes(sealed), b"aad", out)
    assert out == bytearray(len(out))


# -- known answers ---------------------------------------------------------------------------------


def _vectors(which: str) -> list[AeadVector]:
    if which == "nist-encrypt":
        return load_nist_gcm("gcmEncryptExtIV256.rsp")
    if which == "nist-decrypt":
        return load_nist_gcm("gcmDecrypt256.rsp")
    return load_wycheproof_gcm()


def _subset(vectors: list[AeadVector]) -> list[AeadVector]:
    """At most 3 vectors spread over the file's plaintext and AAD lengths, and 1 that must fail
    (interpreter time: each vector is a new key). The ``slow`` test runs every vector."""
    pt_seen: set[int] = set()
    aad_seen: set[int] = set()
    good, bad = [], []
    for v in vectors:
        n = len(v.pt) if v.ok else len(v.ct)
        if not v.ok:
            bad.append(v)
        elif n not in pt_seen or len(v.aad) not in aad_seen:
            good.append(v)
        pt_seen.add(n)
        aad_seen.add(len(v.aad))
    step = max(1, -(-len(good) // 3))  # at most 3, spread over the file's shapes
    return good[::step] + bad[:1]


def _check_vector(tg, v: AeadVector) -> None:
    aes = tg.TritonAesGcm(v.key, DEV)
    if v.ok:
        buf = _t(v.pt)
        assert aes.encrypt_(buf, v.iv, v.aad) == v.tag, v.case
        assert _b(buf) == v.ct, v.case
    buf = _t(v.ct)
    if v.ok:
        aes.decrypt_(buf, v.iv, v.aad, v.tag)
        assert _b(buf) == v.pt, v.case
    else:
        with pytest.raises(TagMismatch):
            aes.decrypt_(buf, v.iv, v.aad, v.tag)


@pytest.mark.parametrize("which", ["nist-encrypt", "nist-decrypt", "wycheproof"])
def test_known_answer_vectors_subset(tg, which: str) -> None:
    vectors = _subset(_vectors(which))
    assert vectors
    for v in vectors:
        _check_vector(tg, v)


@pytest.mark.exhaustive  # every NIST/Wycheproof vector under the interpreter: ~10 min; `make test-exhaustive`
@pytest.mark.slow
@pytest.mark.parametrize("which", ["nist-encrypt", "nist-decrypt", "wycheproof"])
def test_known_answer_vectors_all(tg, which: str) -> None:
    for v in _vectors(which):
        _check_vector(tg, v)


# -- fused with the paged gather / scatter ---------------------------------------------------------


def _geometry(layout: KVLayout, dtype: torch.dtype, head_size: int = 5) -> KVGeometry:
    # rows of 2 heads x 5 x itemsize bytes: never a multiple of 16, so blocks straddle rows and layers
    return KVGeometry(num_layers=2, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=4, layout=layout)


def _cache(g: KVGeometry, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = g.layer_shape(num_blocks)
    n = torch.Size(shape).numel() * g.dtype.itemsize
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(g.dtype).view(shape).to(DEV)
            for _ in range(g.num_layers)]


def _segments(total: int, seg: int, aad: bytes) -> list[tuple[int, int, bytes, bytes]]:
    count = max(1, -(-total // seg))
    return [(i * seg, min(total, (i + 1) * seg), i.to_bytes(12, "big"), aad + bytes([i])) for i in range(count)]


def _round_trip(tg, layout: KVLayout, dtype: torch.dtype, seg: int) -> None:
    g = _geometry(layout, dtype)
    src = _cache(g, 6, seed=1)
    blocks = [4, 1, 5]
    slots = slots_from_block_ids(blocks, g.block_size, 1, 10, device=DEV)  # a partial first and last block
    kv, rows = chunk_rows(src, slots, g)
    plain = pack(kv, slots, g).view(-1).view(torch.uint8)
    total = plain.numel()
    key = os.urandom(32)
    aes = tg.TritonAesGcm(key, DEV)
    segs = _segments(total, seg, b"ctx")
    stage = torch.empty(total, dtype=torch.uint8, device=DEV)
    tags = aes.gather_encrypt_(kv, rows, stage, segs)
    p = _b(plain)
    for (s, e, nonce, aad), tag in zip(segs, tags, strict=True):  # each segment is cryptography's
        assert _b(stage[s:e]) + tag == AESGCM(key).encrypt(nonce, p[s:e], aad)
    dst = [torch.zeros_like(t) for t in src]
    kv_dst, rows_dst = chunk_rows(dst, slots, g, unique=True)
    aes.decrypt_scatter_(stage, kv_dst, rows_dst, [(*s, t) for s, t in zip(segs, tags, strict=True)])
    assert torch.equal(pack(kv_dst, slots, g).view(-1).view(torch.uint8), plain)
    untouched = torch.ones(6 * g.block_size * 2, dtype=torch.bool)  # every other row stays zero
    untouched[rows_dst.cpu()] = False
    for t in dst:
        assert not t.view(-1).view(torch.uint8).cpu().view(untouched.numel(), -1)[untouched].any()


@pytest.mark.parametrize(
    ("layout", "dtype", "seg"),
    [
        (KVLayout.KV_FIRST, torch.float16, 150),  # segments end mid-layer and mid-block
        (KVLayout.BLOCK_FIRST, torch.bfloat16, 150),
        (KVLayout.KV_FIRST, torch.float32, 10_000),
        (KVLayout.BLOCK_FIRST, DTYPES[-1], 10_000),  # fp8 where torch has it
    ],
    ids=lambda v: str(v).removeprefix("torch.").removeprefix("KVLayout."),
)
def test_fused_round_trip(tg, layout: KVLayout, dtype: torch.dtype, seg: int) -> None:
    _round_trip(tg, layout, dtype, seg=seg)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [KVLayout.KV_FIRST, KVLayout.BLOCK_FIRST])  # the kernels move whole rows
def test_fused_round_trip_every_layout_and_dtype(tg, layout: KVLayout, dtype: torch.dtype) -> None:
    _round_trip(tg, layout, dtype, seg=97)


def test_nothing_is_scattered_on_a_bad_tag(tg) -> None:
    """A flipped ciphertext bit (first or last segment), tag bit or AAD: ``TagMismatch`` and not
    one byte of a live cache changes (every tag is checked before anything is scattered)."""
    g = _geometry(KVLayout.KV_FIRST, torch.float16)
    src = _cache(g, 4, seed=2)
    slots = slots_from_block_ids([2, 0], g.block_size, 0, 8, device=DEV)
    kv, rows = chunk_rows(src, slots, g)
    total = g.chunk_nbytes(8)
    aes = tg.TritonAesGcm(os.urandom(32), DEV)
    segs = _segments(total, 200, b"ctx")
    stage = torch.empty(total, dtype=torch.uint8, device=DEV)
    tags = aes.gather_encrypt_(kv, rows, stage, segs)
    good = [(*s, t) for s, t in zip(segs, tags, strict=True)]
    bad_tag = list(good)
    bad_tag[0] = (*good[0][:4], bytes([good[0][4][0] ^ 1]) + good[0][4][1:])
    bad_aad = list(good)
    bad_aad[1] = (*good[1][:3], b"other", good[1][4])
    dst = _cache(g, 4, seed=3)  # a live cache: nothing of the chunk may land in it
    before = [_b(t) for t in dst]
    kv_dst, rows_dst = chunk_rows(dst, slots, g, unique=True)
    for where, opened in (("first byte", good), ("last byte", good), ("tag", bad_tag), ("aad", bad_aad)):
        ct = stage.clone()
        if where == "first byte":
            ct[5] ^= 1
        elif where == "last byte":
            ct[-1] ^= 0x80
        with pytest.raises(TagMismatch):
            aes.decrypt_scatter_(ct, kv_dst, rows_dst, opened)
        assert [_b(t) for t in dst] == before, where
    aes.decrypt_scatter_(stage, kv_dst, rows_dst, good)  # and the untouched one opens
    assert _b(pack(kv_dst, slots, g)) == _b(pack(kv, slots, g))


def test_segments_must_partition_the_chunk(tg) -> None:
    from kernels.aes_gcm import AeadParameterError

    g = _geometry(KVLayout.KV_FIRST, torch.float16)
    kv, rows = chunk_rows(_cache(g, 2, seed=0), [0, 1], g)
    stage = torch.empty(g.chunk_nbytes(2), dtype=torch.uint8, device=DEV)
    aes = tg.TritonAesGcm(os.urandom(32), DEV)
    with pytest.raises(AeadParameterError):
        aes.gather_encrypt_(kv, rows, stage, [(0, 10, bytes(12), b"")])


# -- the envelope: the gateway's device path with the Triton cipher --------------------------------


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 9),
    key_version=st.sampled_from([1, 2, 7, 2**31 - 1]),
    namespace=st.text(min_size=1, max_size=12),
    segment=st.sampled_from([64, 100, 1 << 20]),
)
def test_envelope_is_the_cpu_paths_bit_for_bit(tg, tokens: int, key_version: int, namespace: str, segment: int) -> None:
    from gateway.datapath import DataPath, OpenJob, SealJob

    g = _geometry(KVLayout.BLOCK_FIRST, torch.float16)
    src = _cache(g, 4, seed=tokens)
    kv = PagedKV(src, g)
    slots = slots_from_block_ids([3, 1, 0], g.block_size, 0, tokens, device=DEV)
    ctx = EnvelopeContext("tenant", namespace, "ab" * 32, "cd" * 32, key_version)
    dek, binding, salt = os.urandom(32), os.urandom(32), os.urandom(32)

    def cipher() -> ChunkCipher:
        return ChunkCipher(segment_bytes=segment, salt_source=lambda n: salt)

    cpu = DataPath(cipher(), threads=0)
    dev = DataPath(cipher(), threads=0, device_cipher="always", device_aes="triton")
    assert dev.sealer_for(kv).name == "device-triton"  # the device sealer, with the same salt source
    cpu_kv = PagedKV([t.cpu() for t in src], g)
    a = cpu.seal_batch(cpu_kv, [SealJob(slots.cpu(), DataKey(dek, binding), ctx)])[0]
    b = dev.seal_batch(kv, [SealJob(slots, DataKey(dek, binding), ctx)])[0]
    assert bytes(a) == bytes(b)
    # remote mode: the envelope's server-issued key alone seals and opens the same bytes
    issued = IssuedKey(salt, derive_segment_key(dek, binding, salt))
    assert bytes(dev.seal_batch(kv, [SealJob(slots, issued, ctx)])[0]) == bytes(a)
    dst = [torch.zeros_like(t) for t in src]
    assert dev.open_batch(PagedKV(dst, g), [OpenJob(memoryview(bytes(a)), slots, issued, ctx)]) == (1, False)
    assert _b(pack(dst, slots, g)) == _b(pack(src, slots, g))  # bytes: random bits hold NaNs
    wrong = EnvelopeContext("tenant", namespace, "ab" * 32, "cd" * 32, key_version + 1)
    dst2 = [torch.zeros_like(t) for t in src]
    assert dev.open_batch(PagedKV(dst2, g), [OpenJob(memoryview(bytes(a)), slots, DataKey(dek, binding), wrong)]) == (0, True)
    assert not any(t.any() for t in dst2)


def test_the_selection_self_test_passes_here(tg, monkeypatch) -> None:
    from kernels import device_aead

    monkeypatch.setattr(device_aead, "_TESTED", {})
    assert device_aead.self_test(DEV)
