"""Nonce uniqueness: no (segment key, nonce) pair ever repeats, within and across processes.

The AEAD factory is wrapped by a recorder that logs every (key, nonce) the cipher really uses, so
the check looks at what reaches AES, not at what the envelope code intends.
"""

from __future__ import annotations

import multiprocessing
import os

from crypto.aead import Aead, CpuAesGcm
from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext, read_header

DEK = os.urandom(32)
SECRET = os.urandom(32)
CTX = EnvelopeContext("tenant-a", "ns-1", "key", "model", 1)
SEALS = 100_000


class Recorder:
    """An ``AeadFactory`` that delegates to ``CpuAesGcm`` and records every (key, nonce) sealed."""

    def __init__(self) -> None:
        self.pairs: list[tuple[bytes, bytes]] = []

    def __call__(self, key: bytes) -> Aead:
        recorder, inner = self, CpuAesGcm(key)

        class Recording:
            def seal_into(self, nonce, data, aad, out):  # type: ignore[no-untyped-def]
                recorder.pairs.append((key, nonce))
                inner.seal_into(nonce, data, aad, out)

            def open_into(self, nonce, data_with_tag, aad, out):  # type: ignore[no-untyped-def]
                inner.open_into(nonce, data_with_tag, aad, out)

        return Recording()


def _repeats(pairs: list[tuple[bytes, bytes]]) -> int:
    return len(pairs) - len(set(pairs))


def test_no_key_nonce_pair_repeats_over_many_seals() -> None:
    recorder = Recorder()
    cipher = ChunkCipher(recorder, segment_bytes=16)
    buf = bytearray(cipher.envelope_size(40))  # 3 segments per envelope
    salts = set()
    for i in range(SEALS):
        cipher.seal_into(DataKey(DEK, SECRET), CTX, i.to_bytes(40, "big"), buf)
        salts.add(read_header(buf).salt)
    assert len(salts) == SEALS
    assert len(recorder.pairs) == 3 * SEALS
    assert _repeats(recorder.pairs) == 0


def test_constant_salt_is_detected() -> None:
    """Positive control: with a constant salt source the same check finds the repeats."""
    recorder = Recorder()
    cipher = ChunkCipher(recorder, segment_bytes=16, salt_source=lambda n: b"\x00" * n)
    for i in range(100):
        cipher.seal(DataKey(DEK, SECRET), CTX, i.to_bytes(40, "big"))
    assert _repeats(recorder.pairs) == 3 * 99


def _salts_in_child(count: int) -> list[bytes]:
    cipher = ChunkCipher(segment_bytes=16)
    buf = bytearray(cipher.envelope_size(8))
    salts = []
    for i in range(count):
        cipher.seal_into(DataKey(DEK, SECRET), CTX, i.to_bytes(8, "big"), buf)
        salts.append(read_header(buf).salt)
    return salts


def test_two_processes_sharing_a_dek_use_disjoint_salts() -> None:
    count = 20_000
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_salts_in_child, [count, count])
    assert len(set(a)) == len(set(b)) == count
    assert set(a).isdisjoint(b)
