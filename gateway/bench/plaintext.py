"""The plaintext baseline of the benchmark: an envelope codec that copies instead of encrypting.

Passed to the product's ``DataPath`` like any codec, so the benchmark's plaintext figures run the
same gather, segment scatter, buffers and threads as the encrypted ones, and encrypted/plaintext
is a fair ratio. It exists only here; the product has no switch that turns encryption off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from crypto.envelope import ChunkCipher
from crypto.errors import DecryptionFailed

__all__ = ["PlaintextCodec"]


class PlaintextCodec:
    """The "envelope" is the chunk's bytes; keys and contexts are ignored."""

    cipher: ChunkCipher | None = None  # no device path: a device cache is packed and copied on the host

    def __init__(self, segment_bytes: int = 2 << 20) -> None:
        self._segment_bytes = segment_bytes

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    def envelope_size(self, plaintext_len: int, segment_bytes: int | None = None) -> int:
        return plaintext_len

    def key_ref(self, envelope: memoryview) -> tuple[int, bytes] | None:
        return None  # no data key: the plane opens without asking for one

    def plaintext_length(self, envelope: memoryview) -> int:
        return envelope.nbytes

    def scratch_bytes(self, envelope: memoryview) -> int:
        return max(1, min(self._segment_bytes, envelope.nbytes))

    def seal_pieces_into(
        self, keys: Any, ctx: Any, pieces: Sequence[memoryview], n: int, out: memoryview, *,
        segment_bytes: int,
    ) -> int:
        pos = 0
        for p in pieces:
            out[pos : pos + p.nbytes] = p
            pos += p.nbytes
        return pos

    def open_segments(
        self, keys: Any, ctx: Any, envelope: memoryview, scratch: memoryview,
        on_segment: Callable[[int, int, memoryview], None],
    ) -> int:
        """The same segment-wise delivery as the cipher, a copy in place of AES-GCM."""
        n, seg = envelope.nbytes, scratch.nbytes
        for a in range(0, n, seg):
            b = min(a + seg, n)
            part = scratch[: b - a]
            part[:] = envelope[a:b]
            on_segment(a, b, part)
        return n

    def iter_segments(self, keys: Any, ctx: Any, envelope: memoryview, scratch: memoryview) -> Iterator[tuple[int, int, memoryview]]:
        n, seg = envelope.nbytes, scratch.nbytes
        for a in range(0, n, seg):
            b = min(a + seg, n)
            part = scratch[: b - a]
            part[:] = envelope[a:b]
            yield a, b, part

    def iter_segments_into(
        self, keys: Any, ctx: Any, envelope: memoryview, targets: Callable[[int, int], Sequence[memoryview | int]],
        scratch: memoryview,
    ) -> Iterator[tuple[int, int]]:
        """Each segment copied straight into its targets (one copy, as the cipher decrypts in place)."""
        n, seg = envelope.nbytes, scratch.nbytes
        for a in range(0, n, seg):
            b = min(a + seg, n)
            pos = a
            for t in targets(a, b):
                if isinstance(t, int):
                    pos += t
                    continue
                t[:] = envelope[pos : pos + t.nbytes]
                pos += t.nbytes
            yield a, b

    def seal_into(self, keys: Any, ctx: Any, plain: memoryview, out: memoryview) -> int:
        out[: plain.nbytes] = plain
        return plain.nbytes

    def open_into(self, keys: Any, ctx: Any, envelope: memoryview, out: memoryview) -> int:
        if envelope.nbytes != out.nbytes:
            raise DecryptionFailed
        out[:] = envelope
        return out.nbytes
