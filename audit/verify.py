"""Offline verification of an export (no database) and an online check of the stored chain.

``verify_export(export, manifest, public_key)`` checks, in this order:

1. the manifest's Ed25519 signature (if it fails nothing else in the manifest is trusted and
   the check stops);
2. every row: its hash recomputed from its own fields, seq strictly increasing, and, where two
   rows have consecutive seqs, the prev_hash link; for a contiguous export also no gap and, at
   seq 1, the genesis prev_hash;
3. against the manifest: row count, sha256 and size of the file, first/last seq and hash, and
   first_prev_hash.

It streams the file (constant memory) and names the first bad row by physical line number (CSV:
the header is line 1) and seq. A truncated tail is named as the line after the last one read.
See audit.export for why filtered exports verify row by row plus the signed set.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from audit.errors import AuditKeyError, ExportVerificationFailed, VerifyInputError
from audit.export import MANIFEST_KIND, MANIFEST_VERSION
from audit.formats import CSV_COLUMNS, FORMATS, RowFormatError, decode_csv, decode_jsonl
from audit.record import GENESIS_HASH, canonical_json, chain_hash
from audit.signing import load_public_key, verify_signature
from audit.store import AuditStore

__all__ = ["ChainChecker", "VerifyReport", "verify_database", "verify_export"]

_MAX_PROBLEMS = 20


@dataclass(frozen=True, slots=True)
class VerifyReport:
    ok: bool
    rows: int
    problems: tuple[str, ...]
    first_bad_line: int | None = None
    first_bad_seq: int | None = None
    format: str | None = None
    manifest: Mapping[str, Any] | None = field(default=None, repr=False)

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise ExportVerificationFailed(self)


class ChainChecker:
    """Feeds on rows in file order; remembers every problem (up to 20) and the first bad row."""

    def __init__(self, *, contiguous: bool, pseudonymized: bool = False) -> None:
        self.contiguous = contiguous
        self.pseudonymized = pseudonymized  # a tenant's export, other tenants' actors replaced
        self.rows = 0
        self.problems: list[str] = []
        self.first_bad_line: int | None = None
        self.first_bad_seq: int | None = None
        self.first_seq: int | None = None
        self.first_prev_hash: str | None = None
        self.first_hash: str | None = None
        self.last_seq: int | None = None
        self.last_hash: str | None = None
        self._last_line: int | None = None

    def problem(self, message: str, line: int | None, seq: int | None) -> None:
        if self.first_bad_line is None and self.first_bad_seq is None:
            self.first_bad_line, self.first_bad_seq = line, seq
        if len(self.problems) < _MAX_PROBLEMS:
            where = f"line {line}" if line is not None else "row"
            self.problems.append(f"{where}" + (f" (seq {seq})" if seq is not None else "") + f": {message}")

    def _pseudonym(self, doc: Mapping[str, Any]) -> bool:
        """A row whose actor a pseudonymized export replaced: only ``{"subject": "pseudonym:..."}``
        is left, so its content cannot be rehashed (its links and the manifest still bind it)."""
        actor = doc.get("actor")
        return (
            self.pseudonymized and isinstance(actor, Mapping) and isinstance(actor.get("subject"), str)
            and actor["subject"].startswith("pseudonym:") and all(v is None for k, v in actor.items() if k != "subject")
        )

    def feed(self, line: int | None, doc: Mapping[str, Any], claimed_hash: str) -> None:
        self.rows += 1
        seq = doc.get("seq")
        try:
            actual = chain_hash(doc)
        except (TypeError, ValueError) as exc:
            self.problem(f"cannot be hashed: {exc}", line, seq)
            actual = None
        if actual is not None and actual != claimed_hash and not self._pseudonym(doc):
            self.problem("hash does not match the row's contents (row modified)", line, seq)
        prev_seq, prev_hash = self.last_seq, self.last_hash
        if prev_seq is None:
            self.first_seq, self.first_prev_hash, self.first_hash = seq, doc.get("prev_hash"), claimed_hash
            if seq == 1 and doc.get("prev_hash") != GENESIS_HASH:
                self.problem("seq 1 does not start from the genesis hash", line, seq)
        elif not isinstance(seq, int) or seq <= prev_seq:
            self.problem(f"seq is not after the previous row's seq {prev_seq} (rows reordered or repeated)", line, seq)
        elif seq == prev_seq + 1:
            if doc.get("prev_hash") != prev_hash:
                self.problem(f"prev_hash does not link to the previous row (line {self._last_line})", line, seq)
        elif self.contiguous:
            self.problem(f"seq gap: expected seq {prev_seq + 1} (rows missing)", line, seq)
        if isinstance(seq, int) and (prev_seq is None or seq > prev_seq):
            self.last_seq, self.last_hash = seq, claimed_hash
        elif prev_seq is None:
            self.last_seq, self.last_hash = None, claimed_hash
        self._last_line = line


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise VerifyInputError(f"cannot read the manifest {path}: {exc}") from None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        return None, f"manifest is not JSON: {exc}"
    if not isinstance(doc, dict):
        return None, "manifest is not a JSON object"
    return doc, None


def _signature_ok(manifest: dict[str, Any], public_key_path: Path) -> str | None:
    try:
        key = load_public_key(public_key_path)
    except AuditKeyError as exc:
        raise VerifyInputError(str(exc)) from None
    sig_text = manifest.get("signature")
    if not isinstance(sig_text, str):
        return "manifest has no signature"
    try:
        signature = base64.b64decode(sig_text, validate=True)
    except (binascii.Error, ValueError):
        return "manifest signature is not base64"
    unsigned = {k: v for k, v in manifest.items() if k != "signature"}
    try:
        data = canonical_json(unsigned).encode("utf-8")
    except (TypeError, ValueError):
        return "manifest cannot be canonicalised"
    if not verify_signature(key, signature, data):
        return "manifest signature is invalid (manifest modified or signed by another key)"
    if manifest.get("kind") != MANIFEST_KIND or manifest.get("manifest_version") != MANIFEST_VERSION:
        return "not a kvgate audit export manifest of a known version"
    if manifest.get("format") not in FORMATS:
        return f"unknown export format {manifest.get('format')!r}"
    return None


def _lines(f: Any, digest: Any, counter: list[int]) -> Iterator[tuple[int, bytes]]:
    for number, raw in enumerate(f, start=1):
        digest.update(raw)
        counter[0] += len(raw)
        yield number, raw


def _check_rows(path: Path, fmt: str, checker: ChainChecker) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = [0]
    try:
        with open(path, "rb") as f:
            lines = _lines(f, digest, size)
            if fmt == "jsonl":
                for number, raw in lines:
                    try:
                        doc, claimed = decode_jsonl(raw.decode("utf-8"))
                    except (UnicodeDecodeError, RowFormatError) as exc:
                        checker.rows += 1
                        checker.problem(f"unreadable row: {exc}", number, None)
                        continue
                    checker.feed(number, doc, claimed)
            else:
                state = {"line": 0}

                def text() -> Iterator[str]:
                    for number, raw in lines:
                        state["line"] = number
                        yield raw.decode("utf-8", errors="replace")

                reader = csv.reader(text(), strict=True)
                try:
                    header = next(reader, None)
                    if header != list(CSV_COLUMNS):
                        checker.problem("CSV header differs from the record format", 1, None)
                    else:
                        while True:
                            start = state["line"] + 1  # a quoted cell may span lines
                            row = next(reader, None)
                            if row is None:
                                break
                            try:
                                doc, claimed = decode_csv(row)
                            except RowFormatError as exc:
                                checker.rows += 1
                                checker.problem(f"unreadable row: {exc}", start, None)
                                continue
                            checker.feed(start, doc, claimed)
                except csv.Error as exc:
                    checker.problem(f"malformed CSV: {exc}", state["line"], None)
                for _ in lines:  # hash whatever is left after an error
                    pass
    except OSError as exc:
        raise VerifyInputError(f"cannot read the export {path}: {exc}") from None
    return digest.hexdigest(), size[0]


def verify_export(
    export_path: str | os.PathLike[str],
    manifest_path: str | os.PathLike[str],
    public_key_path: str | os.PathLike[str],
) -> VerifyReport:
    """Verify an export offline against its signed manifest; see the module docstring."""
    export, man_path, key_path = Path(export_path), Path(manifest_path), Path(public_key_path)
    if not export.is_file():
        raise VerifyInputError(f"no export file at {export}")
    manifest, bad = _read_manifest(man_path)
    if manifest is not None:
        bad = _signature_ok(manifest, key_path)
    else:
        _require_key(key_path)
    if bad is not None or manifest is None:
        return VerifyReport(ok=False, rows=0, problems=(bad or "manifest unreadable",), manifest=manifest)
    fmt = manifest["format"]
    checker = ChainChecker(contiguous=manifest.get("contiguous") is True)
    checker.pseudonymized = manifest.get("pseudonymized") is True and manifest.get("contiguous") is not True
    sha, size = _check_rows(export, fmt, checker)
    header = 1 if fmt == "csv" else 0
    count = manifest.get("count")
    if checker.rows != count:
        truncated = isinstance(count, int) and checker.rows < count
        nxt = checker.last_seq + 1 if truncated and checker.contiguous and checker.last_seq is not None else None
        if truncated and nxt is None and checker.last_seq is None:
            nxt = manifest.get("first_seq")
        checker.problem(
            f"export has {checker.rows} rows, the manifest says {count}" + (" (truncated)" if truncated else ""),
            checker.rows + header + 1 if truncated else None,
            nxt,
        )
    if sha != manifest.get("export_sha256") or size != manifest.get("export_bytes"):
        checker.problem("the export's sha256 or size differs from the manifest", None, None)
    for name, have in (
        ("first_seq", checker.first_seq),
        ("last_seq", checker.last_seq),
        ("first_prev_hash", checker.first_prev_hash),
        ("first_hash", checker.first_hash),
        ("last_hash", checker.last_hash),
    ):
        if manifest.get(name) != have:
            checker.problem(f"{name} differs from the manifest", None, None)
    return VerifyReport(
        ok=not checker.problems,
        rows=checker.rows,
        problems=tuple(checker.problems),
        first_bad_line=checker.first_bad_line,
        first_bad_seq=checker.first_bad_seq,
        format=fmt,
        manifest=manifest,
    )


def _require_key(path: Path) -> None:
    try:
        load_public_key(path)
    except AuditKeyError as exc:
        raise VerifyInputError(str(exc)) from None


async def verify_database(source: AuditStore | AsyncEngine) -> VerifyReport:
    """Check the whole stored chain: gapless from seq 1, every hash and every link."""
    store = source if isinstance(source, AuditStore) else AuditStore(source)
    checker = ChainChecker(contiguous=True)
    async for rec in store.iter_records():
        checker.feed(None, rec.hashed_fields(), rec.hash)
    if checker.first_seq not in (None, 1):
        checker.problem(f"the chain starts at seq {checker.first_seq}, not 1 (rows deleted)", None, checker.first_seq)
    return VerifyReport(
        ok=not checker.problems,
        rows=checker.rows,
        problems=tuple(checker.problems),
        first_bad_line=None,
        first_bad_seq=checker.first_bad_seq,
    )
