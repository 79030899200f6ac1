"""Sealing and opening envelopes whose plaintext lives on a device (a GPU's memory), with an AEAD
that encrypts in place there (``encrypt_(buf, nonce, aad) -> tag``, ``decrypt_(buf, nonce, aad,
tag)``, e.g. kernels.aes_gcm.TorchAesGcm). The envelope format is the one of crypto.envelope; only
ciphertext crosses to the host (``to_host``) or back (``to_device``), so nothing leaves the worker's
device in plaintext (docs/architecture.md, section 1). crypto stays torch-free: the device buffer
is any object whose slices the AEAD and the copy functions accept.

Every function works from a ``crypto.segments.KeySchedule`` (the segment key and the plan) that
``ChunkCipher`` makes; the segments come from ``SegmentPlan.segments``, as on the CPU.

The fused variants (``seal_device_fused`` / ``open_device_fused``) hand every segment of an envelope
to the device at once, as ``(start, end, nonce, aad)`` (plus the tag to open): the device gathers
and encrypts the whole chunk in one pass (``kernels.triton_gcm.TritonAesGcm.gather_encrypt_``), and
on open checks every tag before it scatters anything. Same format, same bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from crypto.errors import DecryptionFailed, InvalidParameter
from crypto.format import HEADER_BYTES, EnvelopeContext
from crypto.segments import EnvelopeKeys, KeySchedule

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DeviceBuffer",
    "DeviceSealing",
    "InPlaceAead",
    "OpenSegment",
    "SealSegment",
    "open_device_fused",
    "open_device_into",
    "seal_device_fused",
    "seal_device_into",
]

SealSegment = tuple[int, int, bytes, bytes]
"""``(start, end, nonce, aad)`` of one segment, as the fused device kernels take it."""
OpenSegment = tuple[int, int, bytes, bytes, bytes]
"""``(start, end, nonce, aad, tag)``."""


class DeviceBuffer(Protocol):
    """A device-resident byte buffer: all crypto does with it is slice it."""

    def __getitem__(self, index: slice, /) -> Any: ...


class InPlaceAead(Protocol):
    """An AEAD that encrypts and decrypts a device buffer in place."""

    def encrypt_(self, buf: Any, nonce: bytes, aad: bytes, /) -> bytes: ...

    def decrypt_(self, buf: Any, nonce: bytes, aad: bytes, tag: bytes, /) -> object: ...


def seal_device_into(
    schedule: KeySchedule,
    aead: InPlaceAead,
    plaintext: DeviceBuffer,
    out: memoryview,
    *,
    to_host: Callable[[Any, memoryview], None],
) -> int:
    """Encrypt ``plaintext`` in place segment by segment and copy each segment's ciphertext and
    tag into the host envelope ``out``; returns its size."""
    plan = schedule.plan
    size = plan.envelope_length
    if out.nbytes < size:
        raise InvalidParameter(f"out must hold {size} bytes, has {out.nbytes}")
    out[:HEADER_BYTES] = plan.header_bytes
    for s in plan.segments():
        part = plaintext[s.start : s.end]
        tag = aead.encrypt_(part, s.nonce, s.aad)
        to_host(part, out[s.offset : s.tag_offset])
        out[s.tag_offset : s.sealed_end] = tag
    return size


def open_device_into(
    schedule: KeySchedule,
    aead: InPlaceAead,
    envelope: memoryview,
    out: DeviceBuffer,
    *,
    to_device: Callable[[memoryview, Any], None],
    zero: Callable[[Any], None],
) -> int:
    """Copy each segment's ciphertext into the device buffer ``out`` and decrypt it there, every
    tag checked before its segment is decrypted; on any failure all of ``out`` is zeroed and
    DecryptionFailed raised. Returns the plaintext length."""
    ok = True
    try:
        for s in schedule.plan.segments():
            part = out[s.start : s.end]
            to_device(envelope[s.offset : s.tag_offset], part)
            aead.decrypt_(part, s.nonce, s.aad, bytes(envelope[s.tag_offset : s.sealed_end]))
    except Exception:
        ok = False
    if not ok:
        zero(out)
        raise DecryptionFailed
    return schedule.plan.plaintext_length


def seal_device_fused(
    schedule: KeySchedule,
    out: memoryview,
    *,
    encrypt: Callable[[bytes, list[SealSegment]], list[bytes]],
    to_host: Callable[[int, int, memoryview], None],
) -> int:
    """``encrypt(segment key, segments)`` produces the ciphertext of the whole chunk on the device
    and returns one tag per segment; ``to_host(start, end, dst)`` copies ciphertext bytes
    ``[start, end)`` into the envelope. Returns the envelope's size."""
    plan = schedule.plan
    size = plan.envelope_length
    if out.nbytes < size:
        raise InvalidParameter(f"out must hold {size} bytes, has {out.nbytes}")
    segments = list(plan.segments())
    tags = encrypt(schedule.key, [(s.start, s.end, s.nonce, s.aad) for s in segments])
    out[:HEADER_BYTES] = plan.header_bytes
    for s, tag in zip(segments, tags, strict=True):
        to_host(s.start, s.end, out[s.offset : s.tag_offset])
        out[s.tag_offset : s.sealed_end] = tag
    return size


