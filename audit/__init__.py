"""kvgate audit: a hash-chained, append-only audit log with a durable spool, signed export and
offline verification. Imports nothing of the project besides its own contract (audit.types).

Modules: ``types`` (the event contract), ``record`` (canonical encoding and chain hash),
``models`` (the table, ``audit_metadata``), ``db`` (engines, schema), ``store`` (chain append
and reads), ``spool`` (local durable spool), ``writer`` (the background AuditSink), ``formats``,
``export``, ``signing``, ``verify``, ``ocsf`` (field mapping), ``errors``.
"""

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
from audit.export import AuditExport, export_to_files, manifest_path_for
from audit.models import audit_metadata
from audit.signing import AuditSigningKey, load_public_key
from audit.store import AuditStore
from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from audit.verify import VerifyReport, verify_database, verify_export
from audit.writer import AuditWriter

__all__ = [
    "Actions",
    "Actor",
    "AuditError",
    "AuditEvent",
    "AuditExport",
    "AuditKeyError",
    "AuditSigningKey",
    "AuditSink",
    "AuditStorageError",
    "AuditStore",
    "AuditWriter",
    "AuditWriterClosed",
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
    "verify_database",
    "verify_export",
]
