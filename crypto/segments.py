"""The segment plan of an envelope: its key schedule, and the one loop over its segments.

Key schedule. Per envelope a fresh random 256-bit ``salt``; the segment key is
``HKDF-SHA256(ikm = dek || binding_secret, salt, info = b"kvgate/chunk/v1", length 32)``.
Segment ``i`` uses the 96-bit nonce ``i`` (big-endian) and the AAD ``header || ctx.aad() || u32 i
|| u32 segment_count``, so a segment dropped, reordered, duplicated or moved to another envelope
(or tenant, namespace, storage key, model or key version) fails authentication.

Key sources (``EnvelopeKeys``), same bytes for the same salt: ``DataKey(dek, binding_secret)``
derives any envelope's key (embedded mode, and the server; sealing draws a fresh salt);
``IssuedKey(salt, key)`` is one envelope's key as a server issued it to a remote worker that never
holds the data key: it seals exactly one envelope (with that salt) and opens only one carrying it.
``KeySchedule`` (segment key and ``SegmentPlan``) is what every sealer and opener works from, CPU
or device; ``SegmentPlan.segments`` is the only place that numbers and places segments.
``seal_schedule`` makes a new envelope's schedule; ``open_schedule`` reads an envelope's."""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crypto.aead import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from crypto.errors import DecryptionFailed, InvalidParameter, InvocationLimitReached
from crypto.format import (
    HEADER_BYTES,
    MAX_SEGMENTS,
    MIN_BINDING_SECRET_BYTES,
    SALT_BYTES,
    EnvelopeContext,
    EnvelopeHeader,
    read_header,
    segment_count,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DataKey",
    "EnvelopeKeys",
    "IssuedKey",
    "KeySchedule",
    "Segment",
    "SegmentPlan",
    "derive_segment_key",
    "open_schedule",
    "seal_schedule",
    "segment_nonce",
]

_HKDF_INFO = b"kvgate/chunk/v1"
_SEGMENT_AAD = struct.Struct(">II")


def segment_nonce(index: int) -> bytes:
    """The 96-bit nonce of segment ``index``."""
    return index.to_bytes(NONCE_BYTES, "big")


@dataclass(frozen=True, slots=True)
class Segment:
    """Segment ``index``: plaintext bytes ``[start, end)``; its ciphertext at envelope offset
    ``offset`` (``end - start`` bytes), its tag right after (``tag_offset``, 16 bytes)."""

    index: int
    start: int
    end: int
    offset: int
    nonce: bytes
    aad: bytes

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def tag_offset(self) -> int:
        return self.offset + self.end - self.start

    @property
    def sealed_end(self) -> int:
        """End of ciphertext || tag in the envelope."""
        return self.offset + self.end - self.start + TAG_BYTES


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Where each segment of one envelope lies and what authenticates it."""

    header: EnvelopeHeader
    header_bytes: bytes
    aad_prefix: bytes

    @property
    def plaintext_length(self) -> int:
        return self.header.plaintext_length

    @property
    def segment_count(self) -> int:
        return self.header.segment_count

    @property
    def envelope_length(self) -> int:
        return self.header.envelope_length

    @property
    def scratch_bytes(self) -> int:
        """The largest segment's plaintext size."""
        return min(self.header.segment_bytes, self.header.plaintext_length)

    def segments(self) -> Iterator[Segment]:
        """Every segment, in order (the one segment loop of the format)."""
        seg, pt_len, count = self.header.segment_bytes, self.header.plaintext_length, self.header.segment_count
        prefix, pack = self.aad_prefix, _SEGMENT_AAD.pack
        for i in range(count):
            start = i * seg
            yield Segment(
                i, start, min(start + seg, pt_len), HEADER_BYTES + start + i * TAG_BYTES,
                segment_nonce(i), prefix + pack(i, count),
            )


@dataclass(frozen=True, slots=True)
class KeySchedule:
    """One envelope's segment key and plan (``repr`` hides the key)."""

    key: bytes = field(repr=False)
    plan: SegmentPlan


