"""The Ed25519 audit key that signs export manifests (pyca/cryptography).

The private key is a PKCS#8 PEM file created with mode 0600 on first use (written to a temporary
file, then hard-linked into place, so two processes starting together end up with one key). A key
file readable by group or others is refused, as ssh refuses one. The public key is exported as
SubjectPublicKeyInfo PEM for auditors; ``key_id`` is the sha256 of its raw 32 bytes (hex).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from audit.errors import AuditKeyError

__all__ = ["AuditSigningKey", "key_id", "load_public_key", "verify_signature"]


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def verify_signature(public_key: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        public_key.verify(signature, data)
    except InvalidSignature:
        return False
    return True


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Read a PEM public key (or a private key file, whose public half is used)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise AuditKeyError(f"cannot read the audit public key {path}: {exc}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()  # type: ignore[assignment]
        except (ValueError, TypeError):
            raise AuditKeyError(f"{path} is not a PEM Ed25519 key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AuditKeyError(f"{path} is not an Ed25519 key")
    return key


class AuditSigningKey:
    """Holds the private key; ``repr`` shows only the key id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise AuditKeyError("the audit key must be Ed25519")
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    def __repr__(self) -> str:
        return f"AuditSigningKey(key_id={self.key_id[:16]}...)"

    def derive(self, label: bytes) -> bytes:
        """A 32-byte secret for ``label``, derived from the private key (HMAC-SHA256 keyed with
        the key's raw bytes): whoever cannot sign exports cannot compute it."""
        import hashlib
        import hmac

        raw = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return hmac.new(raw, b"kvgate/audit-derive/v1\x00" + label, hashlib.sha256).digest()

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
