"""kvgate audit: a hash-chained, append-only audit log with a durable spool, a Merkle tree with
signed checkpoints, signed export and offline verification. Imports nothing of the project
besides its own contract (audit.types).

Modules: ``types`` (the event contract), ``record`` (canonical encoding and chain hash),
``models`` (the table, ``audit_metadata``), ``db`` (engines, schema), ``store`` (chain append
and reads), ``spool`` (local durable spool), ``writer`` (the background AuditSink), ``formats``,
``export``, ``signing`` (keys), ``signed`` (signed documents), ``merkle`` (RFC 9162 tree),
``checkpoint`` (signed tree heads and their directory), ``checkpointer`` (writing them),
``verify``, ``ocsf`` (field mapping), ``errors``.

Names are imported lazily (PEP 562): ``from audit import verify_export`` loads the offline
verifier without SQLAlchemy; the database parts load when one of their names is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = {
    "create_audit_engine": "audit.db",
    "create_audit_schema": "audit.db",
    "AuditError": "audit.errors",
    "AuditKeyError": "audit.errors",
    "AuditStorageError": "audit.errors",
    "AuditWriterClosed": "audit.errors",
    "ExportError": "audit.errors",
    "ExportVerificationFailed": "audit.errors",
    "InvalidAuditEvent": "audit.errors",
    "SpoolError": "audit.errors",
    "VerificationError": "audit.errors",
    "VerifyInputError": "audit.errors",
    "AuditExport": "audit.export",
    "export_to_files": "audit.export",
    "manifest_path_for": "audit.formats",
    "audit_metadata": "audit.models",
    "AuditSigner": "audit.signing",
    "AuditSigningKey": "audit.signing",
    "EcdsaSigner": "audit.signing",
    "load_public_key": "audit.signing",
    "AuditStore": "audit.store",
    "Actions": "audit.types",
    "Actor": "audit.types",
    "AuditEvent": "audit.types",
    "AuditSink": "audit.types",
    "Target": "audit.types",
    "VerifyReport": "audit.verify",
    "verify_database": "audit.verify",
    "verify_export": "audit.verify",
    "AuditWriter": "audit.writer",
    "Checkpoint": "audit.checkpoint",
    "CheckpointDirectory": "audit.checkpoint",
    "CheckpointError": "audit.checkpoint",
    "read_checkpoint": "audit.checkpoint",
    "Checkpointer": "audit.checkpointer",
    "CheckpointTampered": "audit.checkpointer",
}

# spelled out (not sorted(_NAMES)) so type checkers and linters see the re-exports
__all__ = [
    "Actions",
    "Actor",
    "AuditError",
    "AuditEvent",
    "AuditExport",
    "AuditKeyError",
    "AuditSigner",
    "AuditSigningKey",
    "AuditSink",
    "AuditStorageError",
    "AuditStore",
    "AuditWriter",
    "AuditWriterClosed",
    "Checkpoint",
    "CheckpointDirectory",
    "CheckpointError",
    "CheckpointTampered",
    "Checkpointer",
    "EcdsaSigner",
    "ExportError",
    "ExportVerificationFailed",
    "InvalidAuditEvent",
    "SpoolError",
    "Target",
    "VerificationError",
    "VerifyInputError",
    "VerifyReport",
    "audit_metadata",
    "create_audit_engine",
    "create_audit_schema",
    "export_to_files",
    "load_public_key",
    "manifest_path_for",
    "read_checkpoint",
    "verify_database",
    "verify_export",
]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


if TYPE_CHECKING:  # pragma: no cover
    from audit.checkpoint import (
        Checkpoint,
        CheckpointDirectory,
        CheckpointError,
        read_checkpoint,
    )
    from audit.checkpointer import Checkpointer, CheckpointTampered
    from audit.db import create_audit_engine, create_audit_schema
    from audit.errors import (
        AuditError,
        AuditKeyError,
        AuditStorageError,
        AuditWriterClosed,
        ExportError,
        ExportVerificationFailed,
        InvalidAuditEvent,
        SpoolError,
        VerificationError,
        VerifyInputError,
    )
    from audit.export import AuditExport, export_to_files
    from audit.formats import manifest_path_for
    from audit.models import audit_metadata
    from audit.signing import AuditSigner, AuditSigningKey, EcdsaSigner, load_public_key
    from audit.store import AuditStore
    from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
    from audit.verify import VerifyReport, verify_database, verify_export
    from audit.writer import AuditWriter
