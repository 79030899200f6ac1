"""Offline verification of an export (no database) and an online check of the stored chain.

``verify_export(export, manifest, public_key, checkpoints)`` checks the manifest's signature
(nothing else is trusted if it fails); every row (its hash recomputed from its fields, seq
increasing, prev_hash links between consecutive seqs; for a whole export no gap and the genesis
at seq 1); the row count, sha256, size, first/last seq and hash against the manifest. A tenant
export (manifest version 2) also has each row's inclusion proof checked against the signed
checkpoint in its manifest, and each row checked to be the tenant's, in the window and in the
signed seq range. Given ``checkpoints``, a whole export must extend each of them (RFC 9162
consistency, from the export's own leaves); a tenant export's checkpoint must be one of them.
It streams the file and names the first bad row by line (CSV: the header is line 1) and seq.
Design: docs/audit.md.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint, read_checkpoint
from audit.errors import AuditKeyError, ExportVerificationFailed, VerifyInputError
from audit.formats import (
    CSV_COLUMNS,
    FORMATS,
    MANIFEST_KIND,
    MANIFEST_VERSION,
    PROVED_MANIFEST_VERSION,
    RowFormatError,
    decode_csv,
    decode_jsonl,
)
from audit.merkle import consistency_proof, leaf_hash, root_of, verify_consistency, verify_inclusion
from audit.record import GENESIS_HASH, chain_hash, parse_time
from audit.signed import check_signature
from audit.signing import PublicKey, load_public_key

if TYPE_CHECKING:  # the offline verifier never imports SQLAlchemy
    from sqlalchemy.ext.asyncio import AsyncEngine

    from audit.store import AuditStore

__all__ = ["ChainChecker", "VerifyReport", "verify_database", "verify_export"]

_MAX_PROBLEMS = 20


@dataclass(frozen=True, slots=True)
class TenantProof:
    """What a tenant export's rows are checked against: its signed checkpoint, tenant, window
    and the seq range of the window in the whole log (all from the signed manifest)."""

    checkpoint: Checkpoint
    tenant: str
    since: str | None
    until: str | None
    first_seq: int | None
    last_seq: int | None

    def problem_with(self, doc: Mapping[str, Any], claimed_hash: str, proof: list[bytes] | None) -> str | None:
        seq = doc.get("seq")
        cp = self.checkpoint
        if proof is None:
            return "the row carries no inclusion proof"
        try:
            leaf = leaf_hash(bytes.fromhex(claimed_hash))
        except ValueError:
            return "the row's hash is not hex"
        if not isinstance(seq, int) or not verify_inclusion(seq - 1, cp.tree_size, leaf, proof, bytes.fromhex(cp.root_hash)):
            return f"not row seq {seq} of the log checkpoint {cp.tree_size} signed (its inclusion proof fails)"
        if self.first_seq is None or self.last_seq is None or not self.first_seq <= seq <= self.last_seq:
            return "outside the seq range the manifest signs for the window"
        actor, target = doc.get("actor"), doc.get("target")
        if self.tenant not in (_get(actor, "tenant"), _get(target, "tenant")):
            return f"not a row of tenant {self.tenant!r}"
        try:
            at = parse_time(str(doc.get("recorded_at")))
            if (self.since and at < parse_time(self.since)) or (self.until and at >= parse_time(self.until)):
                return "recorded outside the export's window"
        except ValueError:
            return "recorded_at is not a time"
        return None


def _get(part: Any, name: str) -> Any:
    return part.get(name) if isinstance(part, Mapping) else None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    ok: bool
    rows: int
    problems: tuple[str, ...]
    first_bad_line: int | None = None
    first_bad_seq: int | None = None
    format: str | None = None
    manifest: Mapping[str, Any] | None = field(default=None, repr=False)
    tree_size: int | None = None  # with checkpoints: the export's Merkle tree
    root_hash: str | None = None
    checkpoints: tuple[str, ...] = ()  # one line per checkpoint checked and found consistent

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise ExportVerificationFailed(self)


class ChainChecker:
    """Feeds on rows in file order; remembers every problem (up to 20) and the first bad row."""

    def __init__(
        self, *, contiguous: bool, pseudonymized: bool = False, leaves: bool = False, proved: TenantProof | None = None
    ) -> None:
        self.contiguous = contiguous
        self.proved = proved
        self.pseudonymized = pseudonymized  # a tenant's export, other tenants' actors replaced
        self.leaves: list[bytes] | None = [] if leaves else None
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

    def feed(self, line: int | None, doc: Mapping[str, Any], claimed_hash: str, proof: list[bytes] | None = None) -> None:
        self.rows += 1
        seq = doc.get("seq")
        if self.proved is not None:
            bad = self.proved.problem_with(doc, claimed_hash, proof)
            if bad is not None:
                self.problem(bad, line, seq)
        if self.leaves is not None:
            try:
                self.leaves.append(leaf_hash(bytes.fromhex(claimed_hash)))
            except (TypeError, ValueError):
                self.leaves.append(leaf_hash(b""))
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


def _signature_ok(manifest: dict[str, Any], key: PublicKey) -> str | None:
    bad = check_signature(manifest, key)
    if bad == "no signature":
        return "manifest has no signature"
    if bad is not None:
        bad = bad.replace("(document modified", "(manifest modified")
        return "manifest " + (bad[4:] if bad.startswith("the ") else bad)
    if manifest.get("kind") != MANIFEST_KIND or manifest.get("manifest_version") not in (
        MANIFEST_VERSION, PROVED_MANIFEST_VERSION
    ):
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

    def proofs() -> list[list[bytes]] | None:
        return [] if checker.proved is not None else None

    try:
        with open(path, "rb") as f:
            lines = _lines(f, digest, size)
            if fmt == "jsonl":
                for number, raw in lines:
                    proof = proofs()
                    try:
                        doc, claimed = decode_jsonl(raw.decode("utf-8"), proof=proof)
                    except (UnicodeDecodeError, RowFormatError) as exc:
                        checker.rows += 1
                        checker.problem(f"unreadable row: {exc}", number, None)
                        continue
                    checker.feed(number, doc, claimed, proof[0] if proof else None)
            else:
                state = {"line": 0}

                def text() -> Iterator[str]:
                    for number, raw in lines:
                        state["line"] = number
                        yield raw.decode("utf-8", errors="replace")

                reader = csv.reader(text(), strict=True)
                try:
                    header = next(reader, None)
                    if header != list(CSV_COLUMNS) + (["proof"] if checker.proved else []):
                        checker.problem("CSV header differs from the record format", 1, None)
                    else:
                        while True:
                            start = state["line"] + 1  # a quoted cell may span lines
                            row = next(reader, None)
                            if row is None:
                                break
                            proof = proofs()
                            try:
                                doc, claimed = decode_csv(row, proof=proof)
                            except RowFormatError as exc:
                                checker.rows += 1
                                checker.problem(f"unreadable row: {exc}", start, None)
                                continue
                            checker.feed(start, doc, claimed, proof[0] if proof else None)
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
    checkpoints: Sequence[str | os.PathLike[str]] = (),
) -> VerifyReport:
    """Verify an export offline against its signed manifest and, if given, against checkpoints
    (signed by the same key); see the module docstring."""
    export, man_path, key_path = Path(export_path), Path(manifest_path), Path(public_key_path)
    if not export.is_file():
        raise VerifyInputError(f"no export file at {export}")
    key = _require_key(key_path)
    heads: list[tuple[str, Checkpoint]] = []
    for cp_path in checkpoints:
        try:
            heads.append((str(cp_path), read_checkpoint(cp_path, key)))
        except CheckpointError as exc:
            return VerifyReport(ok=False, rows=0, problems=(f"checkpoint {cp_path}: {exc}",))
    manifest, bad = _read_manifest(man_path)
    if manifest is not None:
        bad = _signature_ok(manifest, key)
    if bad is not None or manifest is None:
        return VerifyReport(ok=False, rows=0, problems=(bad or "manifest unreadable",), manifest=manifest)
    fmt = manifest["format"]
    proved, bad = _tenant_proof(manifest, key)
    if bad is not None:
        return VerifyReport(ok=False, rows=0, problems=(bad,), manifest=manifest)
    checker = ChainChecker(contiguous=manifest.get("contiguous") is True, leaves=bool(heads) and proved is None, proved=proved)
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
    consistent: list[str] = []
    tree_size: int | None = None
    root: str | None = None
    if proved is not None:
        tree_size, root = proved.checkpoint.tree_size, proved.checkpoint.root_hash
        consistent = _same_checkpoint(checker, proved.checkpoint, heads)
    elif heads:
        tree_size, root, consistent = _check_checkpoints(checker, heads)
    return VerifyReport(
        ok=not checker.problems,
        rows=checker.rows,
        problems=tuple(checker.problems),
        first_bad_line=checker.first_bad_line,
        first_bad_seq=checker.first_bad_seq,
        format=fmt,
        manifest=manifest,
        tree_size=tree_size,
        root_hash=root,
        checkpoints=tuple(consistent),
    )


def _tenant_proof(manifest: Mapping[str, Any], key: PublicKey) -> tuple[TenantProof | None, str | None]:
    """A tenant export's proof material from its signed manifest, or why there is none."""
    flt = manifest.get("filter")
    tenant = flt.get("tenant") if isinstance(flt, Mapping) else None
    if manifest.get("manifest_version") != PROVED_MANIFEST_VERSION:
        if manifest.get("contiguous") is not True or tenant is not None:
            return None, ("a tenant export without inclusion proofs (manifest version 1) cannot show that it holds "
                          "every row of the tenant: export it again")
        return None, None
    if manifest.get("contiguous") is not False or not isinstance(tenant, str) or not tenant:
        return None, "a version 2 manifest is a tenant export's, with its tenant"
    try:
        cp = parse_checkpoint(manifest.get("checkpoint"), key)
    except CheckpointError as exc:
        return None, f"the manifest's checkpoint: {exc}"
    window = manifest.get("range")
    first = window.get("first_seq") if isinstance(window, Mapping) else None
    last = window.get("last_seq") if isinstance(window, Mapping) else None
    if window is not None and not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last <= cp.tree_size):
        return None, "the manifest's seq range is not within its checkpoint"
    assert isinstance(flt, Mapping)
    return TenantProof(cp, tenant, flt.get("since"), flt.get("until"), first, last), None


