"""Export line formats, JSON Lines and CSV, and their exact inverse for verification.

Both carry every hashed field of a row plus its ``hash``, so each row can be checked on its own.

- JSONL: one canonical JSON object per line: the hashed document (see audit.record) with
  ``details`` as a JSON object rather than its text, plus ``"hash"``. Unknown keys are refused.
- CSV: a header of ``CSV_COLUMNS``, then one row per record (RFC 4180: CRLF line ends, cells
  with a comma, quote, CR or LF quoted); actor and target fields are flattened
  (``actor_subject``...), ``details`` is the canonical JSON text, an empty cell is an absent
  value. Cells are exact (no spreadsheet-formula
  escaping: that would change hashed values); open the file as text, not in a spreadsheet.
- A tenant-filtered export (manifest version 2) adds each row's RFC 9162 inclusion proof against
  the manifest's checkpoint: a ``"proof"`` list of hex hashes in JSONL, a last ``proof`` column of
  space-separated hex in CSV (``PROOF_COLUMN``).
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from audit.record import (
    ACTOR_FIELDS,
    RECORD_VERSION,
    TARGET_FIELDS,
    AuditRecord,
    canonical_json,
)

__all__ = [
    "CSV_COLUMNS",
    "FORMATS",
    "MANIFEST_KIND",
    "MANIFEST_VERSION",
    "PROOF_COLUMN",
    "PROVED_MANIFEST_VERSION",
    "RowFormatError",
    "csv_header",
    "decode_csv",
    "decode_jsonl",
    "decode_proof",
    "manifest_path_for",
    "encode_csv",
    "encode_jsonl",
]

FORMATS = ("jsonl", "csv")
MANIFEST_KIND = "kvgate.audit.export"
MANIFEST_VERSION = 1
PROVED_MANIFEST_VERSION = 2  # a tenant-filtered export whose rows carry inclusion proofs
PROOF_COLUMN = "proof"
_HEAD = ("v", "seq", "event_id", "occurred_at", "recorded_at")
_MID = ("action", "outcome")
_TAIL = ("details", "prev_hash", "hash")
CSV_COLUMNS: tuple[str, ...] = (
    _HEAD + tuple(f"actor_{n}" for n in ACTOR_FIELDS) + _MID + tuple(f"target_{n}" for n in TARGET_FIELDS) + _TAIL
)
_DOC_KEYS = frozenset(_HEAD + _MID + _TAIL + ("actor", "target"))


def manifest_path_for(export_path: str | os.PathLike[str]) -> Path:
    """The conventional manifest path next to an export: ``<export>.manifest.json``."""
    p = Path(export_path)
    return p.with_name(p.name + ".manifest.json")


class RowFormatError(ValueError):
    """A line of an export is not a well-formed row."""


def encode_jsonl(rec: AuditRecord, proof: list[bytes] | None = None) -> bytes:
    doc: dict[str, Any] = rec.hashed_fields()
    doc["details"] = json.loads(doc["details"])
    doc["hash"] = rec.hash
    if proof is not None:
        doc[PROOF_COLUMN] = [h.hex() for h in proof]
    return (canonical_json(doc) + "\n").encode("utf-8")


def _csv_line(values: list[Any]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(values)
    return buf.getvalue().encode("utf-8")


def csv_header(proofs: bool = False) -> bytes:
    return _csv_line(list(CSV_COLUMNS) + ([PROOF_COLUMN] if proofs else []))


def encode_csv(rec: AuditRecord, proof: list[bytes] | None = None) -> bytes:
    doc = rec.hashed_fields()
    flat: dict[str, Any] = {k: doc[k] for k in _HEAD + _MID}
    flat.update({f"actor_{n}": doc["actor"][n] for n in ACTOR_FIELDS})
    flat.update({f"target_{n}": doc["target"][n] for n in TARGET_FIELDS})
    flat.update(details=doc["details"], prev_hash=doc["prev_hash"], hash=rec.hash)
    cells = ["" if flat[c] is None else flat[c] for c in CSV_COLUMNS]
    if proof is not None:
        cells.append(" ".join(h.hex() for h in proof))
    return _csv_line(cells)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowFormatError(f"{name} must be an integer")
    return value


def decode_proof(value: Any) -> list[bytes]:
    """An inclusion proof: a list of 64-digit hex hashes (JSONL) or that text space-separated (CSV)."""
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(h, str) and len(h) == 64 for h in items):
        raise RowFormatError("proof must be a list of 64-digit hex hashes")
    try:
        return [bytes.fromhex(h) for h in items]
    except ValueError:
        raise RowFormatError("proof must be a list of 64-digit hex hashes") from None


def decode_jsonl(line: str, *, proof: list[list[bytes]] | None = None) -> tuple[dict[str, Any], str]:
    """(hashed document, claimed hash) from one JSONL line. With ``proof`` (a list), the row
    must carry an inclusion proof, which is appended to it."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise RowFormatError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RowFormatError("not a JSON object")
    if proof is not None:
        if PROOF_COLUMN not in doc:
            raise RowFormatError("the row carries no inclusion proof")
        proof.append(decode_proof(doc.pop(PROOF_COLUMN)))
    if set(doc) != _DOC_KEYS:
        raise RowFormatError(f"fields differ from the record format: {sorted(set(doc) ^ _DOC_KEYS)}")
    claimed = doc.pop("hash")
    if not isinstance(claimed, str):
        raise RowFormatError("hash must be a string")
    _int(doc["seq"], "seq")
    for part, names in (("actor", ACTOR_FIELDS), ("target", TARGET_FIELDS)):
        if not isinstance(doc[part], dict) or set(doc[part]) != set(names):
            raise RowFormatError(f"{part} fields differ from the record format")
    if not isinstance(doc["details"], dict):
        raise RowFormatError("details must be an object")
    doc["details"] = canonical_json(doc["details"])
    return doc, claimed


