"""Export: stream audit rows as JSON Lines or CSV, then sign a manifest that binds them.

    export = AuditExport(store, signing_key, format="jsonl", since=t0, until=t1, tenant=None)
    async for chunk in export.stream():   # bytes, a few hundred rows at a time
        sink.write(chunk)
    manifest = export.manifest_bytes()    # available once the stream is exhausted

Rows come in seq order from one database snapshot and are never all in memory.

Why each row carries ``prev_hash`` and ``hash`` (and how filtered exports verify): an export
filtered by tenant leaves holes in the chain, so a verifier cannot recompute the chain from one
row to the next everywhere. Instead every row is self-checking (its hash is recomputed from its
own fields and prev_hash) and, wherever two exported rows have consecutive seqs, the link
(``prev_hash`` = previous ``hash``) is checked too. The signed manifest then binds the set as a
whole: the sha256 of the exact bytes, the row count, first/last seq and hash, and whether the
export must be contiguous. Without a tenant filter it must be: the time window is on
``recorded_at``, which is monotonic along seq (audit.store), so the rows are a gapless run of
the chain, every link is checked and any missing row is named. ``first_prev_hash`` lets an
auditor join consecutive windows: the next export's first_prev_hash is this one's last_hash.
A filtered export proves each row authentic and the set exactly what the signer exported;
proving the filter was complete needs an unfiltered export of the same window.

Pseudonymized exports (``pseudonymize=True``, a tenant's own export): rows whose actor belongs to
another tenant (or to no tenant: an unauthenticated caller) keep what was done to the tenant but
not who did it: the actor becomes ``{"subject": "pseudonym:<32 hex>"}`` and nothing else, the hex
an HMAC over the actor's fields under a key derived from the signing key and the exported tenant.
The same actor gets the same pseudonym in every export of that tenant, an unrelated one in another
tenant's export. Such a row's hash cannot be recomputed from the exported fields (that is the
point), so the verifier checks its links and the signed manifest, not its content.

Manifest (JSON, signed over its canonical JSON without ``signature``; see audit.signed)::

    {"kind": "kvgate.audit.export", "manifest_version": 1, "record_version": 1,
     "format": "jsonl"|"csv", "created_at": TIME,
     "filter": {"since": TIME|null, "until": TIME|null, "tenant": str|null},
     "contiguous": bool, "pseudonymized": bool, "count": int, "first_seq", "last_seq": int|null,
     "first_prev_hash", "first_hash", "last_hash": hex|null,
     "export_sha256": hex, "export_bytes": int,
     "signature_algorithm": "Ed25519"|"ECDSA-P256-SHA256", "key_id": hex, "signature": base64}
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
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from audit.errors import ExportError
from audit.formats import (
    FORMATS,
    MANIFEST_KIND,
    MANIFEST_VERSION,
    csv_header,
    encode_csv,
    encode_jsonl,
    manifest_path_for,
)
from audit.record import RECORD_VERSION, format_time
from audit.signed import sign_document
from audit.signing import AuditSigner
from audit.store import AuditStore
from audit.types import Actor

__all__ = [
    "MANIFEST_KIND", "MANIFEST_VERSION", "PSEUDONYM_PREFIX", "AuditExport", "export_to_files", "manifest_path_for",
    "sign_manifest",
]

PSEUDONYM_PREFIX = "pseudonym:"

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
        derive: Callable[[bytes], bytes] | None = getattr(key, "derive", None)
        if pseudonymize and not callable(derive):
            raise ExportError("a pseudonymized export needs a signer that can derive keys (the local Ed25519 key)")
        self._pseudonym_key = (
            derive(b"pseudonym\x00" + tenant.encode("utf-8"))
            if pseudonymize and tenant is not None and derive is not None
            else None
        )
        self._store = source if isinstance(source, AuditStore) else AuditStore(source)
        self._key = key
        self.format = format
        self._since, self._until, self._tenant = since, until, tenant
        self._clock = clock
        self._started = False
        self._manifest: dict[str, Any] | None = None

    async def stream(self) -> AsyncIterator[bytes]:
        """The export's bytes, in chunks of about 64 KiB."""
        if self._started:
            raise ExportError("an AuditExport can be streamed once")
        self._started = True
        created_at = self._clock()
        digest = hashlib.sha256()
        size = count = 0
        first: Any = None
        last: Any = None
        encode = encode_jsonl if self.format == "jsonl" else encode_csv
        parts: list[bytes] = [csv_header()] if self.format == "csv" else []
        pending = sum(map(len, parts))
        async for rec in self._store.iter_records(since=self._since, until=self._until, tenant=self._tenant):
            line = encode(self._pseudonymized(rec))
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
        if parts:
            chunk = b"".join(parts)
            digest.update(chunk)
            size += len(chunk)
            yield chunk
        body = {
            "kind": MANIFEST_KIND,
            "manifest_version": MANIFEST_VERSION,
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