def _same_checkpoint(checker: ChainChecker, cp: Checkpoint, heads: list[tuple[str, Checkpoint]]) -> list[str]:
    """A tenant export is proved against the checkpoint in its manifest; a checkpoint the
    auditor holds must be that one (for another size: ``kvgate audit verify-consistency``)."""
    same: list[str] = []
    for where, head in heads:
        if head.tree_size == cp.tree_size and head.root_hash == cp.root_hash:
            same.append(f"{where}: the export's rows are proved against this checkpoint (tree size {cp.tree_size})")
        elif head.tree_size == cp.tree_size:
            checker.problem(f"checkpoint {where} has another root for tree size {cp.tree_size} (history rewritten)", None, None)
        else:
            checker.problem(
                f"checkpoint {where} (tree size {head.tree_size}) is not the export's (tree size {cp.tree_size}): "
                "check the two with kvgate audit verify-consistency", None, None,
            )
    return same


def _check_checkpoints(
    checker: ChainChecker, heads: list[tuple[str, Checkpoint]]
) -> tuple[int | None, str | None, list[str]]:
    """Consistency of the export's tree with each checkpoint (RFC 9162 section 2.1.4)."""
    leaves = checker.leaves or []
    consistent: list[str] = []
    if checker.first_seq != 1 or not checker.contiguous:
        checker.problem("a checkpoint check needs an unfiltered export from seq 1 (no --since, no --tenant)", None, None)
        return None, None, consistent
    n = len(leaves)
    if checker.last_seq != n:
        checker.problem(f"the export's rows are not seq 1..{n}", None, None)
        return None, None, consistent
    new_root = root_of(leaves)
    for where, cp in heads:
        m = cp.tree_size
        if m == 0:
            consistent.append(f"{where}: empty tree")
            continue
        if m > n:
            checker.problem(
                f"checkpoint {where} covers {m} rows, the export ends at seq {n} (rows deleted: log truncated)",
                None, n + 1,
            )
            continue
        proof = consistency_proof(leaves, m)
        if not verify_consistency(m, n, bytes.fromhex(cp.root_hash), new_root, proof):
            first_bad = _first_divergence(leaves, m, cp)
            checker.problem(
                f"not consistent with checkpoint {where} (tree size {m}): rows it covers were deleted, "
                f"inserted or rewritten" + (f"; the export's row seq {m} is not the checkpointed last row"
                                            if first_bad else ""),
                None, m if first_bad else None,
            )
            continue
        if leaves[m - 1] != leaf_hash(bytes.fromhex(cp.last_hash)):
            checker.problem(f"checkpoint {where}: its last_hash is not row seq {m}'s hash", None, m)
            continue
        consistent.append(f"{where}: tree size {m} -> {n}, consistency proof of {len(proof)} hashes verified")
    return n, new_root.hex(), consistent


def _first_divergence(leaves: list[bytes], m: int, cp: Checkpoint) -> bool:
    return leaves[m - 1] != leaf_hash(bytes.fromhex(cp.last_hash))


def _require_key(path: Path) -> PublicKey:
    try:
        return load_public_key(path)
    except AuditKeyError as exc:
        raise VerifyInputError(str(exc)) from None


async def verify_database(source: AuditStore | AsyncEngine) -> VerifyReport:
    """Check the whole stored chain: gapless from seq 1, every hash and every link."""
    from audit.store import AuditStore

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
