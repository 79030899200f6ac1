"""The chunk envelope: a versioned, context-bound AES-256-GCM recipe, in the spirit of fernet.

Format v1 (big-endian)::

    header  = b"KVG" | version u8 (=1) | key_version u32 | salt 32 bytes
              | segment_count u32 | segment_bytes u32 | plaintext_len u64        (56 bytes)
    body    = for i in range(segment_count): ciphertext_i || tag_i (16 bytes)

Segment ``i`` holds plaintext bytes ``[i*segment_bytes, (i+1)*segment_bytes)`` (the last one may be
shorter). ``segment_count = max(1, ceil(plaintext_len / segment_bytes))``: an empty plaintext still
has one segment, so every envelope carries at least one tag.

Key schedule. Per envelope a fresh random 256-bit ``salt``; the segment key is
``HKDF-SHA256(ikm = dek || binding_secret, salt, info = b"kvgate/chunk/v1", length 32)`` and segment
``i`` uses the 96-bit nonce ``i`` (big-endian). ``binding_secret`` is an opaque per-namespace
secret, so destroying either the tenant's DEK version or the namespace secret crypto-shreds the
chunk.

Why a key per envelope rather than one DEK and a nonce counter (DESIGN 2.4): nonces must never
repeat under one key across threads, processes, restarts and replicas. A counter needs state shared
by all of them, and a random per-process prefix is not enough (birthday collisions over many
restarts). Deriving a fresh key from a 256-bit random salt carried in the envelope (as the AWS
Encryption SDK does) needs no shared state: two envelopes share a segment key only if their salts
collide (probability ~ n^2 / 2^257), and within one envelope the nonces 0, 1, 2 ... are distinct by
construction, at most 2^32 - 1 of them, far below NIST SP 800-38D's bounds per key.

AAD of segment ``i`` = header || ``ctx.aad()`` || u32 i || u32 segment_count, where ``ctx`` is the
``EnvelopeContext`` (tenant, namespace, storage key, model fingerprint, key version). A chunk copied
to another key, tenant, namespace or model, or a segment dropped, reordered, duplicated or moved to
another envelope fails authentication. Every failure is the one ``DecryptionFailed``.

Buffers: ``seal_into``/``open_into`` write into caller-owned buffers; the payload is touched only by
the AEAD and per-call work is a few small objects per segment. Header lengths are checked against
the envelope's actual size before anything is allocated or decrypted.

Fused data path (same format, same bytes):

- ``seal_pieces_into`` seals the concatenation of a list of buffers (a chunk's contiguous runs
  straight out of a paged KV cache) without gathering them first: with the default CPU AEAD each
  segment is one streaming GCM operation of ``cryptography`` (``update_into`` per piece), which is
  bit-identical to ``AESGCM`` over the joined bytes. Other AEADs get each segment gathered into a
  segment-sized buffer first.
- ``open_segments`` verifies and decrypts one segment at a time into a small caller-owned scratch
  buffer and hands each verified segment to a callback, so the caller can scatter it while it is
  still in cache. Every segment is authenticated on its own and bound to its index and the segment
  count, so the segments delivered before a failure are authentic.
- ``seal_into``/``seal_pieces_into`` take an optional per-envelope ``segment_bytes`` (the header
  carries it, so opening needs nothing new).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crypto.aead import (
    KEY_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    Aead,
    AeadFactory,
    CpuAesGcm,
    wipe,
)
from crypto.errors import DecryptionFailed, InvalidParameter, InvocationLimitReached

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from crypto.aead import WritableBuffer

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_SEGMENT_BYTES",
    "MIN_BINDING_SECRET_BYTES",
    "SALT_BYTES",
    "VERSION",
    "ChunkCipher",
    "EnvelopeContext",
    "EnvelopeHeader",
    "envelope_size",
    "peek_key_version",
    "plaintext_length",
    "read_header",
    "segment_scratch_bytes",
]

MAGIC = b"KVG"
VERSION = 1
SALT_BYTES = 32
DEFAULT_SEGMENT_BYTES = 2 * 1024 * 1024
MAX_SEGMENT_BYTES = 1 << 30
MIN_BINDING_SECRET_BYTES = 16
_MAX_U32 = 0xFFFFFFFF
_HKDF_INFO = b"kvgate/chunk/v1"
_CONTEXT_LABEL = b"kvgate/chunk-context/v1"
_HEADER = struct.Struct(">3sBI32sIIQ")
_U32 = struct.Struct(">I")
_SEGMENT_AAD = struct.Struct(">II")
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


def _segments_for(plaintext_len: int, segment_bytes: int) -> int:
    return max(1, -(-plaintext_len // segment_bytes))


def envelope_size(plaintext_len: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Bytes of the envelope of a ``plaintext_len``-byte plaintext."""
    if plaintext_len < 0 or not 1 <= segment_bytes <= MAX_SEGMENT_BYTES:
        raise InvalidParameter("plaintext_len must be >= 0 and segment_bytes in [1, 2**30]")
    return HEADER_BYTES + plaintext_len + TAG_BYTES * _segments_for(plaintext_len, segment_bytes)


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
    if count != _segments_for(pt_len, seg_bytes):
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


