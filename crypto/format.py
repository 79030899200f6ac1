"""The chunk envelope's format v1: constants, the context bound into every segment, the header.

    header  = b"KVG" | version u8 (=1) | key_version u32 | salt 32 bytes
              | segment_count u32 | segment_bytes u32 | plaintext_len u64        (56 bytes)
    body    = for i in range(segment_count): ciphertext_i || tag_i (16 bytes)

``segment_count = max(1, ceil(plaintext_len / segment_bytes))``. How segments are keyed, numbered
and authenticated is ``crypto.segments``; sealing and opening is ``crypto.envelope``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crypto.aead import TAG_BYTES
from crypto.errors import DecryptionFailed, InvalidParameter

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_SEGMENTS",
    "MAX_SEGMENT_BYTES",
    "MIN_BINDING_SECRET_BYTES",
    "SALT_BYTES",
    "VERSION",
    "EnvelopeContext",
    "EnvelopeHeader",
    "check_segment_bytes",
    "envelope_size",
    "flat_view",
    "peek_key_version",
    "plaintext_length",
    "read_header",
    "segment_count",
    "segment_scratch_bytes",
]

MAGIC = b"KVG"
VERSION = 1
SALT_BYTES = 32
DEFAULT_SEGMENT_BYTES = 2 * 1024 * 1024
MAX_SEGMENT_BYTES = 1 << 30
MAX_SEGMENTS = 0xFFFFFFFF
MIN_BINDING_SECRET_BYTES = 16
_MAX_U32 = 0xFFFFFFFF
_CONTEXT_LABEL = b"kvgate/chunk-context/v1"
_HEADER = struct.Struct(">3sBI32sIIQ")
_U32 = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True, slots=True)
class EnvelopeContext:
    """Where a chunk belongs; bound into every segment's AAD."""

    tenant: str
    namespace: str
    storage_key: str
    model_fingerprint: str
    key_version: int
    _aad: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tenant", "namespace", "storage_key", "model_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidParameter(f"EnvelopeContext.{name} must be a non-empty str")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidParameter(f"EnvelopeContext.{name} is not valid UTF-8") from None
        kv = self.key_version
        if isinstance(kv, bool) or not isinstance(kv, int) or not 0 <= kv <= _MAX_U32:
            raise InvalidParameter("EnvelopeContext.key_version must be an int in [0, 2**32)")
        object.__setattr__(self, "_aad", self._encode())

    def aad(self) -> bytes:
        """Canonical bytes: a label, each text field as u32 length || UTF-8, u32 key_version."""
        return self._aad

    def _encode(self) -> bytes:
        parts = [_CONTEXT_LABEL]
        for value in (self.tenant, self.namespace, self.storage_key, self.model_fingerprint):
            encoded = value.encode("utf-8")
            parts.append(_U32.pack(len(encoded)))
            parts.append(encoded)
        parts.append(_U32.pack(self.key_version))
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class EnvelopeHeader:
    """A parsed, size-checked (not yet authenticated) envelope header."""

    key_version: int
    salt: bytes
    segment_count: int
    segment_bytes: int
    plaintext_length: int

    @property
    def envelope_length(self) -> int:
        return HEADER_BYTES + self.plaintext_length + TAG_BYTES * self.segment_count

    def pack(self) -> bytes:
        """The header's 56 bytes."""
        return _HEADER.pack(
            MAGIC, VERSION, self.key_version, self.salt, self.segment_count, self.segment_bytes,
            self.plaintext_length,
        )


def segment_count(plaintext_len: int, segment_bytes: int) -> int:
    """Segments of a ``plaintext_len``-byte plaintext (at least one: every envelope has a tag)."""
    return max(1, -(-plaintext_len // segment_bytes))


def check_segment_bytes(segment_bytes: object) -> int:
    """``segment_bytes`` if it is an int in [1, MAX_SEGMENT_BYTES]; ``InvalidParameter`` if not."""
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int):
        raise InvalidParameter("segment_bytes must be an int")
    if not 1 <= segment_bytes <= MAX_SEGMENT_BYTES:
        raise InvalidParameter(f"segment_bytes must be in [1, {MAX_SEGMENT_BYTES}]")
    return segment_bytes


def envelope_size(plaintext_len: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Bytes of the envelope of a ``plaintext_len``-byte plaintext."""
    if plaintext_len < 0 or not 1 <= segment_bytes <= MAX_SEGMENT_BYTES:
        raise InvalidParameter("plaintext_len must be >= 0 and segment_bytes in [1, 2**30]")
    return HEADER_BYTES + plaintext_len + TAG_BYTES * segment_count(plaintext_len, segment_bytes)


def read_header(envelope: Buffer) -> EnvelopeHeader:
    """Parse and size-check the header; ``DecryptionFailed`` on anything malformed."""
    try:
        view = memoryview(envelope)
    except TypeError:
        raise DecryptionFailed from None
    with view:
        size = view.nbytes
        if size < HEADER_BYTES or not view.c_contiguous:
            raise DecryptionFailed
        with view.cast("B") as flat:
            magic, version, key_version, salt, count, seg_bytes, pt_len = _HEADER.unpack_from(flat)
    if magic != MAGIC or version != VERSION or not 1 <= seg_bytes <= MAX_SEGMENT_BYTES:
        raise DecryptionFailed
    if count != segment_count(pt_len, seg_bytes):
        raise DecryptionFailed
    header = EnvelopeHeader(key_version, salt, count, seg_bytes, pt_len)
    if header.envelope_length != size:
        raise DecryptionFailed
    return header


def peek_key_version(envelope: Buffer) -> int:
    """The DEK version an envelope claims (unauthenticated: only to choose the key)."""
    return read_header(envelope).key_version


def plaintext_length(envelope: Buffer) -> int:
    """Plaintext bytes the envelope holds (never more than ``len(envelope)``)."""
    return read_header(envelope).plaintext_length


def segment_scratch_bytes(envelope: Buffer) -> int:
    """Bytes of scratch ``ChunkCipher.open_segments`` needs for this envelope (its largest
    segment, from the size-checked header; ``DecryptionFailed`` if the header is malformed)."""
    header = read_header(envelope)
    return min(header.segment_bytes, header.plaintext_length)


def flat_view(buf: Buffer, *, writable: bool, what: str) -> memoryview:
    """``buf`` as a flat byte view; ``InvalidParameter`` unless C-contiguous (and writable)."""
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidParameter(f"{what} must support the buffer protocol") from None
    if not view.c_contiguous or (writable and view.readonly):
        view.release()
        kind = "a writable, C-contiguous" if writable else "a C-contiguous"
        raise InvalidParameter(f"{what} must be {kind} buffer")
    return view.cast("B")
