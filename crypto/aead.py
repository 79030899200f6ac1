"""The narrow AEAD interface the chunk envelope is built on, and its CPU implementation.

``Aead`` is AES-256-GCM with a 96-bit nonce and a 128-bit tag, written into caller-owned buffers:

- ``seal_into(nonce, data, aad, out)``: ``out`` has exactly ``len(data) + 16`` bytes and receives
  ciphertext then tag.
- ``open_into(nonce, data_with_tag, aad, out)``: ``out`` has exactly ``len(data_with_tag) - 16``
  bytes and receives the plaintext, or ``DecryptionFailed`` is raised and ``out`` is zeroed
  (``cryptography``'s ``decrypt_into`` writes the unverified plaintext before it checks the tag,
  so an implementation must wipe it).

``AeadFactory`` turns a 32-byte key into an ``Aead``; the gateway hands a device implementation
(from ``kernels``; bit-identical) to ``crypto.envelope.ChunkCipher`` through it, ``CpuAesGcm`` is
the default. Implementations are stateless apart from the key and safe to share between threads.
``cryptography``'s ``*_into`` methods release the GIL and save a payload-sized allocation per call."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from crypto.errors import DecryptionFailed, InvalidParameter

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Buffer

    #: A buffer the callee writes into (bytearray, writable memoryview, numpy array ...).
    WritableBuffer: TypeAlias = Buffer

__all__ = [
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "Aead",
    "AeadFactory",
    "CpuAesGcm",
    "wipe",
]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


class Aead(Protocol):
    """AES-256-GCM (96-bit nonce, 128-bit tag) into preallocated buffers."""

    def seal_into(self, nonce: bytes, data: Buffer, aad: bytes, out: WritableBuffer) -> None:
        """Encrypt ``data`` into ``out`` (``len(data) + 16`` bytes: ciphertext || tag)."""
        ...

    def open_into(
        self, nonce: bytes, data_with_tag: Buffer, aad: bytes, out: WritableBuffer
    ) -> None:
        """Verify and decrypt into ``out``; on failure zero ``out``, raise ``DecryptionFailed``."""
        ...


AeadFactory = Callable[[bytes], Aead]


def wipe(buf: WritableBuffer) -> None:
    """Zero a writable, C-contiguous buffer in place, without allocating its size."""
    with memoryview(buf) as view:
        if view.readonly or not view.c_contiguous:
            raise InvalidParameter("can only wipe a writable, C-contiguous buffer")
        if view.nbytes == 0:
            return
        with view.cast("B") as flat:
            array = (ctypes.c_char * flat.nbytes).from_buffer(flat)
            ctypes.memset(array, 0, flat.nbytes)
            del array


def _byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view (cryptography takes only byte-format buffers); TypeError if the
    object is not a C-contiguous buffer."""
    return memoryview(buf).cast("B")


def _check_nonce(nonce: bytes) -> None:
    if len(nonce) != NONCE_BYTES:
        raise InvalidParameter(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")


class CpuAesGcm:
    """``Aead`` on the CPU with ``cryptography``'s ``AESGCM.encrypt_into``/``decrypt_into``."""

    __slots__ = ("_aesgcm",)

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise InvalidParameter(f"AES-256-GCM key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aesgcm = AESGCM(bytes(key))

    def __repr__(self) -> str:
        return "CpuAesGcm(key=<hidden>)"

    def seal_into(self, nonce: bytes, data: Buffer, aad: bytes, out: WritableBuffer) -> None:
        _check_nonce(nonce)
        try:
            with _byte_view(data) as src, _byte_view(out) as dst:
                self._aesgcm.encrypt_into(nonce, src, aad, dst)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidParameter(f"cannot seal: {exc}") from exc

    def open_into(
        self, nonce: bytes, data_with_tag: Buffer, aad: bytes, out: WritableBuffer
    ) -> None:
        _check_nonce(nonce)
        opened = False
        try:
            with _byte_view(data_with_tag) as src, _byte_view(out) as dst:
                self._aesgcm.decrypt_into(nonce, src, aad, dst)
            opened = True
        except (InvalidTag, ValueError, TypeError, OverflowError):
            pass
        if opened:
            return
        # decrypt_into has written unverified plaintext: wipe it. Raised outside the handler, so no
        # library exception (nor a view of the caller's buffers) is chained to DecryptionFailed.
        with contextlib.suppress(TypeError, ValueError):  # out may not be a usable buffer at all
            wipe(out)
        raise DecryptionFailed