def _nonce(index: int) -> bytes:
    return index.to_bytes(NONCE_BYTES, "big")


def _flat_view(buf: Buffer, *, writable: bool, what: str) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidParameter(f"{what} must support the buffer protocol") from None
    if not view.c_contiguous or (writable and view.readonly):
        view.release()
        kind = "a writable, C-contiguous" if writable else "a C-contiguous"
        raise InvalidParameter(f"{what} must be {kind} buffer")
    return view.cast("B")


class ChunkCipher:
    """Seals and opens chunk envelopes (format v1) with an injectable AEAD and salt source."""

    __slots__ = ("_aead_factory", "_salt_source", "_segment_bytes")

    def __init__(
        self,
        aead_factory: AeadFactory = CpuAesGcm,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        salt_source: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int):
            raise InvalidParameter("segment_bytes must be an int")
        if not 1 <= segment_bytes <= MAX_SEGMENT_BYTES:
            raise InvalidParameter(f"segment_bytes must be in [1, {MAX_SEGMENT_BYTES}]")
        self._aead_factory = aead_factory
        self._segment_bytes = segment_bytes
        self._salt_source = salt_source

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    def with_aead(self, aead_factory: AeadFactory) -> ChunkCipher:
        """This cipher over another AEAD (a device's): same segment size and salt source."""
        return ChunkCipher(aead_factory, segment_bytes=self._segment_bytes, salt_source=self._salt_source)

    def envelope_size(self, plaintext_len: int, segment_bytes: int | None = None) -> int:
        """Bytes of the envelope of ``plaintext_len`` bytes (``segment_bytes``: the override)."""
        return envelope_size(plaintext_len, self._segment_size(segment_bytes))

    def _segment_size(self, segment_bytes: int | None) -> int:
        if segment_bytes is None:
            return self._segment_bytes
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int):
            raise InvalidParameter("segment_bytes must be an int")
        if not 1 <= segment_bytes <= MAX_SEGMENT_BYTES:
            raise InvalidParameter(f"segment_bytes must be in [1, {MAX_SEGMENT_BYTES}]")
        return segment_bytes

    def _begin(
        self, dek: bytes, binding_secret: bytes, ctx: EnvelopeContext, pt_len: int, seg: int
    ) -> tuple[bytes, bytes, bytes, int, int]:
        """(segment key, header, AAD prefix, segment count, envelope size) of a new envelope."""
        count = _segments_for(pt_len, seg)
        if count > _MAX_U32:
            raise InvocationLimitReached("plaintext needs more than 2**32 - 1 segments")
        size = HEADER_BYTES + pt_len + TAG_BYTES * count
        salt = self._salt_source(SALT_BYTES)
        if not isinstance(salt, bytes) or len(salt) != SALT_BYTES:
            raise InvalidParameter(f"salt_source must return {SALT_BYTES} bytes")
        key = self._segment_key(dek, binding_secret, salt)
        header = _HEADER.pack(MAGIC, VERSION, ctx.key_version, salt, count, seg, pt_len)
        return key, header, header + ctx.aad(), count, size

    def _segment_key(self, dek: bytes, binding_secret: bytes, salt: bytes) -> bytes:
        if len(dek) != KEY_BYTES:
            raise InvalidParameter(f"dek must be {KEY_BYTES} bytes, got {len(dek)}")
        if len(binding_secret) < MIN_BINDING_SECRET_BYTES:
            raise InvalidParameter(
                f"binding_secret must be at least {MIN_BINDING_SECRET_BYTES} bytes"
            )
        hkdf = HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=salt, info=_HKDF_INFO)
        return hkdf.derive(bytes(dek) + bytes(binding_secret))

    def seal_into(
        self,
        dek: bytes,
        binding_secret: bytes,
        ctx: EnvelopeContext,
        plaintext: Buffer,
        out: WritableBuffer,
        *,
        segment_bytes: int | None = None,
    ) -> int:
        """Write the envelope of ``plaintext`` into ``out[:n]`` and return ``n``.

        ``out`` must hold ``envelope_size(len(plaintext), segment_bytes)`` bytes and not overlap
        ``plaintext``. ``segment_bytes`` overrides the cipher's segment size for this envelope.
        """
        seg = self._segment_size(segment_bytes)
        with _flat_view(plaintext, writable=False, what="plaintext") as pt:
            pt_len = pt.nbytes
            key, header, prefix, count, size = self._begin(dek, binding_secret, ctx, pt_len, seg)
            aead = self._aead_factory(key)
            with _flat_view(out, writable=True, what="out") as dst:
                if dst.nbytes < size:
                    raise InvalidParameter(f"out must hold {size} bytes, has {dst.nbytes}")
                dst[:HEADER_BYTES] = header
                src_pos, dst_pos = 0, HEADER_BYTES
                for i in range(count):
                    n = min(seg, pt_len - src_pos)
                    aead.seal_into(
                        _nonce(i),
                        pt[src_pos : src_pos + n],
                        prefix + _SEGMENT_AAD.pack(i, count),
                        dst[dst_pos : dst_pos + n + TAG_BYTES],
                    )
                    src_pos += n
                    dst_pos += n + TAG_BYTES
        return size

    def seal_device_into(self, dek, binding_secret, ctx, plaintext, plaintext_len, out, *, to_host, segment_bytes=None) -> int:  # type: ignore[no-untyped-def]
        """Seal a device-resident plaintext in place with an in-place AEAD; see crypto._device."""
        from crypto._device import seal_device_into

        return seal_device_into(
            self, dek, binding_secret, ctx, plaintext, plaintext_len, out, to_host=to_host, segment_bytes=segment_bytes
        )

    def open_device_into(self, dek, binding_secret, ctx, envelope, out, *, to_device, zero) -> int:  # type: ignore[no-untyped-def]
        """Open an envelope into a device buffer, decrypting there; see crypto._device."""
        from crypto._device import open_device_into

        return open_device_into(self, dek, binding_secret, ctx, envelope, out, to_device=to_device, zero=zero)

    def seal_device_fused(self, dek, binding_secret, ctx, plaintext_len, out, *, encrypt, to_host, segment_bytes=None) -> int:  # type: ignore[no-untyped-def]
        """Seal a chunk the device gathers and encrypts in one pass; see crypto._device."""
        from crypto._device import seal_device_fused

        return seal_device_fused(
            self, dek, binding_secret, ctx, plaintext_len, out, encrypt=encrypt, to_host=to_host, segment_bytes=segment_bytes
        )

    def open_device_fused(self, dek, binding_secret, ctx, envelope, *, to_device, decrypt) -> int:  # type: ignore[no-untyped-def]
        """Open an envelope the device checks whole, then decrypts and scatters; see crypto._device."""
        from crypto._device import open_device_fused

        return open_device_fused(self, dek, binding_secret, ctx, envelope, to_device=to_device, decrypt=decrypt)

    def seal(
        self, dek: bytes, binding_secret: bytes, ctx: EnvelopeContext, plaintext: Buffer
    ) -> bytearray:
        """Allocate the envelope once and seal into it."""
        with _flat_view(plaintext, writable=False, what="plaintext") as pt:
            out = bytearray(self.envelope_size(pt.nbytes))
            self.seal_into(dek, binding_secret, ctx, pt, out)
        return out

    def open_into(
        self,
        dek: bytes,
        binding_secret: bytes,
        ctx: EnvelopeContext,
        envelope: Buffer,
        out: WritableBuffer,
    ) -> int:
        """Verify every segment, write the plaintext into ``out[:n]`` and return ``n``.

        ``out`` must hold ``plaintext_length(envelope)`` bytes. On ``DecryptionFailed`` nothing of
        the plaintext is left in ``out``.
        """
        header = read_header(envelope)
        if header.key_version != ctx.key_version:
            raise DecryptionFailed
        key = self._segment_key(dek, binding_secret, header.salt)
        ok = self._open_segments(key, header, ctx, envelope, out)
        if not ok:  # raised here, outside any handler, so no buffer view survives in a traceback
            raise DecryptionFailed
        return header.plaintext_length

    def _open_segments(
        self,
        key: bytes,
        header: EnvelopeHeader,
        ctx: EnvelopeContext,
        envelope: Buffer,
        out: WritableBuffer,
    ) -> bool:
        pt_len, seg, count = header.plaintext_length, header.segment_bytes, header.segment_count
        with (
            _flat_view(envelope, writable=False, what="envelope") as src,
            _flat_view(out, writable=True, what="out") as dst,
        ):
            if dst.nbytes < pt_len:
                raise InvalidParameter(f"out must hold {pt_len} bytes, has {dst.nbytes}")
            aead = self._aead_factory(key)
            prefix = bytes(src[:HEADER_BYTES]) + ctx.aad()
            src_pos, dst_pos = HEADER_BYTES, 0
            try:
                for i in range(count):
                    n = min(seg, pt_len - dst_pos)
                    aead.open_into(
                        _nonce(i),
                        src[src_pos : src_pos + n + TAG_BYTES],
                        prefix + _SEGMENT_AAD.pack(i, count),
                        dst[dst_pos : dst_pos + n],
                    )
                    src_pos += n + TAG_BYTES
                    dst_pos += n
            except DecryptionFailed:
                wipe(dst[:pt_len])
                return False
            except BaseException:
                wipe(dst[:pt_len])
                raise
        return True

    def open(
        self, dek: bytes, binding_secret: bytes, ctx: EnvelopeContext, envelope: Buffer
    ) -> bytearray:
        """Allocate the plaintext once (sized from the checked header) and open into it."""
        out = bytearray(plaintext_length(envelope))
        self.open_into(dek, binding_secret, ctx, envelope, out)
        return out

    # -- the fused data path -----------------------------------------------------------------

    def seal_pieces_into(
        self,
        dek: bytes,
        binding_secret: bytes,
        ctx: EnvelopeContext,
        pieces: Sequence[Buffer],
        plaintext_len: int,
        out: WritableBuffer,
        *,
        segment_bytes: int | None = None,
    ) -> int:
        """``seal_into`` of ``b"".join(pieces)`` without joining them: the same envelope, byte for
        byte (one salt drawn the same way; a piece across a segment boundary is split).

        ``plaintext_len`` must equal the pieces' total size (checked before anything is written).
        ``out`` must hold ``envelope_size(plaintext_len, segment_bytes)`` bytes and overlap no
        piece. Returns the envelope's size."""
        seg = self._segment_size(segment_bytes)
        views = _piece_views(pieces, plaintext_len)
        key, header, prefix, count, size = self._begin(dek, binding_secret, ctx, plaintext_len, seg)
        with _flat_view(out, writable=True, what="out") as dst:
            if dst.nbytes < size:
                raise InvalidParameter(f"out must hold {size} bytes, has {dst.nbytes}")
            dst[:HEADER_BYTES] = header
            ok = False
            try:
                if self._aead_factory is CpuAesGcm:
                    _seal_streaming(key, prefix, count, seg, plaintext_len, views, dst)
                else:
                    _seal_gathered(self._aead_factory(key), prefix, count, seg, plaintext_len, views, dst)
                ok = True
            except (ValueError, TypeError, OverflowError):  # cryptography refusing a buffer
                pass
            finally:
                if not ok:
                    wipe(dst[:size])
            if not ok:  # raised outside the handler: no library exception chained to ours
                raise InvalidParameter("cannot seal the pieces (a piece overlaps out, or is not a byte buffer)")
        return size

    def open_segments(
        self,
        dek: bytes,
        binding_secret: bytes,
        ctx: EnvelopeContext,
        envelope: Buffer,
        scratch: WritableBuffer,
        on_segment: Callable[[int, int, memoryview], None],
    ) -> int:
        """Verify and decrypt the envelope one segment at a time into ``scratch``; return the
        plaintext length.

        After segment ``i``'s tag checked, ``on_segment(start, end, view)`` gets the plaintext
        bytes ``[start, end)`` in ``view`` (a view of ``scratch``, valid only during the call).
        ``scratch`` must hold ``min(segment_bytes, plaintext_len)`` bytes (``segment_scratch_bytes``).
        On ``DecryptionFailed`` the segments before the failing one have been delivered (each is
        authenticated on its own, bound to its index and the count) and ``scratch`` is zeroed; an
        exception from ``on_segment`` also zeroes ``scratch`` and propagates."""
        header = read_header(envelope)
        if header.key_version != ctx.key_version:
            raise DecryptionFailed
        key = self._segment_key(dek, binding_secret, header.salt)
        ok = self._open_each(key, header, ctx, envelope, scratch, on_segment)
        if not ok:  # raised here, outside any handler, so no buffer view survives in a traceback
            raise DecryptionFailed
        return header.plaintext_length

    def _open_each(
        self,
        key: bytes,
        header: EnvelopeHeader,
        ctx: EnvelopeContext,
        envelope: Buffer,
        scratch: WritableBuffer,
        on_segment: Callable[[int, int, memoryview], None],
    ) -> bool:
        pt_len, seg, count = header.plaintext_length, header.segment_bytes, header.segment_count
        need = min(seg, pt_len)
        with (
            _flat_view(envelope, writable=False, what="envelope") as src,
            _flat_view(scratch, writable=True, what="scratch") as dst,
        ):
            if dst.nbytes < need:
                raise InvalidParameter(f"scratch must hold {need} bytes, has {dst.nbytes}")
            aead = self._aead_factory(key)
            prefix = bytes(src[:HEADER_BYTES]) + ctx.aad()
            src_pos, start = HEADER_BYTES, 0
            try:
                for i in range(count):
                    n = min(seg, pt_len - start)
                    part = dst[:n]
                    aead.open_into(
                        _nonce(i),
                        src[src_pos : src_pos + n + TAG_BYTES],
                        prefix + _SEGMENT_AAD.pack(i, count),
                        part,
                    )
                    on_segment(start, start + n, part)
                    src_pos += n + TAG_BYTES
                    start += n
            except DecryptionFailed:
                wipe(dst[:need])
                return False
            except BaseException:
                wipe(dst[:need])
                raise
        return True


