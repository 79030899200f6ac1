"""The chunk envelope: round trips, every tampering rejected, garbage only ever DecryptionFailed."""

from __future__ import annotations

import dataclasses
import os
import struct
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto.envelope import (
    DEFAULT_SEGMENT_BYTES,
    HEADER_BYTES,
    ChunkCipher,
    DataKey,
    EnvelopeContext,
    envelope_size,
    peek_key_version,
    plaintext_length,
    read_header,
)
from crypto.errors import DecryptionFailed, InvalidParameter
from crypto.segments import IssuedKey, derive_segment_key

SEG = 64
DEK = bytes(range(32))
SECRET = b"namespace-binding-secret-0123456"
CTX = EnvelopeContext("tenant-a", "ns-1", "ab" * 32, "llama-3-8b/bf16/tp0", 7)
HEADER = struct.Struct(">3sBI32sIIQ")
CIPHER = ChunkCipher(segment_bytes=SEG)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _plaintext(n: int) -> bytes:
    return os.urandom(n)


def _segments(env: bytes | bytearray) -> tuple[bytes, list[bytes]]:
    """Split an envelope into header and per-segment ``ciphertext || tag`` pieces."""
    h = read_header(env)
    pieces, pos, left = [], HEADER_BYTES, h.plaintext_length
    for _ in range(h.segment_count):
        n = min(h.segment_bytes, left)
        pieces.append(bytes(env[pos : pos + n + 16]))
        pos, left = pos + n + 16, left - n
    return bytes(env[:HEADER_BYTES]), pieces


def _with_header(env: bytes | bytearray, **fields: Any) -> bytearray:
    magic, version, kv, salt, count, seg, n = HEADER.unpack_from(env)
    values = {
        "magic": magic,
        "version": version,
        "key_version": kv,
        "salt": salt,
        "count": count,
        "seg": seg,
        "length": n,
        **fields,
    }
    return bytearray(HEADER.pack(*values.values())) + env[HEADER_BYTES:]


def assert_rejected(
    env: bytes | bytearray,
    ctx: EnvelopeContext = CTX,
    dek: bytes = DEK,
    secret: bytes = SECRET,
    cipher: ChunkCipher = CIPHER,
) -> None:
    out = bytearray(max(len(env), 1))
    with pytest.raises(DecryptionFailed):
        cipher.open_into(DataKey(dek, secret), ctx, env, out)
    assert not any(out), "plaintext left in out after a failure"


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, SEG - 1, SEG, SEG + 1, 2 * SEG, 5 * SEG + 3])
def test_round_trip(n: int) -> None:
    pt = _plaintext(n)
    env = CIPHER.seal(DataKey(DEK, SECRET), CTX, pt)
    assert len(env) == envelope_size(n, SEG) == CIPHER.envelope_size(n)
    assert peek_key_version(env) == CTX.key_version
    assert plaintext_length(env) == n
    out = bytearray(n)
    assert CIPHER.open_into(DataKey(DEK, SECRET), CTX, env, out) == n
    assert out == pt
    # the plaintext does not appear in the envelope (short ones can by chance: 16 bytes or more
    # colliding with ciphertext has probability ~2^-128)
    assert pt not in env[HEADER_BYTES:] or n < 16


@pytest.mark.parametrize("n", [DEFAULT_SEGMENT_BYTES - 1, DEFAULT_SEGMENT_BYTES + 1])
def test_round_trip_default_segments(n: int) -> None:
    cipher = ChunkCipher()
    pt = _plaintext(n)
    out = bytearray(cipher.envelope_size(n) + 100)  # a larger buffer is fine; the size is returned
    written = cipher.seal_into(DataKey(DEK, SECRET), CTX, memoryview(pt), out)
    assert written == envelope_size(n)
    assert read_header(out[:written]).segment_count == (1 if n < DEFAULT_SEGMENT_BYTES else 2)
    assert cipher.open(DataKey(DEK, SECRET), CTX, out[:written]) == pt


def test_opens_with_the_segment_size_in_the_header() -> None:
    env = CIPHER.seal(DataKey(DEK, SECRET), CTX, b"x" * 300)
    assert ChunkCipher().open(DataKey(DEK, SECRET), CTX, env) == b"x" * 300


def test_seal_into_buffer_types() -> None:
    import numpy as np

    src = np.arange(100, dtype=np.float32)
    env = CIPHER.seal(DataKey(DEK, SECRET), CTX, src)  # type: ignore[arg-type]  # numpy: no __buffer__ on 3.11
    dst = np.zeros(100, dtype=np.float32)
    assert CIPHER.open_into(DataKey(DEK, SECRET), CTX, env, dst) == 400  # type: ignore[arg-type]
    assert (dst == src).all()


