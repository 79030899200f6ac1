"""kvgate's cryptography: the chunk envelope, the AEAD interface, KEK providers.

- ``crypto.envelope``: ``ChunkCipher`` seals/opens chunk envelopes (format v1: HKDF per-envelope
  key from DEK || namespace binding secret and a random 256-bit salt, AES-256-GCM segments whose
  AAD binds tenant, namespace, storage key, model fingerprint and key version).
- ``crypto.format``: the header, ``EnvelopeContext``, sizes; ``crypto.segments``: the key sources
  (``DataKey``, ``IssuedKey``), the key schedule and the one segment loop.
- ``crypto.contexts``: wrap contexts, the one definition of what a KEK binds a wrapped key to.
- ``crypto.aead``: the ``Aead`` protocol (``seal_into``/``open_into`` into preallocated buffers)
  so a device implementation can be handed in, and ``CpuAesGcm`` over ``cryptography``.
- ``crypto.kek``: the ``KekProvider`` protocol, ``LocalFileKek`` and ``Secret``;
  ``crypto.kek_async``: ``AsyncKek``/``awrap``/``aunwrap``, provider calls in a worker thread.
- ``crypto.errors``: the exception tree; every open/parse/auth failure is ``DecryptionFailed``.

Imports nothing of the project; does no I/O at import time."""

from crypto.aead import KEY_BYTES, NONCE_BYTES, TAG_BYTES, Aead, AeadFactory, CpuAesGcm
from crypto.contexts import WrapContext, dek_context, ns_salt_context, secret_context
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
from crypto.kek_async import AsyncKek, aunwrap, awrap
from crypto.segments import DataKey, EnvelopeKeys, IssuedKey, KeySchedule, SegmentPlan, derive_segment_key

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "HEADER_BYTES",
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "Aead",
    "AeadFactory",
    "AsyncKek",
    "ChunkCipher",
    "CpuAesGcm",
    "CryptoError",
    "DataKey",
    "DecryptionFailed",
    "EnvelopeContext",
    "EnvelopeHeader",
    "EnvelopeKeys",
    "InvalidParameter",
    "IssuedKey",
    "InvocationLimitReached",
    "KekError",
    "KekProvider",
    "KeySchedule",
    "KeyUnavailable",
    "LocalFileKek",
    "Secret",
    "SegmentPlan",
    "WrapContext",
    "aunwrap",
    "awrap",
    "dek_context",
    "derive_segment_key",
    "envelope_size",
    "ns_salt_context",
    "peek_key_version",
    "plaintext_length",
    "read_header",
    "secret_context",
]
