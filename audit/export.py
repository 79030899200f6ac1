"""Export: stream audit rows as JSON Lines or CSV, then sign a manifest that binds them.

    export = AuditExport(store, signer, format="jsonl", since=t0, until=t1)
    async for chunk in export.stream():   # bytes, a few hundred rows at a time
        sink.write(chunk)
    manifest = export.manifest_bytes()    # available once the stream is exhausted

A whole export (no tenant) is a gapless run of the chain (manifest version 1). A tenant's export
(``tenant=``, manifest version 2) is proved against a signed checkpoint (``checkpoints=``): the
exporter first checks every row the checkpoint covers against its root, then each exported row
carries its RFC 9162 inclusion proof, and the signed manifest holds the checkpoint and the seq
range of the window, so a row deleted, added or reordered in the database fails the export and
a changed file fails verification. ``pseudonymize=True`` (a tenant's own export) replaces other
tenants' actors by an HMAC under ``pseudonym_secret``. Design and formats: docs/audit.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from audit.checkpoint import Checkpoint
from audit.checkpointer import CheckpointTampered
from audit.errors import ExportError
from audit.formats import (
    FORMATS,
    MANIFEST_KIND,
    MANIFEST_VERSION,
    PROVED_MANIFEST_VERSION,
    csv_header,
    encode_csv,
    encode_jsonl,
    manifest_path_for,
)
from audit.merkle import MerkleTree, leaf_hash
from audit.record import GENESIS_HASH, RECORD_VERSION, AuditRecord, chain_hash, format_time
from audit.signed import sign_document
from audit.signing import AuditSigner
from audit.store import AuditStore
from audit.types import Actor

__all__ = [
    "MANIFEST_KIND", "MANIFEST_VERSION", "PSEUDONYM_PREFIX", "AuditExport", "export_to_files", "manifest_path_for",
    "sign_manifest", "CheckpointSource", "pseudonym_key",
]

PSEUDONYM_PREFIX = "pseudonym:"
_PSEUDONYM_LABEL = b"kvgate/audit-pseudonym/v1\x00"


class CheckpointSource(Protocol):
    """Where a tenant export finds its checkpoint (audit.checkpointer.Checkpointer is one)."""

    def covering(self, size: int) -> Checkpoint | None: ...


def pseudonym_key(secret: bytes, tenant: str) -> bytes:
    """The key of ``tenant``'s pseudonyms: HMAC-SHA256 of the tenant under the gateway's
    pseudonym secret (32 random bytes kept wrapped by the KEK)."""
    return hmac.new(secret, _PSEUDONYM_LABEL + tenant.encode("utf-8"), hashlib.sha256).digest()


@dataclasses.dataclass
class _Proved:
    """What the first pass of a tenant export established: the checkpoint, its tree, and the
    seqs of the tenant's rows in the window (all checked against the checkpoint's root)."""

    checkpoint: Checkpoint
    tree: MerkleTree
    positions: list[int]
    first_seq: int | None  # the window's seq range in the whole log, within the checkpoint
    last_seq: int | None

_CHUNK_BYTES = 64 * 1024


def _utcnow() -> datetime:
    return datetime.now(UTC)


def sign_manifest(body: dict[str, Any], key: AuditSigner) -> dict[str, Any]:
    """Add algorithm, key id and signature over the canonical JSON of ``body``."""
    return sign_document(body, key)


class AuditExport:
    """One export run: iterate :meth:`stream` once, then read :meth:`manifest`."""

    def __init__(
        self,
        source: AuditStore | AsyncEngine,
        key: AuditSigner,
        *,
        format: str = "jsonl",
        since: datetime | None = None,
        until: datetime | None = None,
        tenant: str | None = None,
        pseudonymize: bool = False,
        pseudonym_secret: bytes | None = None,
        checkpoints: CheckpointSource | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        if format not in FORMATS:
            raise ExportError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}")
        for name, t in (("since", since), ("until", until)):
            if t is not None and (not isinstance(t, datetime) or t.tzinfo is None):
                raise ExportError(f"{name} must be a timezone-aware datetime")
        if since is not None and until is not None and since >= until:
            raise ExportError("since must be before until")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ExportError("tenant must be a non-empty string")
        if not isinstance(key, AuditSigner):
            raise ExportError("key must be an audit signer (AuditSigningKey, EcdsaSigner)")
        if pseudonymize and tenant is None:
            raise ExportError("pseudonymize needs a tenant (whose actors are kept)")
        if pseudonymize and (not isinstance(pseudonym_secret, bytes) or len(pseudonym_secret) < 32):
            raise ExportError("a pseudonymized export needs the gateway's pseudonym secret (32 bytes)")
        if tenant is not None and checkpoints is None:
            raise ExportError("a tenant export is proved against a signed checkpoint: pass checkpoints")
        self._pseudonym_key = (
            pseudonym_key(pseudonym_secret, tenant)
            if pseudonymize and tenant is not None and pseudonym_secret is not None
            else None
        )
        self._checkpoints = checkpoints
        self._proved: _Proved | None = None
        self._store = source if isinstance(source, AuditStore) else AuditStore(source)
        self._key = key
        self.format = format
        self._since, self._until, self._tenant = since, until, tenant
        self._clock = clock
        self._started = False
        self._manifest: dict[str, Any] | None = None

    async def prepare(self) -> None:
        """A tenant export's first pass (nothing for a whole export): pick the checkpoint, check
        every row it covers against its root, note the tenant's rows. Raises CheckpointTampered
        when the database no longer holds what the checkpoint signed; ExportError without one."""
        if self._tenant is None or self._proved is not None:
            return
        assert self._checkpoints is not None
        wanted = await self._store.last_seq(until=self._until)
        cp = await asyncio.to_thread(self._checkpoints.covering, wanted)
        if cp is None:
            raise ExportError("no signed checkpoint to prove a tenant export against: write one first")
        leaves: list[bytes] = []
        positions: list[int] = []
        first = last = None
        prev = GENESIS_HASH
        async for rec in self._store.iter_records(through_seq=cp.tree_size):
            seq = len(leaves) + 1
            if rec.seq != seq:
                raise CheckpointTampered(f"row seq {rec.seq} where seq {seq} was expected (rows deleted)")
            if rec.prev_hash != prev or chain_hash(rec.hashed_fields()) != rec.hash:
                raise CheckpointTampered(f"row seq {seq} was modified, or rows before it were")
            leaves.append(leaf_hash(bytes.fromhex(rec.hash)))
            prev = rec.hash
            if self._in_window(rec):
                first = first or seq
                last = seq
                if self._tenant in (rec.event.target.tenant, rec.event.actor.tenant):
                    positions.append(seq)
        tree = MerkleTree(leaves)
        if tree.size != cp.tree_size or tree.root().hex() != cp.root_hash or (tree.size and prev != cp.last_hash):
            raise CheckpointTampered(
                f"the log's first {cp.tree_size} rows are not those checkpoint {cp.tree_size} signed "
                f"(the database holds {tree.size} of them; rows deleted, inserted or rewritten)"
            )
        self._proved = _Proved(cp, tree, positions, first, last)

    def _in_window(self, rec: AuditRecord) -> bool:
        t = rec.recorded_at
        return (self._since is None or t >= self._since) and (self._until is None or t < self._until)

    async def stream(self) -> AsyncIterator[bytes]:
        """The export's bytes, in chunks of about 64 KiB."""
        if self._started:
            raise ExportError("an AuditExport can be streamed once")
        self._started = True
        await self.prepare()
        proved = self._proved
        created_at = self._clock()
        digest = hashlib.sha256()
        size = count = 0
        first: Any = None
        last: Any = None
        encode = encode_jsonl if self.format == "jsonl" else encode_csv
        parts: list[bytes] = [csv_header(proofs=proved is not None)] if self.format == "csv" else []
        pending = sum(map(len, parts))
        through = proved.checkpoint.tree_size if proved is not None else None
        rows = self._store.iter_records(since=self._since, until=self._until, tenant=self._tenant, through_seq=through)
        async for rec in rows:
            proof = None
            if proved is not None:
                if count >= len(proved.positions) or rec.seq != proved.positions[count] or (
                    leaf_hash(bytes.fromhex(rec.hash)) != proved.tree.leaf(rec.seq - 1)
                ):
                    raise CheckpointTampered(f"row seq {rec.seq} changed while it was exported")
                proof = proved.tree.inclusion_proof(rec.seq - 1)
            line = encode(self._pseudonymized(rec), proof)
            parts.append(line)
            pending += len(line)
            count += 1
            first = first or rec
            last = rec
            if pending >= _CHUNK_BYTES:
                chunk = b"".join(parts)
                digest.update(chunk)
                size += len(chunk)
                parts, pending = [], 0
                yield chunk
        if proved is not None and count != len(proved.positions):
            raise CheckpointTampered("rows of the tenant disappeared while they were exported")
        if parts:
            chunk = b"".join(parts)
            digest.update(chunk)
            size += len(chunk)
            yield chunk
        body: dict[str, Any] = {
            "kind": MANIFEST_KIND,
            "manifest_version": MANIFEST_VERSION if proved is None else PROVED_MANIFEST_VERSION,
            "record_version": RECORD_VERSION,
            "format": self.format,
            "created_at": format_time(created_at),
            "filter": {
                "since": format_time(self._since) if self._since else None,
                "until": format_time(self._until) if self._until else None,
                "tenant": self._tenant,
            },
            "contiguous": self._tenant is None,
            "pseudonymized": self._pseudonym_key is not None,
            "count": count,
            "first_seq": first.seq if first else None,
            "last_seq": last.seq if last else None,
            "first_prev_hash": first.prev_hash if first else None,
            "first_hash": first.hash if first else None,
            "last_hash": last.hash if last else None,
            "export_sha256": digest.hexdigest(),
            "export_bytes": size,
        }
        if proved is not None:
            body["checkpoint"] = dict(proved.checkpoint.document)
            body["range"] = (
                None if proved.first_seq is None else {"first_seq": proved.first_seq, "last_seq": proved.last_seq}
            )
        self._manifest = sign_manifest(body, self._key)

    def _pseudonymized(self, rec: Any) -> Any:
        actor = rec.event.actor
        if self._pseudonym_key is None or actor.tenant == self._tenant:
            return rec
        fields = json.dumps([actor.issuer, actor.tenant, actor.subject, actor.client_id, actor.token_id, actor.source])
        tag = hmac.new(self._pseudonym_key, fields.encode("utf-8"), hashlib.sha256).hexdigest()[:32]
        event = dataclasses.replace(rec.event, actor=Actor(subject=PSEUDONYM_PREFIX + tag))
        return dataclasses.replace(rec, event=event)

    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            raise ExportError("the manifest exists once the export stream has been read to its end")
        return dict(self._manifest)

    def manifest_bytes(self) -> bytes:
        return (json.dumps(self.manifest(), indent=2, sort_keys=True) + "\n").encode("utf-8")


async def export_to_files(
    source: AuditStore | AsyncEngine,
    key: AuditSigner,
    export_path: str | os.PathLike[str],
    manifest_path: str | os.PathLike[str],
    **options: Any,
) -> dict[str, Any]:
    """Write the export and its manifest; returns the manifest. Files appear only when complete."""
    export = AuditExport(source, key, **options)
    out, man = Path(export_path), Path(manifest_path)
    tmp_out = out.with_name(f".{out.name}.partial")
    try:
        f = await asyncio.to_thread(open, tmp_out, "wb")
        try:
            async for chunk in export.stream():
                await asyncio.to_thread(f.write, chunk)
            await asyncio.to_thread(os.fsync, f.fileno())
        finally:
            f.close()
        os.replace(tmp_out, out)
        await asyncio.to_thread(man.write_bytes, export.manifest_bytes())
    except OSError as exc:
        raise ExportError(f"cannot write the export: {exc}") from exc
    finally:
        tmp_out.unlink(missing_ok=True)
    return export.manifest()