def test_caller_mistakes_are_invalid_parameter() -> None:
    env = CIPHER.seal(DataKey(DEK, SECRET), CTX, b"x" * 100)
    with pytest.raises(InvalidParameter):
        CIPHER.seal_into(DataKey(DEK, SECRET), CTX, b"x" * 100, bytearray(len(env) - 1))
    with pytest.raises(InvalidParameter):
        CIPHER.seal_into(DataKey(DEK, SECRET), CTX, b"x", bytes(200))  # read-only out
    with pytest.raises(InvalidParameter):
        CIPHER.open_into(DataKey(DEK, SECRET), CTX, env, bytearray(99))
    with pytest.raises(InvalidParameter):
        CIPHER.seal(DataKey(DEK[:16], SECRET), CTX, b"x")
    with pytest.raises(InvalidParameter):
        CIPHER.seal(DataKey(DEK, b"short"), CTX, b"x")
    with pytest.raises(InvalidParameter):
        ChunkCipher(segment_bytes=0)
    with pytest.raises(InvalidParameter):
        ChunkCipher(salt_source=lambda n: b"\x00" * (n - 1)).seal(DataKey(DEK, SECRET), CTX, b"x")
    bad_fields: list[dict[str, Any]] = [
        {"tenant": ""},
        {"namespace": 3},
        {"key_version": -1},
        {"key_version": 2**32},
        {"key_version": True},
        {"storage_key": "\ud800"},
    ]
    for bad in bad_fields:
        with pytest.raises(InvalidParameter):
            dataclasses.replace(CTX, **bad)


def test_context_encoding_is_unambiguous() -> None:
    a = EnvelopeContext("ab", "c", "k", "m", 1)
    b = EnvelopeContext("a", "bc", "k", "m", 1)
    assert a.aad() != b.aad()
    assert a.aad() == EnvelopeContext("ab", "c", "k", "m", 1).aad()


# --- tampering: 3 full segments and a short last one --------------------------------------------

N = 3 * SEG + 10


@pytest.fixture()
def env() -> bytearray:
    return CIPHER.seal(DataKey(DEK, SECRET), CTX, _plaintext(N))


def test_untampered_fixture_opens(env: bytearray) -> None:
    assert len(CIPHER.open(DataKey(DEK, SECRET), CTX, env)) == N


@pytest.mark.parametrize("segment", [0, 1, 3])
@pytest.mark.parametrize("where", ["first", "last-ct", "tag"])
def test_tampered_segment_byte(env: bytearray, segment: int, where: str) -> None:
    start = HEADER_BYTES + segment * (SEG + 16)
    length = SEG if segment < 3 else 10
    offset = {"first": 0, "last-ct": length - 1, "tag": length + 15}[where]
    env[start + offset] ^= 0x01
    assert_rejected(env)


@pytest.mark.parametrize(
    "field",
    [
        {"magic": b"KVH"},
        {"version": 2},
        {"version": 0},
        {"key_version": 8},
        {"salt": b"\x01" * 32},
        {"count": 5},
        {"count": 3},
        {"seg": SEG + 1},  # still 4 segments and a consistent size: caught by authentication
        {"seg": 0},
        {"length": N - 1},
        {"length": N + 1},
    ],
)
def test_tampered_header_field(env: bytearray, field: dict[str, Any]) -> None:
    assert_rejected(_with_header(env, **field))


def test_header_key_version_and_context_changed_together(env: bytearray) -> None:
    assert_rejected(_with_header(env, key_version=8), ctx=dataclasses.replace(CTX, key_version=8))


def test_length_and_body_shortened_together(env: bytearray) -> None:
    shorter = _with_header(env, length=N - 1)
    del shorter[-17]  # drop the last ciphertext byte, keep the tag: sizes are consistent again
    assert_rejected(shorter)


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "tenant-b"},
        {"namespace": "ns-2"},
        {"storage_key": "cd" * 32},
        {"model_fingerprint": "llama-3-8b/bf16/tp1"},
        {"key_version": 8},
    ],
)
def test_wrong_context(env: bytearray, change: dict[str, Any]) -> None:
    assert_rejected(env, ctx=dataclasses.replace(CTX, **change))


def test_wrong_binding_secret(env: bytearray) -> None:
    assert_rejected(env, secret=SECRET[:-1] + b"7")


def test_wrong_dek(env: bytearray) -> None:
    assert_rejected(env, dek=bytes(range(1, 33)))


def _reassemble(header: bytes, pieces: list[bytes], *, fix_header: bool) -> bytearray:
    env = bytearray(header) + b"".join(pieces)
    if fix_header:
        body = sum(len(p) - 16 for p in pieces)
        env = _with_header(env, count=len(pieces), length=body)
    return env


@pytest.mark.parametrize("fix_header", [False, True])
def test_segment_dropped(env: bytearray, fix_header: bool) -> None:
    header, pieces = _segments(env)
    assert_rejected(_reassemble(header, pieces[:1] + pieces[2:], fix_header=fix_header))
    assert_rejected(_reassemble(header, pieces[:-1], fix_header=fix_header))


