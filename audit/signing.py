"""Audit signing keys: what signs export manifests and checkpoints (pyca/cryptography).

Two algorithms, named in every signed document's ``signature_algorithm``:

- ``Ed25519``: :class:`AuditSigningKey`, a local PEM file. Development only (settings refuse it
  in production, as they refuse the local KEK file).
- ``ECDSA-P256-SHA256``: :class:`EcdsaSigner` around a backend that keeps the private key where
  the KEK lives (``crypto.signer_pkcs11.Pkcs11Signer``, ``crypto.signer_kms.KmsSigner``); the
  signature is DER. Every signature a backend returns is checked against its public key before use.

Public keys are exported as SubjectPublicKeyInfo PEM for auditors; ``key_id`` is the sha256 (hex)
of the raw public key (an Ed25519 key's 32 bytes, a P-256 key's uncompressed X9.62 point). The
Ed25519 private key is a PKCS#8 PEM file created with mode 0600 on first use (temporary file, then
hard-linked into place, so two processes starting together end up with one key); a key file
readable by group or others is refused, as ssh refuses one.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from audit.errors import AuditKeyError, AuditSignerUnavailable

__all__ = [
    "ECDSA_P256",
    "ED25519",
    "AuditSigner",
    "AuditSigningKey",
    "EcdsaSigner",
    "PublicKey",
    "algorithm_of",
    "key_id",
    "load_public_key",
    "load_public_key_pem",
    "verify_signature",
]

ED25519 = "Ed25519"
ECDSA_P256 = "ECDSA-P256-SHA256"
PublicKey = Ed25519PublicKey | ec.EllipticCurvePublicKey


@runtime_checkable
class AuditSigner(Protocol):
    """What signs manifests and checkpoints."""

    @property
    def algorithm(self) -> str: ...

    @property
    def key_id(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...

    def public_key_pem(self) -> bytes: ...


def algorithm_of(public_key: PublicKey) -> str:
    return ED25519 if isinstance(public_key, Ed25519PublicKey) else ECDSA_P256


def key_id(public_key: PublicKey) -> str:
    if isinstance(public_key, Ed25519PublicKey):
        raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    else:
        raw = public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return hashlib.sha256(raw).hexdigest()


def verify_signature(public_key: PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(public_key, Ed25519PublicKey):
            public_key.verify(signature, data)
        else:
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def load_public_key_pem(data: bytes, where: str = "the key") -> PublicKey:
    """A PEM public key (or private key, whose public half is used): Ed25519 or ECDSA P-256."""
    try:
        key: Any = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError):
            raise AuditKeyError(f"{where} is not a PEM Ed25519 or P-256 key") from None
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    if not isinstance(key, Ed25519PublicKey):
        raise AuditKeyError(f"{where} is not an Ed25519 or P-256 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> PublicKey:
    """Read a PEM public key (or a private key file, whose public half is used)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise AuditKeyError(f"cannot read the audit public key {path}: {exc}") from None
    return load_public_key_pem(data, str(path))


class AuditSigningKey:
    """The development Ed25519 key (a PEM file); ``repr`` shows only the key id."""

    algorithm = ED25519

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise AuditKeyError("the audit key must be Ed25519")
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    def __repr__(self) -> str:
        return f"AuditSigningKey(key_id={self.key_id[:16]}...)"

    @classmethod
    def generate(cls) -> AuditSigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AuditSigningKey:
        p = Path(path)
        try:
            st = p.stat()
            data = p.read_bytes()
        except OSError as exc:
            raise AuditKeyError(f"cannot read the audit key {p}: {exc}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuditKeyError(f"the audit key {p} is accessible by group or others (chmod 600 it)")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise AuditKeyError(f"{p} is not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise AuditKeyError(f"{p} is not an Ed25519 private key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> AuditSigningKey:
        """Load the key at ``path``; create it (0600, directory 0700) if there is none."""
        p = Path(path)
        if p.exists():
            return cls.load(p)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{secrets.token_hex(8)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, pem)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, p)  # fails if another process won the race; then use its key
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise AuditKeyError(f"cannot create the audit key {p}: {exc}") from None
        return cls.load(p)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def public_key_pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def write_public_key(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        try:
            p.write_bytes(self.public_key_pem())
        except OSError as exc:
            raise AuditKeyError(f"cannot write the audit public key {p}: {exc}") from None
        return p


class EcdsaSigner:
    """ECDSA P-256 / SHA-256 through a backend that holds the private key (an HSM, a KMS).

    The backend has ``sign(data) -> DER signature`` (it hashes ``data`` itself) and
    ``public_key_pem() -> bytes``. A backend that fails to sign is :class:`AuditSignerUnavailable`
    (an outage); one without a usable public key, or a signature that does not verify under it,
    is :class:`AuditKeyError`.
    """

    algorithm = ECDSA_P256

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        try:
            pem = backend.public_key_pem()
        except Exception as exc:
            raise AuditKeyError(f"the audit signer has no public key: {type(exc).__name__}: {exc}") from None
        key = load_public_key_pem(pem, "the audit signer's public key")
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise AuditKeyError("the audit signer's key is not P-256")
        self.public_key = key
        self._pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.key_id = key_id(key)

    def __repr__(self) -> str:
        return f"EcdsaSigner({self._backend!r}, key_id={self.key_id[:16]}...)"

    def sign(self, data: bytes) -> bytes:
        try:
            signature: bytes = self._backend.sign(data)
        except Exception as exc:  # the HSM or KMS library's errors end here
            raise AuditSignerUnavailable(f"the audit signer failed: {type(exc).__name__}: {exc}") from None
        if not verify_signature(self.public_key, signature, data):
            raise AuditKeyError("the audit signer returned a signature that does not verify")
        return signature

    def public_key_pem(self) -> bytes:
        return self._pem

    def write_public_key(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        try:
            p.write_bytes(self._pem)
        except OSError as exc:
            raise AuditKeyError(f"cannot write the audit public key {p}: {exc}") from None
        return p
