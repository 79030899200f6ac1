"""The chunk envelope: a versioned, context-bound AES-256-GCM recipe, in the spirit of fernet.

The format (header, segments) is ``crypto.format``; the key schedule, nonces, segment AAD and the
one segment loop are ``crypto.segments``. Here: ``ChunkCipher``, which seals and opens. Each
envelope has its own key (HKDF from the DEK and a 256-bit random salt it carries), so nonces never
repeat under a key without shared state; destroying the tenant's DEK version or the namespace
binding secret crypto-shreds the chunk. Every failure is the one ``DecryptionFailed``. Every
method takes an ``EnvelopeKeys``: ``DataKey`` derives each envelope's key, ``IssuedKey`` is one
envelope's key as a server hands it to a remote worker; same salt, same bytes. Header lengths are
checked against the envelope's actual size before anything is allocated or decrypted.
``seal_into``/``open_into`` write into caller-owned buffers; ``seal_pieces_into`` seals a list of
buffers without gathering them; ``open_segments``/``iter_segments`` hand each verified segment on
(segments delivered before a failure are authentic); ``seal_device_*``/``open_device_*``: plaintext
on a device (``crypto._device``). Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.ciphers import algorithms

from crypto import _device
from crypto._pieces import BOUNCE_BYTES, Target, open_gathered, open_streaming, piece_views, seal_gathered, seal_streaming
from crypto.aead import AeadFactory, CpuAesGcm, wipe
from crypto.errors import DecryptionFailed, InvalidParameter
from crypto.format import (
    DEFAULT_SEGMENT_BYTES,
    HEADER_BYTES,
    MAGIC,
    MAX_SEGMENT_BYTES,
    MIN_BINDING_SECRET_BYTES,
    SALT_BYTES,
    VERSION,
    EnvelopeContext,
    EnvelopeHeader,
    check_segment_bytes,
    envelope_size,
    flat_view,
    peek_key_version,
    plaintext_length,
    read_header,
    segment_scratch_bytes,
)
from crypto.segments import DataKey, EnvelopeKeys, IssuedKey, KeySchedule, open_schedule, seal_schedule

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
    "DataKey",
    "EnvelopeContext",
    "EnvelopeHeader",
    "EnvelopeKeys",
    "IssuedKey",
    "KeySchedule",
    "envelope_size",
    "peek_key_version",
    "plaintext_length",
    "read_header",
    "segment_scratch_bytes",
]


class ChunkCipher(_device.DeviceSealing):
    """Seals and opens chunk envelopes (format v1) with an injectable AEAD and salt source (the
    device methods, ``seal_device_into`` ..., come from ``crypto._device.DeviceSealing``)."""

    __slots__ = ("_aead_factory", "_salt_source", "_segment_bytes")

    def __init__(
        self,
        aead_factory: AeadFactory = CpuAesGcm,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        salt_source: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._aead_factory = aead_factory
        self._segment_bytes = check_segment_bytes(segment_bytes)
        self._salt_source = salt_source

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    @property
    def aead_factory(self) -> AeadFactory:
        """``key -> AEAD``: the CPU ``Aead`` or, for the device methods, an in-place one."""
        return self._aead_factory

    def with_aead(self, aead_factory: AeadFactory) -> ChunkCipher:
        """This cipher over another AEAD (a device's): same segment size and salt source."""
        return ChunkCipher(aead_factory, segment_bytes=self._segment_bytes, salt_source=self._salt_source)

    def envelope_size(self, plaintext_len: int, segment_bytes: int | None = None) -> int:
        """Bytes of the envelope of ``plaintext_len`` bytes (``segment_bytes``: the override)."""
        return envelope_size(plaintext_len, self._segment_size(segment_bytes))

    def _segment_size(self, segment_bytes: int | None) -> int:
        return self._segment_bytes if segment_bytes is None else check_segment_bytes(segment_bytes)

    # -- key schedules ------------------------------------------------------------------------
    def seal_schedule(
        self,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        plaintext_len: int,
        segment_bytes: int | None = None,
    ) -> KeySchedule:
        """The key and segment plan of a new envelope (draws its salt)."""
        seg = self._segment_size(segment_bytes)
        return seal_schedule(keys, ctx, plaintext_len, seg, self._salt_source)

    @staticmethod
    def open_schedule(keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: Buffer) -> KeySchedule:
        """The key and segment plan of an existing envelope (``DecryptionFailed`` if malformed)."""
        return open_schedule(keys, ctx, envelope)

    # -- host buffers -------------------------------------------------------------------------
    def seal_into(
        self,
        keys: EnvelopeKeys,
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
        with flat_view(plaintext, writable=False, what="plaintext") as pt:
            sched = self.seal_schedule(keys, ctx, pt.nbytes, seg)
            plan, size = sched.plan, sched.plan.envelope_length
            aead = self._aead_factory(sched.key)
            with flat_view(out, writable=True, what="out") as dst:
                if dst.nbytes < size:
                    raise InvalidParameter(f"out must hold {size} bytes, has {dst.nbytes}")
                dst[:HEADER_BYTES] = plan.header_bytes
                for s in plan.segments():
                    aead.seal_into(s.nonce, pt[s.start : s.end], s.aad, dst[s.offset : s.sealed_end])
        return size

    def seal(self, keys: EnvelopeKeys, ctx: EnvelopeContext, plaintext: Buffer) -> bytearray:
        """Allocate the envelope once and seal into it."""
        with flat_view(plaintext, writable=False, what="plaintext") as pt:
            out = bytearray(self.envelope_size(pt.nbytes))
            self.seal_into(keys, ctx, pt, out)
        return out

    def open_into(
        self,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        envelope: Buffer,
        out: WritableBuffer,
    ) -> int:
        """Verify every segment, write the plaintext into ``out[:n]`` and return ``n``.

        ``out`` must hold ``plaintext_length(envelope)`` bytes. On ``DecryptionFailed`` nothing of
        the plaintext is left in ``out``.
        """
        sched = open_schedule(keys, ctx, envelope)
        if not self._open_all(sched, envelope, out, None):
            raise DecryptionFailed  # raised outside any handler: no buffer view survives in a traceback
        return sched.plan.plaintext_length

    def open(self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: Buffer) -> bytearray:
        """Allocate the plaintext once (sized from the checked header) and open into it."""
        out = bytearray(plaintext_length(envelope))
        self.open_into(keys, ctx, envelope, out)
        return out

    def open_segments(
        self,
        keys: EnvelopeKeys,
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
        sched = open_schedule(keys, ctx, envelope)
        if not self._open_all(sched, envelope, scratch, on_segment):
            raise DecryptionFailed  # raised outside any handler: no buffer view survives in a traceback
        return sched.plan.plaintext_length

    def iter_segments(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: Buffer, scratch: WritableBuffer
    ) -> Iterator[tuple[int, int, memoryview]]:
        """``open_segments`` as a generator: each ``(start, end, view)`` comes once segment ``i``'s
        tag checked, ``view`` (of ``scratch``) valid until the next step. A bad tag raises
        ``DecryptionFailed`` from the step that would have yielded that segment, with ``scratch``
        wiped; closing the generator before its end wipes ``scratch`` too. The header is read
        (and the key derived) at this call: a malformed header or another key version fails
        here; another context (tenant, namespace, chunk, model) fails at the first step's tag."""
        return self._iter_open(open_schedule(keys, ctx, envelope), envelope, scratch)

    def _iter_open(self, sched: KeySchedule, envelope: Buffer, scratch: WritableBuffer) -> Iterator[tuple[int, int, memoryview]]:
        plan = sched.plan
        need = plan.scratch_bytes
        authentic = True
        with (
            flat_view(envelope, writable=False, what="envelope") as src,
            flat_view(scratch, writable=True, what="scratch") as dst,
        ):
            if dst.nbytes < need:
                raise InvalidParameter(f"scratch must hold {need} bytes, has {dst.nbytes}")
            aead = self._aead_factory(sched.key)
            ended = False
            try:
                for s in plan.segments():
                    part = dst[: s.length]
                    try:
                        aead.open_into(s.nonce, src[s.offset : s.sealed_end], s.aad, part)
                    except DecryptionFailed:
                        authentic = False
                        break
                    yield s.start, s.end, part
                    del part
                ended = authentic
            finally:
                if not ended:  # a bad tag, or closed early: no plaintext is left behind
                    wipe(dst[:need])
        if not authentic:
            raise DecryptionFailed  # raised outside any handler: no buffer view survives in a traceback

    def iter_segments_into(
        self,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        envelope: Buffer,
        targets: Callable[[int, int], Sequence[Target]],
        scratch: WritableBuffer,
    ) -> Iterator[tuple[int, int]]:
        """Open segment after segment straight into where its plaintext belongs: ``targets(start,
        end)`` gives writable views (or byte counts to authenticate and drop) that concatenate to
        plaintext bytes ``[start, end)``. Each ``(start, end)`` comes once that segment's tag
        checked. A bad tag raises ``DecryptionFailed`` from the step that would have yielded it,
        with nothing of that segment left in its targets (they are zeroed where it was written;
        the earlier segments are authentic, and what to do with them is the caller's). The plaintext lands in the targets before the tag is known, so nothing may
        read them until the step returned. The default AEAD decrypts in place (streaming GCM,
        ``scratch`` of ``BOUNCE_BYTES`` is enough); any other opens each segment into ``scratch``
        (``segment_scratch_bytes``) and copies it out. ``scratch`` holds no plaintext afterwards.
        The header is read (and the key derived) at this call, as in ``iter_segments``."""
        return self._iter_into(open_schedule(keys, ctx, envelope), envelope, targets, scratch)

    def _iter_into(
        self, sched: KeySchedule, envelope: Buffer, targets: Callable[[int, int], Sequence[Target]],
        scratch: WritableBuffer,
    ) -> Iterator[tuple[int, int]]:
        plan = sched.plan
        streaming = self._aead_factory is CpuAesGcm
        need = BOUNCE_BYTES if streaming else plan.scratch_bytes
        authentic = True
        with (
            flat_view(envelope, writable=False, what="envelope") as src,
            flat_view(scratch, writable=True, what="scratch") as tmp,
        ):
            if tmp.nbytes < need:
                raise InvalidParameter(f"scratch must hold {need} bytes, has {tmp.nbytes}")
            bounce = tmp[: min(tmp.nbytes, 4096)]  # wiped after every segment: kept small
            aes = algorithms.AES(sched.key)
            aead = None if streaming else self._aead_factory(sched.key)
            for s in plan.segments():
                into = targets(s.start, s.end)
                ok = open_streaming(aes, s, src, into, bounce) if aead is None else open_gathered(aead, s, src, into, tmp)
                if not ok:
                    authentic = False
                    break
                yield s.start, s.end
        if not authentic:
            raise DecryptionFailed  # raised outside any handler: no buffer view survives in a traceback

    def _open_all(
        self,
        sched: KeySchedule,
        envelope: Buffer,
        out: WritableBuffer,
        on_segment: Callable[[int, int, memoryview], None] | None,
    ) -> bool:
        """Open every segment into ``out`` at its offset, or (``on_segment``) into the front of
        ``out`` as scratch, handing each on. False (``out`` wiped) on a bad tag."""
        plan = sched.plan
        need = plan.plaintext_length if on_segment is None else plan.scratch_bytes
        what = "out" if on_segment is None else "scratch"
        with (
            flat_view(envelope, writable=False, what="envelope") as src,
            flat_view(out, writable=True, what=what) as dst,
        ):
            if dst.nbytes < need:
                raise InvalidParameter(f"{what} must hold {need} bytes, has {dst.nbytes}")
            aead = self._aead_factory(sched.key)
            try:
                for s in plan.segments():
                    part = dst[s.start : s.end] if on_segment is None else dst[: s.length]
                    aead.open_into(s.nonce, src[s.offset : s.sealed_end], s.aad, part)
                    if on_segment is not None:
                        on_segment(s.start, s.end, part)
            except DecryptionFailed:
                wipe(dst[:need])
                return False
            except BaseException:
                wipe(dst[:need])
                raise
        return True

    # -- the fused data path ------------------------------------------------------------------
    def seal_pieces_into(
        self,
        keys: EnvelopeKeys,
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
        views = piece_views(pieces, plaintext_len)
        sched = self.seal_schedule(keys, ctx, plaintext_len, seg)
        size = sched.plan.envelope_length
        with flat_view(out, writable=True, what="out") as dst:
            if dst.nbytes < size:
                raise InvalidParameter(f"out must hold {size} bytes, has {dst.nbytes}")
            dst[:HEADER_BYTES] = sched.plan.header_bytes
            ok = False
            try:
                if self._aead_factory is CpuAesGcm:
                    seal_streaming(sched, views, dst)
                else:
                    seal_gathered(sched, self._aead_factory(sched.key), views, dst)
                ok = True
            except (ValueError, TypeError, OverflowError):  # cryptography refusing a buffer
                pass
            finally:
                if not ok:
                    wipe(dst[:size])
            if not ok:  # raised outside the handler: no library exception chained to ours
                raise InvalidParameter("cannot seal the pieces (a piece overlaps out, or is not a byte buffer)")
        return size
