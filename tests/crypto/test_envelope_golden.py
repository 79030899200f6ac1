"""Golden envelopes: the v1 format pinned byte for byte, through every seal and open path (CPU,
pieces streamed and gathered, per-segment open, device in place and fused), so a refactor of the
segment plan cannot change a bit of what is stored."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext
from crypto.errors import DecryptionFailed

CTX = EnvelopeContext("tenant-a", "ns-1", "ab" * 32, "llama/bf16/tp0", 7)
DEK = bytes(range(32))
SECRET = b"namespace-binding-secret-0123456"
GOLDEN_40 = bytes.fromhex(
    "4b564701000000076465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f8081828300000003"
    "0000001000000000000000283c8662d2b73c7392fba2665036dafea1b05d5cb163f7d3a73bf9bd07b7640893d0"
    "50f49e25deb7c63c6430bced77e426c3206cf20c2806f4a414fb9add18293f9d0711ff3109e91ef01c9c959ca3"
    "9a6cc045cf1046cde230"
)
GOLDEN_SHA256 = {
    0: "3a1f78be4c272f0cbf1dde2845719a8a07fb1f1881f61e69689822720723ba1c",
    1: "9ea59bba4737848e5d2f07458a1967a374ca1a56b2769158c17fad136ad76b69",
    16: "fa6e73f79e655112a3ece95707e38ce83d8a814fd8f53020492ff2490ed272f0",
    40: "1d380462a3b80a55dea2716c4bfd35731c282f95d06fba5cc8b8e36959d08277",
}


def _salt(n: int) -> bytes:
    return bytes(range(100, 100 + n))


def _pt(n: int) -> bytes:
    return bytes((i * 7) % 251 for i in range(n))


def _cipher(factory: object = None) -> ChunkCipher:
    if factory is None:
        return ChunkCipher(segment_bytes=16, salt_source=_salt)
    return ChunkCipher(factory, segment_bytes=16, salt_source=_salt)  # type: ignore[arg-type]  # a test AEAD


class _OtherAead:
    """An AEAD that is not ``CpuAesGcm`` (takes the gathered pieces path); same AES-GCM bytes."""

    def __init__(self, key: bytes) -> None:
        self._a = AESGCM(key)

    def seal_into(self, nonce: bytes, pt: memoryview, aad: bytes, out: memoryview) -> None:
        out[:] = self._a.encrypt(nonce, bytes(pt), aad)

    def open_into(self, nonce: bytes, ct: memoryview, aad: bytes, out: memoryview) -> None:
        try:
            out[:] = self._a.decrypt(nonce, bytes(ct), aad)
        except InvalidTag:
            raise DecryptionFailed from None


class _InPlaceAead:
    """A stand-in for a device AEAD: encrypts and decrypts a writable buffer in place."""

    def __init__(self, key: bytes) -> None:
        self._a = AESGCM(key)

    def encrypt_(self, buf: memoryview, nonce: bytes, aad: bytes) -> bytes:
        sealed = self._a.encrypt(nonce, bytes(buf), aad)
        buf[:] = sealed[:-16]
        return sealed[-16:]

    def decrypt_(self, buf: memoryview, nonce: bytes, aad: bytes, tag: bytes) -> None:
        buf[:] = self._a.decrypt(nonce, bytes(buf) + tag, aad)


@pytest.mark.parametrize("n", sorted(GOLDEN_SHA256))
def test_seal_is_the_golden_envelope(n: int) -> None:
    env = _cipher().seal(DataKey(DEK, SECRET), CTX, _pt(n))
    assert hashlib.sha256(env).hexdigest() == GOLDEN_SHA256[n]
    assert _cipher().open(DataKey(DEK, SECRET), CTX, env) == _pt(n)


def test_golden_bytes_open_and_a_flipped_bit_does_not() -> None:
    assert bytes(_cipher().seal(DataKey(DEK, SECRET), CTX, _pt(40))) == GOLDEN_40
    assert _cipher().open(DataKey(DEK, SECRET), CTX, GOLDEN_40) == _pt(40)
    bad = bytearray(GOLDEN_40)
    bad[-1] ^= 1
    with pytest.raises(DecryptionFailed):
        _cipher().open(DataKey(DEK, SECRET), CTX, bad)


@pytest.mark.parametrize("factory", [None, _OtherAead])
@pytest.mark.parametrize("cuts", [(40,), (3, 20, 17), (16, 16, 8), (1,) * 40, (0, 40, 0)])
def test_pieces_seal_the_golden_envelope(factory: object, cuts: tuple[int, ...]) -> None:
    pt, pieces, pos = _pt(40), [], 0
    for c in cuts:
        pieces.append(memoryview(pt)[pos : pos + c])
        pos += c
    out = bytearray(len(GOLDEN_40))
    assert _cipher(factory).seal_pieces_into(DataKey(DEK, SECRET), CTX, pieces, 40, out) == len(GOLDEN_40)
    assert bytes(out) == GOLDEN_40


def test_open_segments_delivers_the_golden_plaintext() -> None:
    got = bytearray(40)

    def on_segment(start: int, end: int, view: memoryview) -> None:
        got[start:end] = view

    for factory in (None, _OtherAead):
        assert _cipher(factory).open_segments(DataKey(DEK, SECRET), CTX, GOLDEN_40, bytearray(16), on_segment) == 40
        assert bytes(got) == _pt(40)


def test_device_in_place_paths_are_the_golden_envelope() -> None:
    cipher = _cipher(_InPlaceAead)
    plain = memoryview(bytearray(_pt(40)))
    out = memoryview(bytearray(len(GOLDEN_40)))

    def to_host(part: memoryview, dst: memoryview) -> None:
        dst[:] = part

    assert cipher.seal_device_into(DataKey(DEK, SECRET), CTX, plain, 40, out, to_host=to_host) == len(GOLDEN_40)
    assert bytes(out) == GOLDEN_40
    back = memoryview(bytearray(40))

    def to_device(src: memoryview, part: memoryview) -> None:
        part[:] = src

    def zero(buf: memoryview) -> None:
        buf[:] = bytes(len(buf))

    assert cipher.open_device_into(DataKey(DEK, SECRET), CTX, memoryview(GOLDEN_40), back, to_device=to_device, zero=zero) == 40
    assert bytes(back) == _pt(40)
    bad = bytearray(GOLDEN_40)
    bad[70] ^= 1
    with pytest.raises(DecryptionFailed):
        cipher.open_device_into(DataKey(DEK, SECRET), CTX, memoryview(bad), back, to_device=to_device, zero=zero)
    assert bytes(back) == bytes(40)


def test_device_fused_paths_are_the_golden_envelope() -> None:
    cipher = _cipher()
    dev = bytearray(_pt(40))

    def encrypt(key: bytes, segments: list[tuple[int, int, bytes, bytes]]) -> list[bytes]:
        tags = []
        for start, end, nonce, aad in segments:
            sealed = AESGCM(key).encrypt(nonce, bytes(dev[start:end]), aad)
            dev[start:end] = sealed[:-16]
            tags.append(sealed[-16:])
        return tags

    def to_host(start: int, end: int, dst: memoryview) -> None:
        dst[:] = dev[start:end]

    out = memoryview(bytearray(len(GOLDEN_40)))
    assert cipher.seal_device_fused(DataKey(DEK, SECRET), CTX, 40, out, encrypt=encrypt, to_host=to_host) == len(GOLDEN_40)
    assert bytes(out) == GOLDEN_40

    back = bytearray(40)

    def to_device(src: memoryview, start: int, end: int) -> None:
        back[start:end] = src

    def decrypt(key: bytes, segments: list[tuple[int, int, bytes, bytes, bytes]]) -> None:
        plain = [AESGCM(key).decrypt(n, bytes(back[s:e]) + t, a) for s, e, n, a, t in segments]
        for (s, e, *_), p in zip(segments, plain, strict=True):
            back[s:e] = p

    assert cipher.open_device_fused(DataKey(DEK, SECRET), CTX, memoryview(GOLDEN_40), to_device=to_device, decrypt=decrypt) == 40
    assert bytes(back) == _pt(40)
    bad = bytearray(GOLDEN_40)
    bad[60] ^= 1
    with pytest.raises(DecryptionFailed):
        cipher.open_device_fused(DataKey(DEK, SECRET), CTX, memoryview(bad), to_device=to_device, decrypt=decrypt)
