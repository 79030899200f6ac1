"""Sealing and opening envelopes whose plaintext lives on a device (a GPU's memory), with an AEAD
that encrypts in place there (``encrypt_(buf, nonce, aad) -> tag``, ``decrypt_(buf, nonce, aad,
tag)``, e.g. kernels.aes_gcm.TorchAesGcm). The envelope format is the one of crypto.envelope; only
ciphertext crosses to the host (``to_host``) or back (``to_device``), so nothing leaves the worker's
device in plaintext (DESIGN section 2, point 1). crypto stays torch-free: the device buffer is any
object whose slices the AEAD and the copy functions accept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crypto.aead import TAG_BYTES
from crypto.errors import DecryptionFailed, InvalidParameter

__all__ = ["seal_device_into", "open_device_into"]


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
