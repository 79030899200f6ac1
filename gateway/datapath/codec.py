"""The envelope codec the data path seals and opens with: the seam between the data path's
byte movement (gather, scatter, staging, threads) and the chunk envelope format.

``CipherCodec`` is the product's one codec: AES-256-GCM envelopes (``crypto.envelope``) with the
AAD binding tenant, namespace, storage key, model and key version. The data path takes any object
that meets ``EnvelopeCodec``; a benchmark baseline passes its own (``gateway/bench/``) to the
same constructors. There is no switch in the product that turns encryption off.

Keys reach the codec as one ``crypto.segments.EnvelopeKeys`` per envelope: a ``DataKey`` (DEK and
namespace binding secret, embedded mode) or an ``IssuedKey`` (the salt and segment key a kvgate
server issued for that one envelope, remote mode). ``key_ref`` reads what an envelope was sealed
under (key version and salt) from its header, so the keys to open it can be asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from crypto.envelope import (
    MAX_SEGMENT_BYTES,
    ChunkCipher,
    EnvelopeContext,
    EnvelopeKeys,
    plaintext_length,
    read_header,
    segment_scratch_bytes,
)

__all__ = ["CipherCodec", "EnvelopeCodec", "KeyRef", "Targets", "codec_of", "layer_segment_bytes"]

KeyRef = tuple[int, bytes]
"""``(key version, salt)`` an envelope's header names (unauthenticated: only to ask for its key)."""

OnSegment = Callable[[int, int, memoryview], None]
Targets = Callable[[int, int], Sequence[memoryview | int]]
"""``targets(start, end)``: where plaintext bytes ``[start, end)`` go, as writable byte views (or
counts of bytes to authenticate and drop) that concatenate to that range."""


class EnvelopeCodec(Protocol):
    """What the data path needs of an envelope format. Every failure raises
    ``crypto.errors.DecryptionFailed``; nothing of a segment is delivered before it is authentic."""

    @property
    def cipher(self) -> ChunkCipher | None:
        """The AES-GCM cipher itself, which the device path (encrypt where the KV lives) needs;
        None for a codec without one."""

    @property
    def segment_bytes(self) -> int: ...
    def envelope_size(self, plaintext_len: int, segment_bytes: int | None = None) -> int: ...
    def key_ref(self, envelope: memoryview) -> KeyRef | None:
        """The data-key version and salt the envelope was sealed with; None: it needs no key.
        ``DecryptionFailed`` if its header is malformed."""
    def plaintext_length(self, envelope: memoryview) -> int: ...
    def scratch_bytes(self, envelope: memoryview) -> int: ...
    def seal_pieces_into(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, pieces: Sequence[memoryview], n: int,
        out: memoryview, *, segment_bytes: int,
    ) -> int: ...
    def open_segments(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, scratch: memoryview,
        on_segment: OnSegment,
    ) -> int: ...
    def iter_segments(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, scratch: memoryview
    ) -> Iterator[tuple[int, int, memoryview]]:
        """``open_segments`` as a generator (a layer-wise load interleaves envelopes)."""
    def iter_segments_into(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, targets: Targets, scratch: memoryview
    ) -> Iterator[tuple[int, int]]:
        """Open each segment straight into ``targets(start, end)`` (``ChunkCipher.iter_segments_into``):
        a segment's ``(start, end)`` comes once it is authentic, and one that fails leaves
        nothing of itself in its targets. ``scratch``: ``scratch_bytes`` of the envelope."""
    def seal_into(self, keys: EnvelopeKeys, ctx: EnvelopeContext, plain: memoryview, out: memoryview) -> int: ...
    def open_into(self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, out: memoryview) -> int: ...


class CipherCodec:
    """AES-256-GCM chunk envelopes (format v1) through ``ChunkCipher``."""

    __slots__ = ("cipher",)

    def __init__(self, cipher: ChunkCipher) -> None:
        self.cipher = cipher

    @property
    def segment_bytes(self) -> int:
        return self.cipher.segment_bytes

    def envelope_size(self, plaintext_len: int, segment_bytes: int | None = None) -> int:
        return self.cipher.envelope_size(plaintext_len, segment_bytes)

    def key_ref(self, envelope: memoryview) -> KeyRef:
        header = read_header(envelope)
        return header.key_version, header.salt

    def plaintext_length(self, envelope: memoryview) -> int:
        return plaintext_length(envelope)

    def scratch_bytes(self, envelope: memoryview) -> int:
        return segment_scratch_bytes(envelope)

    def seal_pieces_into(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, pieces: Sequence[memoryview], n: int,
        out: memoryview, *, segment_bytes: int,
    ) -> int:
        return self.cipher.seal_pieces_into(keys, ctx, pieces, n, out, segment_bytes=segment_bytes)

    def open_segments(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, scratch: memoryview,
        on_segment: OnSegment,
    ) -> int:
        return self.cipher.open_segments(keys, ctx, envelope, scratch, on_segment)

    def iter_segments(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, scratch: memoryview
    ) -> Iterator[tuple[int, int, memoryview]]:
        return self.cipher.iter_segments(keys, ctx, envelope, scratch)

    def iter_segments_into(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, targets: Targets, scratch: memoryview
    ) -> Iterator[tuple[int, int]]:
        return self.cipher.iter_segments_into(keys, ctx, envelope, targets, scratch)

    def seal_into(self, keys: EnvelopeKeys, ctx: EnvelopeContext, plain: memoryview, out: memoryview) -> int:
        return self.cipher.seal_into(keys, ctx, plain, out)

    def open_into(self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: memoryview, out: memoryview) -> int:
        return self.cipher.open_into(keys, ctx, envelope, out)


def codec_of(cipher_or_codec: ChunkCipher | EnvelopeCodec) -> EnvelopeCodec:
    if isinstance(cipher_or_codec, ChunkCipher):
        return CipherCodec(cipher_or_codec)
    return cipher_or_codec


def layer_segment_bytes(segment_bytes: int, layer_nbytes: int) -> int:
    """A chunk's segment size: ``segment_bytes`` rounded down to whole layers (at least one)."""
    return min(MAX_SEGMENT_BYTES, layer_nbytes * max(1, segment_bytes // layer_nbytes))
