"""Sealing and opening envelopes whose plaintext lives on a device (a GPU's memory), with an AEAD
that encrypts in place there (``encrypt_(buf, nonce, aad) -> tag``, ``decrypt_(buf, nonce, aad,
tag)``, e.g. kernels.aes_gcm.TorchAesGcm). The envelope format is the one of crypto.envelope; only
ciphertext crosses to the host (``to_host``) or back (``to_device``), so nothing leaves the worker's
device in plaintext (DESIGN section 2, point 1). crypto stays torch-free: the device buffer is any
object whose slices the AEAD and the copy functions accept.

The fused variants (``seal_device_fused`` / ``open_device_fused``) hand every segment of an envelope
to the device at once, as ``(start, end, nonce, aad)`` (plus the tag to open): the device gathers
and encrypts the whole chunk in one pass (``kernels.triton_gcm.TritonAesGcm.gather_encrypt_``), and
on open checks every tag before it scatters anything. Same format, same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crypto.aead import TAG_BYTES
from crypto.errors import DecryptionFailed, InvalidParameter

__all__ = ["open_device_fused", "open_device_into", "seal_device_fused", "seal_device_into"]


def seal_device_into(
    cipher: Any,
    dek: bytes,
    binding_secret: bytes,
    ctx: Any,
    plaintext: Any,
    plaintext_len: int,
    out: memoryview,
    *,
    to_host: Callable[[Any, memoryview], None],
    segment_bytes: int | None = None,
) -> int:
    """Encrypt ``plaintext`` (``plaintext_len`` bytes, sliceable) in place segment by segment and
    copy each segment's ciphertext and tag into the host envelope ``out``; returns its size."""
    from crypto.envelope import _SEGMENT_AAD, HEADER_BYTES, _nonce

    seg = cipher._segment_size(segment_bytes)
    key, header, prefix, count, size = cipher._begin(dek, binding_secret, ctx, plaintext_len, seg)
    aead = cipher._aead_factory(key)
    if out.nbytes < size:
        raise InvalidParameter(f"out must hold {size} bytes, has {out.nbytes}")
    out[:HEADER_BYTES] = header
    src, dst = 0, HEADER_BYTES
    for i in range(count):
        n = min(seg, plaintext_len - src)
        part = plaintext[src : src + n]
        tag = aead.encrypt_(part, _nonce(i), prefix + _SEGMENT_AAD.pack(i, count))
        to_host(part, out[dst : dst + n])
        out[dst + n : dst + n + TAG_BYTES] = tag
        src += n
        dst += n + TAG_BYTES
    return size


def open_device_into(
    cipher: Any,
    dek: bytes,
    binding_secret: bytes,
    ctx: Any,
    envelope: memoryview,
    out: Any,
    *,
    to_device: Callable[[memoryview, Any], None],
    zero: Callable[[Any], None],
) -> int:
    """Copy each segment's ciphertext into the device buffer ``out`` and decrypt it there, every
    tag checked before its segment is decrypted; on any failure all of ``out`` is zeroed and
    DecryptionFailed raised. Returns the plaintext length."""
    from crypto.envelope import _SEGMENT_AAD, HEADER_BYTES, _nonce, read_header

    header = read_header(envelope)
    if header.key_version != ctx.key_version:
        raise DecryptionFailed
    key = cipher._segment_key(dek, binding_secret, header.salt)
    aead = cipher._aead_factory(key)
    prefix = bytes(envelope[:HEADER_BYTES]) + ctx.aad()
    pt_len, seg, count = header.plaintext_length, header.segment_bytes, header.segment_count
    src, dst = HEADER_BYTES, 0
    ok = True
    try:
        for i in range(count):
            n = min(seg, pt_len - dst)
            part = out[dst : dst + n]
            to_device(envelope[src : src + n], part)
            aead.decrypt_(part, _nonce(i), prefix + _SEGMENT_AAD.pack(i, count), bytes(envelope[src + n : src + n + TAG_BYTES]))
            src += n + TAG_BYTES
            dst += n
    except Exception:  # a bad tag (the AEAD's own error type) or a malformed segment
        ok = False
    if not ok:
        zero(out)
        raise DecryptionFailed
    return pt_len


def seal_device_fused(
    cipher: Any,
    dek: bytes,
    binding_secret: bytes,
    ctx: Any,
    plaintext_len: int,
    out: memoryview,
    *,
    encrypt: Callable[[bytes, list[tuple[int, int, bytes, bytes]]], list[bytes]],
    to_host: Callable[[int, int, memoryview], None],
    segment_bytes: int | None = None,
) -> int:
    """``encrypt(segment key, segments)`` produces the ciphertext of the whole chunk on the device
    and returns one tag per segment; ``to_host(start, end, dst)`` copies ciphertext bytes
    ``[start, end)`` into the envelope. Returns the envelope's size."""
    from crypto.envelope import _SEGMENT_AAD, HEADER_BYTES, _nonce

    seg = cipher._segment_size(segment_bytes)
    key, header, prefix, count, size = cipher._begin(dek, binding_secret, ctx, plaintext_len, seg)
    if out.nbytes < size:
        raise InvalidParameter(f"out must hold {size} bytes, has {out.nbytes}")
    segments = [
        (i * seg, min((i + 1) * seg, plaintext_len), _nonce(i), prefix + _SEGMENT_AAD.pack(i, count))
        for i in range(count)
    ]
    tags = encrypt(key, segments)
    out[:HEADER_BYTES] = header
    dst = HEADER_BYTES
    for (start, end, _, _), tag in zip(segments, tags, strict=True):
        n = end - start
        to_host(start, end, out[dst : dst + n])
        out[dst + n : dst + n + TAG_BYTES] = tag
        dst += n + TAG_BYTES
    return size


def open_device_fused(
    cipher: Any,
    dek: bytes,
    binding_secret: bytes,
    ctx: Any,
    envelope: memoryview,
    *,
    to_device: Callable[[memoryview, int, int], None],
    decrypt: Callable[[bytes, list[tuple[int, int, bytes, bytes, bytes]]], None],
) -> int:
    """Copy each segment's ciphertext to the device (``to_device(src, start, end)``), then
    ``decrypt(segment key, segments with tags)``, which checks every tag before it writes anything.
    Any failure raises DecryptionFailed. Returns the plaintext length."""
    from crypto.envelope import _SEGMENT_AAD, HEADER_BYTES, _nonce, read_header

    try:
        header = read_header(envelope)
        if header.key_version != ctx.key_version:
            raise DecryptionFailed
        key = cipher._segment_key(dek, binding_secret, header.salt)
        prefix = bytes(envelope[:HEADER_BYTES]) + ctx.aad()
        pt_len, seg, count = header.plaintext_length, header.segment_bytes, header.segment_count
        segments = []
        src = HEADER_BYTES
        for i in range(count):
            start, end = i * seg, min((i + 1) * seg, pt_len)
            n = end - start
            to_device(envelope[src : src + n], start, end)
            tag = bytes(envelope[src + n : src + n + TAG_BYTES])
            segments.append((start, end, _nonce(i), prefix + _SEGMENT_AAD.pack(i, count), tag))
            src += n + TAG_BYTES
        decrypt(key, segments)
    except DecryptionFailed:
        raise
    except Exception:  # a bad tag (the device AEAD's own error type) or a malformed envelope
        ok = False
    else:
        ok = True
    if not ok:
        raise DecryptionFailed
    return pt_len
