"""kvgate's cryptography: the chunk envelope, the AEAD interface, KEK providers.

- ``crypto.envelope``: ``ChunkCipher`` seals/opens chunk envelopes (format v1: HKDF per-envelope
  key from DEK || namespace binding secret and a random 256-bit salt, AES-256-GCM segments whose
  AAD binds tenant, namespace, storage key, model fingerprint and key version).
- ``crypto.aead``: the ``Aead`` protocol (``seal_into``/``open_into`` into preallocated buffers)
  so a device implementation can be handed in, and ``CpuAesGcm`` over ``cryptography``.
- ``crypto.kek``: the ``KekProvider`` protocol, ``LocalFileKek`` and ``Secret``.
- ``crypto.errors``: the exception tree; every open/parse/auth failure is ``DecryptionFailed``.

Imports nothing of the project; does no I/O at import time.
"""

from crypto.aead import KEY_BYTES, NONCE_BYTES, TAG_BYTES, Aead, AeadFactory, CpuAesGcm
from crypto.envelope import (
    DEFAULT_SEGMENT_BYTES,
    HEADER_BYTES,
    ChunkCipher,
    EnvelopeContext,
    EnvelopeHeader,
    envelope_size,
    peek_key_version,
    plaintext_length,
    read_header,
)
from crypto.errors import (
    CryptoError,
    DecryptionFailed,
    InvalidParameter,
    InvocationLimitReached,
    KekError,
    KeyUnavailable,
)
from crypto.kek import KekProvider, LocalFileKek, Secret

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "HEADER_BYTES",
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "Aead",
    "AeadFactory",
    "ChunkCipher",
    "CpuAesGcm",
    "CryptoError",
    "DecryptionFailed",
    "EnvelopeContext",
    "EnvelopeHeader",
    "InvalidParameter",
    "InvocationLimitReached",
    "KekError",
    "KekProvider",
    "KeyUnavailable",
    "LocalFileKek",
    "Secret",
    "envelope_size",
    "peek_key_version",
    "plaintext_length",
    "read_header",
]