def segment_scratch_bytes(envelope: Buffer) -> int:
    """Bytes of scratch ``ChunkCipher.open_segments`` needs for this envelope (its largest
    segment, from the size-checked header; ``DecryptionFailed`` if the header is malformed)."""
    header = read_header(envelope)
    return min(header.segment_bytes, header.plaintext_length)


def _piece_views(pieces: Sequence[Buffer], plaintext_len: int) -> list[memoryview]:
    """The non-empty pieces as flat byte views; their total must be ``plaintext_len``."""
    if isinstance(plaintext_len, bool) or not isinstance(plaintext_len, int) or plaintext_len < 0:
        raise InvalidParameter("plaintext_len must be an int >= 0")
    views: list[memoryview] = []
    total = 0
    for p in pieces:
        # fast path: the data path hands over flat byte views already
        if type(p) is memoryview and p.format == "B" and p.ndim == 1 and p.c_contiguous:
            v = p
        else:
            v = _flat_view(p, writable=False, what="each piece")
        if v.nbytes:
            views.append(v)
            total += v.nbytes
    if total != plaintext_len:
        raise InvalidParameter(f"the pieces hold {total} bytes, plaintext_len is {plaintext_len}")
    return views


def _seal_streaming(
    key: bytes, prefix: bytes, count: int, seg: int, pt_len: int, views: list[memoryview], dst: memoryview
) -> None:
    """Each segment as one streaming AES-GCM operation fed piece by piece (bit-identical to
    ``AESGCM`` over the joined segment). ``update_into`` wants 15 bytes of room past its output;
    every segment's ciphertext is followed by its 16-byte tag, written after ``finalize``, so the
    envelope itself has that room. The loop is the hot path (one turn per piece): whole pieces
    go straight through; only a piece across a segment boundary is sliced."""
    aes = algorithms.AES(key)
    vi, off, pos, dst_pos = 0, 0, 0, HEADER_BYTES
    for i in range(count):
        seg_end = min(pos + seg, pt_len)
        enc = Cipher(aes, modes.GCM(_nonce(i))).encryptor()
        enc.authenticate_additional_data(prefix + _SEGMENT_AAD.pack(i, count))
        update = enc.update_into
        while pos < seg_end:
            v = views[vi]
            take = v.nbytes - off
            if off == 0 and pos + take <= seg_end:  # a whole piece
                part = v
                vi += 1
            else:
                take = min(take, seg_end - pos)
                part = v[off : off + take]
                off += take
                if off == v.nbytes:
                    vi, off = vi + 1, 0
            if update(part, dst[dst_pos : dst_pos + take + 15]) != take:
                raise InvalidParameter("the AES-GCM stream did not encrypt a piece whole")
            pos += take
            dst_pos += take
        enc.finalize()
        dst[dst_pos : dst_pos + TAG_BYTES] = enc.tag
        dst_pos += TAG_BYTES


def _seal_gathered(
    aead: Aead, prefix: bytes, count: int, seg: int, pt_len: int, views: list[memoryview], dst: memoryview
) -> None:
    """Any other AEAD: gather each segment into one segment-sized buffer, then seal it."""
    buf = memoryview(bytearray(min(seg, pt_len)))
    vi, off, dst_pos, start = 0, 0, HEADER_BYTES, 0
    for i in range(count):
        n = min(seg, pt_len - start)
        pos = 0
        while pos < n:
            v = views[vi]
            take = min(v.nbytes - off, n - pos)
            buf[pos : pos + take] = v[off : off + take]
            pos += take
            off += take
            if off == v.nbytes:
                vi, off = vi + 1, 0
        aead.seal_into(
            _nonce(i), buf[:n], prefix + _SEGMENT_AAD.pack(i, count), dst[dst_pos : dst_pos + n + TAG_BYTES]
        )
        dst_pos += n + TAG_BYTES
        start += n
    wipe(buf)