def open_device_fused(
    schedule: KeySchedule,
    envelope: memoryview,
    *,
    to_device: Callable[[memoryview, int, int], None],
    decrypt: Callable[[bytes, list[OpenSegment]], None],
) -> int:
    """Copy each segment's ciphertext to the device (``to_device(src, start, end)``), then
    ``decrypt(segment key, segments with tags)``, which checks every tag before it writes anything.
    Any failure raises DecryptionFailed. Returns the plaintext length."""
    try:
        segments: list[OpenSegment] = []
        for s in schedule.plan.segments():
            to_device(envelope[s.offset : s.tag_offset], s.start, s.end)
            segments.append((s.start, s.end, s.nonce, s.aad, bytes(envelope[s.tag_offset : s.sealed_end])))
        decrypt(schedule.key, segments)
    except DecryptionFailed:
        raise
    except Exception:
        ok = False
    else:
        ok = True
    if not ok:
        raise DecryptionFailed
    return schedule.plan.plaintext_length


class _Cipher(Protocol):
    """What the device methods need of ``ChunkCipher``: its public key schedules and factory."""

    @property
    def aead_factory(self) -> Callable[[bytes], Any]: ...

    def seal_schedule(
        self, keys: EnvelopeKeys, ctx: EnvelopeContext, plaintext_len: int, segment_bytes: int | None = None,
    ) -> KeySchedule: ...

    def open_schedule(self, keys: EnvelopeKeys, ctx: EnvelopeContext, envelope: Buffer) -> KeySchedule: ...


class DeviceSealing:
    """``ChunkCipher``'s methods for a plaintext on a device (a mixin over its public schedules)."""

    __slots__ = ()

    def seal_device_into(
        self: _Cipher,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        plaintext: DeviceBuffer,
        plaintext_len: int,
        out: memoryview,
        *,
        to_host: Callable[[Any, memoryview], None],
        segment_bytes: int | None = None,
    ) -> int:
        """Seal a device-resident plaintext in place with an in-place AEAD (the cipher's factory)."""
        sched = self.seal_schedule(keys, ctx, plaintext_len, segment_bytes)
        aead: InPlaceAead = self.aead_factory(sched.key)  # the factory makes an in-place device AEAD
        return seal_device_into(sched, aead, plaintext, out, to_host=to_host)

    def open_device_into(
        self: _Cipher,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        envelope: memoryview,
        out: DeviceBuffer,
        *,
        to_device: Callable[[memoryview, Any], None],
        zero: Callable[[Any], None],
    ) -> int:
        """Open an envelope into a device buffer, decrypting there (``out`` zeroed on failure)."""
        sched = self.open_schedule(keys, ctx, envelope)
        aead: InPlaceAead = self.aead_factory(sched.key)  # the factory makes an in-place device AEAD
        return open_device_into(sched, aead, envelope, out, to_device=to_device, zero=zero)

    def seal_device_fused(
        self: _Cipher,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        plaintext_len: int,
        out: memoryview,
        *,
        encrypt: Callable[[bytes, list[SealSegment]], list[bytes]],
        to_host: Callable[[int, int, memoryview], None],
        segment_bytes: int | None = None,
    ) -> int:
        """Seal a chunk the device gathers and encrypts in one pass."""
        sched = self.seal_schedule(keys, ctx, plaintext_len, segment_bytes)
        return seal_device_fused(sched, out, encrypt=encrypt, to_host=to_host)

    def open_device_fused(
        self: _Cipher,
        keys: EnvelopeKeys,
        ctx: EnvelopeContext,
        envelope: memoryview,
        *,
        to_device: Callable[[memoryview, int, int], None],
        decrypt: Callable[[bytes, list[OpenSegment]], None],
    ) -> int:
        """Open an envelope the device checks whole, then decrypts and scatters. Any failure,
        a malformed key included, is DecryptionFailed."""
        try:
            sched: KeySchedule | None = self.open_schedule(keys, ctx, envelope)
        except Exception:
            sched = None
        if sched is None:
            raise DecryptionFailed
        return open_device_fused(sched, envelope, to_device=to_device, decrypt=decrypt)
