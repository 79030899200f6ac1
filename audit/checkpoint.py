"""Signed checkpoints (tree heads) of the audit log, and the directory that keeps them.

A checkpoint says: "the first ``tree_size`` rows of the chain have the RFC 9162 Merkle root
``root_hash``, and row ``tree_size`` has the chain hash ``last_hash``", at ``created_at``, signed
by the audit key (audit.signed)::

    {"kind": "kvgate.audit.checkpoint", "checkpoint_version": 1, "tree_size": int,
     "root_hash": hex, "last_hash": hex, "created_at": TIME,
     "signature_algorithm": str, "key_id": hex, "signature": base64,
     "frontier": [hex, ...]}     # not signed: the compact range (audit.merkle), checked against root_hash

``CheckpointDirectory`` is the store outside the audit database: one JSON file per checkpoint,
``checkpoint-<tree_size>-<created>.json``, written to a temporary name, fsync-ed and renamed.
No SQLAlchemy here: the offline verifier reads checkpoints too.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from audit.errors import AuditError
from audit.merkle import CompactRange, verify_consistency
from audit.record import GENESIS_HASH, format_time
from audit.signed import check_signature, sign_document
from audit.signing import AuditSigner, PublicKey

__all__ = [
    "CHECKPOINT_ACTION",
    "CHECKPOINT_KIND",
    "Checkpoint",
    "CheckpointDirectory",
    "CheckpointError",
    "make_checkpoint",
    "parse_checkpoint",
    "read_checkpoint",
    "verify_checkpoint_consistency",
]

log = logging.getLogger(__name__)
CHECKPOINT_KIND = "kvgate.audit.checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_ACTION = "audit.checkpoint"
_UNSIGNED = ("frontier",)
_HEX64 = frozenset("0123456789abcdef")


class CheckpointError(AuditError):
    """A checkpoint is malformed, unsigned or signed by another key, or cannot be stored."""


def _hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


@dataclass(frozen=True, slots=True)
class Checkpoint:
    tree_size: int
    root_hash: str
    last_hash: str
    created_at: str
    key_id: str
    document: Mapping[str, Any]

    def compact_range(self) -> CompactRange:
        """The tree's right edge, to extend it (checked against the signed root when parsed)."""
        frontier = self.document.get("frontier")
        if frontier is None:
            raise CheckpointError("this checkpoint carries no frontier; it cannot be extended")
        return CompactRange(self.tree_size, [bytes.fromhex(h) for h in frontier])


def make_checkpoint(tree: CompactRange, last_hash: str, created_at: datetime, signer: AuditSigner) -> dict[str, Any]:
    """The signed checkpoint document of ``tree`` (whose last row has chain hash ``last_hash``)."""
    body = {
        "kind": CHECKPOINT_KIND,
        "checkpoint_version": CHECKPOINT_VERSION,
        "tree_size": tree.size,
        "root_hash": tree.root().hex(),
        "last_hash": last_hash if tree.size else GENESIS_HASH,
        "created_at": format_time(created_at),
        "frontier": [n.hex() for n in tree.nodes],
    }
    return sign_document(body, signer, unsigned=_UNSIGNED)


def parse_checkpoint(doc: Any, public_key: PublicKey) -> Checkpoint:
    """Check a checkpoint document's form and signature; raises CheckpointError."""
    if not isinstance(doc, dict):
        raise CheckpointError("a checkpoint is a JSON object")
    if doc.get("kind") != CHECKPOINT_KIND or doc.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise CheckpointError("not a kvgate audit checkpoint of a known version")
    bad = check_signature(doc, public_key, unsigned=_UNSIGNED)
    if bad is not None:
        raise CheckpointError(f"checkpoint signature: {bad}")
    size = doc.get("tree_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CheckpointError("tree_size must be a non-negative integer")
    if not (_hex64(doc.get("root_hash")) and _hex64(doc.get("last_hash"))):
        raise CheckpointError("root_hash and last_hash must be 64 lowercase hex digits")
    frontier = doc.get("frontier")
    if frontier is not None:
        try:
            tree = CompactRange(size, [bytes.fromhex(h) for h in frontier])
        except (TypeError, ValueError):
            raise CheckpointError("the frontier is malformed") from None
        if tree.root().hex() != doc["root_hash"]:
            raise CheckpointError("the frontier does not fold to the signed root")
    return Checkpoint(size, doc["root_hash"], doc["last_hash"], str(doc.get("created_at")), str(doc.get("key_id")), doc)


def read_checkpoint(path: str | os.PathLike[str], public_key: PublicKey) -> Checkpoint:
    try:
        doc = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"the checkpoint {path} is not JSON: {exc}") from None
    return parse_checkpoint(doc, public_key)


class CheckpointDirectory:
    """Checkpoint files in a directory (0700) of their own, outside the audit database."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, doc: Mapping[str, Any]) -> Path:
        created = str(doc["created_at"]).replace(":", "").replace("-", "").replace(".", "")
        name = f"checkpoint-{int(doc['tree_size']):012d}-{created}.json"
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path / f".{name}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / name)
            dfd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise CheckpointError(f"cannot write a checkpoint in {self.path}: {exc}") from exc
        return self.path / name

    def files(self) -> list[Path]:
        """Checkpoint files, newest (largest tree, then latest time) first."""
        if not self.path.is_dir():
            return []
        return sorted(self.path.glob("checkpoint-*.json"), reverse=True)

    def covering(self, size: int, public_key: PublicKey) -> Checkpoint | None:
        """The smallest checkpoint of at least ``size`` rows that verifies; else the newest one.
        Once one exists the choice never changes (later checkpoints are larger), so an export of
        a fixed window is reproducible."""
        for path in sorted(self.files()):
            try:
                if int(path.name.split("-")[1]) < size:
                    continue
                return read_checkpoint(path, public_key)
            except (CheckpointError, IndexError, ValueError) as exc:
                log.error("audit checkpoint %s skipped: %s", path, exc)
        return self.latest(public_key)

    def latest(self, public_key: PublicKey) -> Checkpoint | None:
        """The newest checkpoint that verifies under ``public_key`` (others are logged and skipped)."""
        for path in self.files():
            try:
                return read_checkpoint(path, public_key)
            except CheckpointError as exc:
                log.error("audit checkpoint %s skipped: %s", path, exc)
        return None


def verify_checkpoint_consistency(old: Checkpoint, new: Checkpoint, proof: Any) -> str | None:
    """None when ``new`` extends ``old`` by the RFC 9162 consistency ``proof`` (hex hashes, or a
    document with a ``proof`` list as ``GET /v1/admin/audit/consistency`` returns); otherwise why not."""
    if isinstance(proof, Mapping):
        if proof.get("first") not in (None, old.tree_size) or proof.get("second") not in (None, new.tree_size):
            return "the proof is for other tree sizes"
        proof = proof.get("proof")
    if not isinstance(proof, list) or not all(_hex64(h) for h in proof):
        return "the proof is not a list of 64-digit hex hashes"
    if old.tree_size == 0:
        return None
    if old.tree_size > new.tree_size:
        return f"the first checkpoint is larger ({old.tree_size}) than the second ({new.tree_size})"
    if not verify_consistency(old.tree_size, new.tree_size, bytes.fromhex(old.root_hash),
                              bytes.fromhex(new.root_hash), [bytes.fromhex(h) for h in proof]):
        return "the consistency proof fails: the second tree does not extend the first (history rewritten)"
    return None