def test_segments_reordered(env: bytearray) -> None:
    header, p = _segments(env)
    assert_rejected(_reassemble(header, [p[1], p[0], p[2], p[3]], fix_header=False))


def test_segment_duplicated(env: bytearray) -> None:
    header, p = _segments(env)
    assert_rejected(_reassemble(header, [p[0], p[0], p[2], p[3]], fix_header=False))
    assert_rejected(_reassemble(header, [p[0], p[1], p[2], p[2], p[3]], fix_header=True))


def test_segment_moved_between_chunks_even_under_the_same_key() -> None:
    same_salt = ChunkCipher(segment_bytes=SEG, salt_source=lambda n: b"\x42" * n)
    other_ctx = dataclasses.replace(CTX, storage_key="cd" * 32)
    a = same_salt.seal(DataKey(DEK, SECRET), CTX, _plaintext(N))
    b = same_salt.seal(DataKey(DEK, SECRET), other_ctx, _plaintext(N))
    header_a, pa = _segments(a)
    _, pb = _segments(b)
    assert_rejected(_reassemble(header_a, [pa[0], pb[1], pa[2], pa[3]], fix_header=False))


def test_every_truncation_and_appended_bytes(env: bytearray) -> None:
    for cut in range(len(env)):
        assert_rejected(env[:cut])
    assert_rejected(env + b"\x00")
    assert_rejected(env + bytes(16))


def test_huge_claimed_length_allocates_nothing() -> None:
    claim = HEADER.pack(b"KVG", 1, 7, b"\x00" * 32, 2**30, 2**30, 2**60)
    tracemalloc.start()
    try:
        for call in (
            plaintext_length,
            peek_key_version,
            lambda e: CIPHER.open(DataKey(DEK, SECRET), CTX, e),
        ):
            with pytest.raises(DecryptionFailed):
                call(claim + bytes(64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- garbage ------------------------------------------------------------------------------------


def _only_decryption_failed(data: bytes) -> None:
    for call in (read_header, peek_key_version, plaintext_length):
        with pytest.raises(DecryptionFailed):
            call(data)
    assert_rejected(data)


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes(data: bytes) -> None:
    _only_decryption_failed(data)


@FUZZ
@given(
    key_version=st.sampled_from([0, 7, 2**32 - 1]),
    count=st.integers(0, 8) | st.integers(0, 2**32 - 1),
    seg=st.integers(0, 80) | st.integers(0, 2**32 - 1),
    length=st.integers(0, 400) | st.integers(0, 2**64 - 1),
    body=st.binary(max_size=600),
)
def test_well_formed_headers_with_garbage_bodies(
    key_version: int, count: int, seg: int, length: int, body: bytes
) -> None:
    _only_decryption_failed(
        HEADER.pack(b"KVG", 1, key_version, b"\x00" * 32, count, seg, length) + body
    )


@FUZZ
@given(st.data())
def test_any_single_byte_change_is_rejected(data: st.DataObject) -> None:
    env = CIPHER.seal(DataKey(DEK, SECRET), CTX, b"p" * N)
    pos = data.draw(st.integers(0, len(env) - 1))
    env[pos] ^= data.draw(st.integers(1, 255))
    assert_rejected(env)


# -- key sources: the data key, and one envelope's issued key -----------------------------------
def test_an_issued_key_is_the_data_keys_derivation_for_its_salt_and_nothing_more() -> None:
    """A remote worker's key for one envelope (salt and segment key, issued by the server) seals the
    bytes the data key seals with that salt, and opens that envelope only."""
    salt = bytes(range(100, 132))
    by_data_key = ChunkCipher(segment_bytes=SEG, salt_source=lambda n: salt).seal(DataKey(DEK, SECRET), CTX, b"p" * 300)
    issued = IssuedKey(salt, derive_segment_key(DEK, SECRET, salt))
    assert CIPHER.seal(issued, CTX, b"p" * 300) == by_data_key  # CIPHER's own salt source is not used
    assert CIPHER.open(issued, CTX, by_data_key) == b"p" * 300
    assert CIPHER.open(DataKey(DEK, SECRET), CTX, CIPHER.seal(issued, CTX, b"q" * 5)) == b"q" * 5
    # the attacker holds that one key: every other envelope of the same data key stays shut,
    # header rewritten to the held salt or not
    other = CIPHER.seal(DataKey(DEK, SECRET), CTX, b"p" * 300)
    forged = bytearray(other)
    forged[8:40] = salt
    for env in (other, forged):
        with pytest.raises(DecryptionFailed):
            CIPHER.open(issued, CTX, env)
    assert "key=" not in repr(issued) and repr(DataKey(DEK, SECRET)) == "DataKey()"
    for bad_salt, bad_key in ((salt[:31], bytes(32)), (salt, bytes(31)), ("x" * 32, bytes(32))):
        with pytest.raises(InvalidParameter):
            IssuedKey(bad_salt, bad_key)  # type: ignore[arg-type]  # a str salt: refused