def _strict_int(text: str | None) -> int:
    value = int(text or "")
    if str(value) != text:
        raise ValueError(text)
    return value


def decode_csv(row: list[str], *, proof: list[list[bytes]] | None = None) -> tuple[dict[str, Any], str]:
    """(hashed document, claimed hash) from one CSV data row; ``proof`` as in decode_jsonl."""
    if proof is not None:
        if len(row) != len(CSV_COLUMNS) + 1:
            raise RowFormatError(f"{len(row)} cells, expected {len(CSV_COLUMNS) + 1}")
        proof.append(decode_proof(row[-1]))
        row = row[:-1]
    if len(row) != len(CSV_COLUMNS):
        raise RowFormatError(f"{len(row)} cells, expected {len(CSV_COLUMNS)}")
    flat: dict[str, str | None] = {c: (v if v != "" else None) for c, v in zip(CSV_COLUMNS, row)}
    try:
        version = _strict_int(flat["v"])
        seq = _strict_int(flat["seq"])
        count = flat["target_chunk_count"]
        chunk_count = _strict_int(count) if count is not None else None
    except ValueError:
        raise RowFormatError("v, seq and target_chunk_count must be integers") from None
    if version != RECORD_VERSION:
        raise RowFormatError(f"unknown record version {version}")
    actor = {n: flat[f"actor_{n}"] for n in ACTOR_FIELDS}
    target: dict[str, Any] = {n: flat[f"target_{n}"] for n in TARGET_FIELDS}
    target["chunk_count"] = chunk_count
    doc: dict[str, Any] = {k: flat[k] for k in ("event_id", "occurred_at", "recorded_at", "action", "outcome")}
    doc.update(
        v=version, seq=seq, actor=actor, target=target, details=flat["details"] or "", prev_hash=flat["prev_hash"]
    )
    return doc, flat["hash"] or ""
