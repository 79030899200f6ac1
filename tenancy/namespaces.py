"""Cryptographic namespaces ("Namespaces are cryptographic", docs/architecture.md, section 1).

Each (tenant, namespace, epoch) has a root secret derived by HKDF-SHA256 from the gateway's master
secret, with the tenant, the namespace and the epoch in the derivation, and a random 256-bit salt
that the registry keeps (wrapped by the KEK) for that epoch only. Two secrets are derived from the
root, so one key never serves two purposes:
- the *index key*: storage key = HMAC-SHA256(index key, chained token hash), hex;
- the *binding secret*: mixed into every envelope's key schedule (see crypto.envelope), so
  destroying the epoch's salt at a namespace clear crypto-shreds that namespace's chunks even
  though the tenant's data keys live on.

Bumping the epoch (secure clear) changes every storage key, and replacing the salt makes the
previous epoch's keys impossible to recompute, even with the master secret. Tiers get only opaque
labels: owner and group labels are HMACs under a label key, stable across epochs, so a namespace's
chunks can be deleted without listing keys and a tenant's bytes can be counted for quotas."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crypto.contexts import lp

__all__ = ["NamespaceDeriver", "NamespaceKeys", "lp"]


def _hkdf(ikm: bytes, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


@dataclass(frozen=True, slots=True)
class NamespaceKeys:
    """The derived secrets of one namespace epoch. repr hides the secrets."""

    tenant: str
    namespace: str
    epoch: int
    owner: str
    group: str
    index_key: bytes = field(repr=False)
    binding_secret: bytes = field(repr=False)

    def storage_key(self, chained_hash: bytes) -> str:
        return hmac.digest(self.index_key, chained_hash, "sha256").hex()  # one C call (lookup path)


class NamespaceDeriver:
    """Derives namespace keys and labels from the master secret (held in memory only)."""

    def __init__(self, master_secret: bytes) -> None:
        if len(master_secret) != 32:
            raise ValueError("the master secret must be 32 bytes")
        self._master = master_secret
        self._label_key = _hkdf(master_secret, None, b"kvgate/labels/v1")

    def __repr__(self) -> str:
        return "NamespaceDeriver(<secret>)"

    def owner_label(self, tenant: str) -> str:
        return hmac.new(self._label_key, lp("owner", tenant), hashlib.sha256).hexdigest()[:32]

    def group_label(self, tenant: str, namespace: str) -> str:
        return hmac.new(self._label_key, lp("group", tenant, namespace), hashlib.sha256).hexdigest()[:32]

    def derive(self, tenant: str, namespace: str, epoch: int, epoch_salt: bytes) -> NamespaceKeys:
        if len(epoch_salt) != 32:
            raise ValueError("the epoch salt must be 32 bytes")
        root = _hkdf(self._master, epoch_salt, lp("kvgate/namespace/v1", tenant, namespace, epoch))
        return NamespaceKeys(
            tenant=tenant,
            namespace=namespace,
            epoch=epoch,
            owner=self.owner_label(tenant),
            group=self.group_label(tenant, namespace),
            index_key=hmac.new(root, b"kvgate/index", hashlib.sha256).digest(),
            binding_secret=hmac.new(root, b"kvgate/binding", hashlib.sha256).digest(),
        )
