"""Exceptions raised by the ``crypto`` package; library errors (``InvalidTag``, ``ValueError``,
``OSError`` from key files) are translated here, at the package boundary::

    CryptoError                      every error this package raises on purpose
    ├── DecryptionFailed             the ONE error for any open/parse/authentication failure
    ├── KeyUnavailable               a key version is unknown or has been destroyed
    ├── InvocationLimitReached       a key has been used as often as it may be: rotate it
    ├── KekError                     the key-encryption-key provider failed (file, perms, unwrap)
    ├── SigningKeyError              the audit signing key (an HSM key pair, a KMS key) is missing,
    │                                of the wrong kind, or its token or service refused to sign
    └── InvalidParameter             a caller's mistake: wrong key length, bad buffer, bad context
        (also a ValueError)

``DecryptionFailed`` never says which check failed: an attacker feeding envelopes learns "not valid".
``InvalidParameter`` is for caller-controlled inputs only. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

__all__ = [
    "CryptoError",
    "DecryptionFailed",
    "InvalidParameter",
    "InvocationLimitReached",
    "KekError",
    "KeyUnavailable",
    "SigningKeyError",
]


class CryptoError(Exception):
    """Base class of every error the ``crypto`` package raises."""


class DecryptionFailed(CryptoError):
    """The data could not be opened: malformed, truncated, tampered, or the wrong key/context.

    One error for every failure, with no detail about which check failed.
    """

    def __init__(self) -> None:
        super().__init__("decryption failed")


class KeyUnavailable(CryptoError):
    """A key version is unknown or has been destroyed (crypto-shredded)."""


class InvocationLimitReached(CryptoError):
    """A key reached its hard invocation limit; it must be rotated before further use."""


class KekError(CryptoError):
    """The KEK provider failed: missing, unreadable or invalid key file, or unwrap failed."""


class SigningKeyError(CryptoError):
    """The audit signing key in the HSM or KMS is missing, of the wrong kind or unusable (a login
    to its token fails with ``KekError``, as the KEK's does: the process shares that login)."""


class InvalidParameter(CryptoError, ValueError):
    """A caller-supplied parameter is invalid (key length, buffer size, context field)."""