def derive_segment_key(dek: bytes, binding_secret: bytes, salt: bytes) -> bytes:
    """The envelope's AES-256 key: HKDF-SHA256 over ``dek || binding_secret`` with ``salt``."""
    if len(dek) != KEY_BYTES:
        raise InvalidParameter(f"dek must be {KEY_BYTES} bytes, got {len(dek)}")
    if len(binding_secret) < MIN_BINDING_SECRET_BYTES:
        raise InvalidParameter(f"binding_secret must be at least {MIN_BINDING_SECRET_BYTES} bytes")
    if len(salt) != SALT_BYTES:
        raise InvalidParameter(f"salt must be {SALT_BYTES} bytes")
    hkdf = HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=salt, info=_HKDF_INFO)
    return hkdf.derive(bytes(dek) + bytes(binding_secret))


class EnvelopeKeys(Protocol):
    """Where an envelope's salt and segment key come from (``DataKey``, ``IssuedKey``)."""

    def sealing_key(self, salt_source: Callable[[int], bytes]) -> tuple[bytes, bytes]:
        """``(salt, segment key)`` of a new envelope; ``salt_source`` draws a salt where one is drawn."""
        ...

    def opening_key(self, salt: bytes) -> bytes:
        """The segment key of the envelope whose header carries ``salt`` (``DecryptionFailed``
        where this source cannot open it)."""
        ...


@dataclass(frozen=True, slots=True)
class DataKey:
    """The tenant's data key and the namespace binding secret: derives every envelope's key
    (``repr`` hides both)."""

    dek: bytes = field(repr=False)
    binding_secret: bytes = field(repr=False)

    def sealing_key(self, salt_source: Callable[[int], bytes]) -> tuple[bytes, bytes]:
        salt = salt_source(SALT_BYTES)
        if not isinstance(salt, bytes) or len(salt) != SALT_BYTES:
            raise InvalidParameter(f"salt_source must return {SALT_BYTES} bytes")
        return salt, derive_segment_key(self.dek, self.binding_secret, salt)

    def opening_key(self, salt: bytes) -> bytes:
        return derive_segment_key(self.dek, self.binding_secret, salt)


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """One envelope's salt and segment key, issued by a kvgate server (``repr`` hides the key).
    It seals one envelope with its own salt and opens only an envelope that carries that salt."""

    salt: bytes
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.salt, bytes) or len(self.salt) != SALT_BYTES:
            raise InvalidParameter(f"an issued salt is {SALT_BYTES} bytes")
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise InvalidParameter(f"an issued key is {KEY_BYTES} bytes")

    def sealing_key(self, salt_source: Callable[[int], bytes]) -> tuple[bytes, bytes]:
        return self.salt, self.key

    def opening_key(self, salt: bytes) -> bytes:
        if not hmac.compare_digest(salt, self.salt):
            raise DecryptionFailed
        return self.key


def seal_schedule(
    keys: EnvelopeKeys,
    ctx: EnvelopeContext,
    plaintext_len: int,
    segment_bytes: int,
    salt_source: Callable[[int], bytes],
) -> KeySchedule:
    """The schedule of a new envelope (``segment_bytes`` already checked); ``keys`` gives its salt."""
    count = segment_count(plaintext_len, segment_bytes)
    if count > MAX_SEGMENTS:
        raise InvocationLimitReached("plaintext needs more than 2**32 - 1 segments")
    salt, key = keys.sealing_key(salt_source)
    header = EnvelopeHeader(ctx.key_version, salt, count, segment_bytes, plaintext_len)
    raw = header.pack()
    return KeySchedule(key, SegmentPlan(header, raw, raw + ctx.aad()))


def open_schedule(keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: Buffer) -> KeySchedule:
    """The schedule of an existing envelope: its header size-checked and its key version matched
    against ``ctx`` (``DecryptionFailed`` otherwise)."""
    header = read_header(envelope)
    if header.key_version != ctx.key_version:
        raise DecryptionFailed
    key = keys.opening_key(header.salt)
    with memoryview(envelope) as view, view.cast("B") as flat:
        raw = bytes(flat[:HEADER_BYTES])
    return KeySchedule(key, SegmentPlan(header, raw, raw + ctx.aad()))
