"""Errors of the audit package; library errors (SQLAlchemy, asyncpg, sqlite3, OSError, cryptography)
are translated into these at the package boundary::
    AuditError
     ├── InvalidAuditEvent          (also ValueError) emit() got an event it cannot record
     ├── AuditWriterClosed          emit()/start() on a writer that was closed
     ├── AuditStorageError          the audit database failed (connection lost, refused, ...)
     ├── SpoolError                 the local spool could not be written or read
     ├── AuditKeyError              the Ed25519 audit key is missing, malformed or unsafe
     │    └── AuditSignerUnavailable  the HSM or KMS holding the signing key did not sign (an outage)
     ├── ExportError                (also ValueError) bad export parameters
     └── VerificationError          offline verification could not run or did not pass
          ├── VerifyInputError      an input file is missing or unreadable, the key is no key
          └── ExportVerificationFailed  raised by VerifyReport.raise_for_failure()

Verification that finds tampering returns a failed ``VerifyReport``; ``raise_for_failure`` raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from audit.verify import VerifyReport

__all__ = [
    "AuditError",
    "AuditKeyError",
    "AuditSignerUnavailable",
    "AuditStorageError",
    "AuditWriterClosed",
    "ExportError",
    "ExportVerificationFailed",
    "InvalidAuditEvent",
    "SpoolError",
    "VerificationError",
    "VerifyInputError",
]


class AuditError(Exception):
    """Base of every error raised by the audit package."""


class InvalidAuditEvent(AuditError, ValueError):
    """The event is malformed (wrong type, bad action name, unserialisable details, ...)."""


class AuditWriterClosed(AuditError):
    """The writer was closed; it accepts no more events."""


class AuditStorageError(AuditError):
    """The audit database could not be reached or refused the operation."""


class SpoolError(AuditError):
    """The local append-only spool could not be written, read or locked."""


class AuditKeyError(AuditError):
    """The audit signing key or public key is missing, malformed or has unsafe permissions."""


class AuditSignerUnavailable(AuditKeyError):
    """The HSM or KMS that holds the signing key failed to sign (gone, unreachable, disabled):
    an outage of a dependency, not a bad key; the signature may be asked for again later."""

    dependency = "the audit signer"


class ExportError(AuditError, ValueError):
    """The export request is invalid (unknown format, since after until, ...)."""


class VerificationError(AuditError):
    """Base of offline verification errors."""


class VerifyInputError(VerificationError):
    """An input of verify_export is missing or unreadable, or the public key is not Ed25519."""


class ExportVerificationFailed(VerificationError):
    """The export did not verify; ``report`` says where and why."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        where = ""
        if report.first_bad_line is not None:
            where = f" (first bad row: line {report.first_bad_line}"
            where += f", seq {report.first_bad_seq})" if report.first_bad_seq is not None else ")"
        super().__init__("audit export failed verification" + where + ": " + "; ".join(report.problems))
