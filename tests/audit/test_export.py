"""Export with a signed manifest and offline verification; every tampering is caught and named."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from audit.checkpoint import CheckpointDirectory
from audit.checkpointer import Checkpointer
from audit.db import create_audit_engine, create_audit_schema
from audit.errors import AuditKeyError, ExportError, ExportVerificationFailed, VerifyInputError
from audit.export import AuditExport, export_to_files, manifest_path_for
from audit.record import PendingEvent
from audit.signing import AuditSigningKey, load_public_key
from audit.store import AuditStore
from audit.types import Actor, AuditEvent, Target
from audit.verify import verify_export

T0 = datetime(2025, 5, 1, tzinfo=UTC)
ROWS = 24


@pytest.fixture
async def store(db_url: str):
    engine = create_audit_engine(db_url)
    await create_audit_schema(engine)
    times = iter(T0 + timedelta(minutes=m) for m in range(10_000))
    store = AuditStore(engine, clock=lambda: next(times))
    for i in range(ROWS):  # one row per append: recorded_at = T0 + i minutes
        tenant = "acme" if i % 3 == 0 else "globex"
        event = AuditEvent(
            "clear.completed" if i % 2 else "pin",
            actor=Actor(subject=f"user-{i:04d}", tenant=tenant, source="10.1.2.3"),
            target=Target(tenant=tenant, namespace='ns, "quoted"', chunk_count=i, tier_from="redis"),
            details={"i": i, "note": 'comma, "quote" and ünïcode'},
        )
        await store.append([PendingEvent.from_event(event, T0)])
    yield store
    await engine.dispose()


@pytest.fixture
def key(tmp_path: Path) -> AuditSigningKey:
    return AuditSigningKey.load_or_create(tmp_path / "keys" / "audit.key")


@pytest.fixture
def pub(tmp_path: Path, key: AuditSigningKey) -> Path:
    return key.write_public_key(tmp_path / "audit.pub.pem")


async def export(store, key, tmp_path: Path, fmt: str, **kw) -> tuple[Path, Path, dict]:
    """Export as the CLI does; a tenant's export after a checkpoint, proved against it."""
    out = tmp_path / f"export.{fmt}"
    man = manifest_path_for(out)
    if kw.get("tenant") is not None:
        kw["checkpoints"] = Checkpointer(store, key, CheckpointDirectory(tmp_path / "checkpoints"))
        await kw["checkpoints"].checkpoint()
    manifest = await export_to_files(store, key, out, man, format=fmt, **kw)
    return out, man, manifest


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
async def test_untouched_export_verifies(store, key, pub, tmp_path, fmt) -> None:
    out, man, manifest = await export(store, key, tmp_path, fmt)
    assert manifest["count"] == ROWS and manifest["first_seq"] == 1 and manifest["contiguous"] is True
    report = verify_export(out, man, pub)
    assert report.ok, report.problems
    assert report.rows == ROWS and report.first_bad_line is None
    report.raise_for_failure()


def _edit_lines(path: Path, edit) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(edit(lines)))


def _swap(lines, i):
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return lines


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
@pytest.mark.parametrize(
    "case, edit",
    [
        ("modified row", lambda ls: [line.replace(b"user-0006", b"mallory01") for line in ls]),
        ("deleted row", lambda ls: ls[:-15] + ls[-14:]),
        ("swapped pair", lambda ls: _swap(ls, len(ls) - 10)),
        ("truncated tail", lambda ls: ls[:-3]),
    ],
)
async def test_tampered_export_fails_and_names_the_row(store, key, pub, tmp_path, fmt, case, edit) -> None:
    out, man, _ = await export(store, key, tmp_path, fmt)
    header = 1 if fmt == "csv" else 0
    _edit_lines(out, edit)
    report = verify_export(out, man, pub)
    assert not report.ok, case
    expected = {  # (line, seq) the verifier must name first
        "modified row": (6 + 1 + header, 7),
        "deleted row": (ROWS - 15 + header + 1, ROWS - 15 + 2),  # gap: the next row is named
        "swapped pair": (ROWS - 10 + header + 1, ROWS - 10 + 2),  # the later row came first
        "truncated tail": (ROWS - 3 + header + 1, ROWS - 3 + 1),  # the first missing row
    }[case]
    assert (report.first_bad_line, report.first_bad_seq) == expected, report.problems
    with pytest.raises(ExportVerificationFailed, match=f"line {expected[0]}"):
        report.raise_for_failure()


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
async def test_modified_manifest_or_other_key_fails(store, key, pub, tmp_path, fmt) -> None:
    out, man, manifest = await export(store, key, tmp_path, fmt)
    for field, value in (("count", ROWS - 1), ("export_sha256", "0" * 64), ("contiguous", False)):
        man.write_text(json.dumps({**manifest, field: value}))
        report = verify_export(out, man, pub)
        assert not report.ok and "signature" in report.problems[0], field
    man.write_text("{not json")
    assert not verify_export(out, man, pub).ok
    man.write_text(json.dumps(manifest))
    assert verify_export(out, man, pub).ok
    other = AuditSigningKey.generate().write_public_key(tmp_path / "other.pem")
    assert not verify_export(out, man, other).ok


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
async def test_filtered_export_checks_rows_links_and_set(store, key, pub, tmp_path, fmt) -> None:
    out, man, manifest = await export(store, key, tmp_path, fmt, tenant="acme")
    assert manifest["count"] == ROWS // 3 and manifest["contiguous"] is False
    assert verify_export(out, man, pub).ok
    lines = out.read_bytes().splitlines(keepends=True)
    header = 1 if fmt == "csv" else 0
    out.write_bytes(b"".join(lines[: header + 2] + lines[header + 3 :]))  # drop one row: a gap is legal
    report = verify_export(out, man, pub)
    assert not report.ok and any("rows" in p and "manifest says" in p for p in report.problems)


async def test_consecutive_windows_join_and_chunks_stream(store, key, pub, tmp_path) -> None:
    cut = T0 + timedelta(minutes=10)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = await export(store, key, tmp_path / "a", "jsonl", until=cut)
    b = await export(store, key, tmp_path / "b", "jsonl", since=cut)
    assert (a[2]["last_seq"], b[2]["first_seq"]) == (10, 11)
    assert b[2]["first_prev_hash"] == a[2]["last_hash"]
    assert verify_export(a[0], a[1], pub).ok and verify_export(b[0], b[1], pub).ok
    # the stream is chunked (here forced small), never one buffer
    import audit.export as export_module

    chunks = []
    old = export_module._CHUNK_BYTES
    export_module._CHUNK_BYTES = 1024
    try:
        run = AuditExport(store, key, format="csv")
        async for chunk in run.stream():
            chunks.append(chunk)
    finally:
        export_module._CHUNK_BYTES = old
    assert len(chunks) > 3 and run.manifest()["count"] == ROWS


async def test_empty_export_verifies(store, key, pub, tmp_path) -> None:
    out, man, manifest = await export(store, key, tmp_path, "csv", tenant="nobody")
    assert manifest["count"] == 0 and manifest["first_hash"] is None
    assert man == manifest_path_for(out)
    assert verify_export(out, man, pub).ok


async def test_export_parameters_are_validated(store, key) -> None:
    for kwargs in ({"format": "xml"}, {"since": datetime(2025, 1, 1)}, {"since": T0, "until": T0}, {"tenant": ""}):
        with pytest.raises(ExportError):
            AuditExport(store, key, **kwargs)
    run = AuditExport(store, key)
    with pytest.raises(ExportError):
        run.manifest()
    async for _ in run.stream():
        pass
    with pytest.raises(ExportError):
        async for _ in run.stream():
            pass


def test_verify_input_errors_are_typed(tmp_path: Path, key: AuditSigningKey, pub: Path) -> None:
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "m.json").write_text("{}")
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(VerifyInputError):
        verify_export(tmp_path / "missing.jsonl", tmp_path / "m.json", pub)
    with pytest.raises(VerifyInputError):
        verify_export(tmp_path / "e.jsonl", tmp_path / "missing.json", pub)
    with pytest.raises(VerifyInputError):
        verify_export(tmp_path / "e.jsonl", tmp_path / "m.json", tmp_path / "junk.pem")


def test_key_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "state" / "audit.key"
    k1 = AuditSigningKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert AuditSigningKey.load_or_create(path).key_id == k1.key_id
    assert "PRIVATE" not in repr(k1) and k1.key_id[:16] in repr(k1)
    assert b"BEGIN PUBLIC KEY" in k1.public_key_pem()
    assert load_public_key(k1.write_public_key(tmp_path / "pub.pem")) == k1.public_key
    os.chmod(path, 0o644)
    with pytest.raises(AuditKeyError, match="group or others"):
        AuditSigningKey.load(path)
    (tmp_path / "bad.key").write_text("junk")
    os.chmod(tmp_path / "bad.key", 0o600)
    with pytest.raises(AuditKeyError):
        AuditSigningKey.load(tmp_path / "bad.key")


async def test_concurrent_key_creation_yields_one_key(tmp_path: Path) -> None:
    path = tmp_path / "race" / "audit.key"
    keys = await asyncio.gather(*(asyncio.to_thread(AuditSigningKey.load_or_create, path) for _ in range(8)))
    assert len({k.key_id for k in keys}) == 1
    assert [p.name for p in path.parent.iterdir()] == ["audit.key"]


async def test_rehashed_modified_row_breaks_the_next_link(store, key, pub, tmp_path) -> None:
    from audit.formats import decode_jsonl
    from audit.record import canonical_json, chain_hash

    out, man, _ = await export(store, key, tmp_path, "jsonl")
    lines = out.read_bytes().splitlines(keepends=True)
    doc, _ = decode_jsonl(lines[6].decode())
    doc["actor"] = {**doc["actor"], "subject": "mallory"}
    forged = {**doc, "details": json.loads(doc["details"]), "hash": chain_hash(doc)}  # self-consistent
    lines[6] = (canonical_json(forged) + "\n").encode()
    out.write_bytes(b"".join(lines))
    report = verify_export(out, man, pub)
    assert not report.ok and (report.first_bad_line, report.first_bad_seq) == (8, 8)
    assert "prev_hash" in report.problems[0]


def _resign(man: Path, out: Path, key: AuditSigningKey, **changes) -> None:
    """A manifest signed again over an edited export: what only the signer could make. The
    verifier must still find what is wrong from the rows and the checkpoint alone."""
    import hashlib

    from audit.export import sign_manifest

    doc = json.loads(man.read_text())
    data = out.read_bytes()
    body = {k: v for k, v in doc.items() if k not in ("signature", "signature_algorithm", "key_id")}
    body.update(export_sha256=hashlib.sha256(data).hexdigest(), export_bytes=len(data), count=len(data.splitlines()))
    body.update(changes)
    man.write_text(json.dumps(sign_manifest(body, key)))


async def test_tenant_export_rows_are_proved_against_its_checkpoint(store, key, pub, tmp_path) -> None:
    from audit.merkle import MerkleTree, leaf_hash

    out, man, manifest = await export(store, key, tmp_path, "jsonl", tenant="acme")
    assert manifest["manifest_version"] == 2 and manifest["checkpoint"]["tree_size"] == ROWS
    assert manifest["range"] == {"first_seq": 1, "last_seq": ROWS}
    report = verify_export(out, man, pub)
    assert report.ok and report.tree_size == ROWS, report.problems  # the control
    good = out.read_text().splitlines(keepends=True)

    rows = [json.loads(line) for line in good]
    rows[2]["proof"] = rows[2]["proof"][:-1]  # a proof a hash short
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _resign(man, out, key)
    report = verify_export(out, man, pub)
    assert not report.ok and "inclusion proof fails" in report.problems[0] and report.first_bad_seq == 7

    # a row of another tenant, with a valid proof, slipped into acme's export
    full = [json.loads(line) async for line in _lines(store, key)]
    tree = MerkleTree([leaf_hash(bytes.fromhex(r["hash"])) for r in full])
    intruder = dict(full[1], proof=[h.hex() for h in tree.inclusion_proof(1)])
    out.write_text(good[0] + json.dumps(intruder) + "\n" + "".join(good[1:]))
    _resign(man, out, key)
    report = verify_export(out, man, pub)
    assert not report.ok and "not a row of tenant 'acme'" in report.problems[0]

    out.write_text("".join(good))  # the rows as exported, under a seq range that leaves some out
    _resign(man, out, key, range={"first_seq": 1, "last_seq": 9})
    report = verify_export(out, man, pub)
    assert not report.ok and "seq range" in report.problems[0]


async def _lines(store, key):
    run = AuditExport(store, key)
    async for chunk in run.stream():
        for line in chunk.decode().splitlines():
            yield line


async def test_a_tenant_export_without_proofs_is_not_taken_as_complete(store, key, pub, tmp_path) -> None:
    out, man, _ = await export(store, key, tmp_path, "jsonl", tenant="acme")
    rows = [{k: v for k, v in json.loads(line).items() if k != "proof"} for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the version 1 format of a tenant export
    _resign(man, out, key, manifest_version=1, checkpoint=None)
    report = verify_export(out, man, pub)
    assert not report.ok and "cannot show that it holds every row" in report.problems[0]


async def test_a_tenant_export_is_refused_when_the_log_no_longer_matches_its_checkpoint(store, key, tmp_path) -> None:
    from audit.checkpointer import CheckpointTampered

    cps = Checkpointer(store, key, CheckpointDirectory(tmp_path / "checkpoints"))
    await cps.checkpoint()
    async with store.engine.begin() as conn:  # the owner deletes an acme row
        if store.engine.dialect.name == "postgresql":
            await conn.exec_driver_sql("ALTER TABLE kv_audit_events DISABLE TRIGGER USER")
        else:
            await conn.exec_driver_sql("DROP TRIGGER kv_audit_events_no_delete")
        await conn.exec_driver_sql("DELETE FROM kv_audit_events WHERE seq = 7")
    with pytest.raises(CheckpointTampered, match="seq 8 where seq 7"):
        await AuditExport(store, key, tenant="acme", checkpoints=cps).prepare()
    with pytest.raises(ExportError, match="checkpoint"):
        AuditExport(store, key, tenant="acme")  # no checkpoints: refused, not exported unproved


async def test_pseudonyms_are_keyed_by_the_secret_whatever_the_signer(store, key, tmp_path) -> None:
    from audit.signing import EcdsaSigner
    from tests.audit.test_checkpoint import LocalEcBackend

    probe = AuditEvent("authz.denied", "denied", actor=Actor(subject="mallory", tenant="globex"), target=Target(tenant="acme"))
    await store.append([PendingEvent.from_event(probe, T0)])
    cps = Checkpointer(store, key, CheckpointDirectory(tmp_path / "checkpoints"))
    await cps.checkpoint()

    async def pseudonym(signer, secret: bytes) -> str:
        run = AuditExport(store, signer, tenant="acme", pseudonymize=True, pseudonym_secret=secret, checkpoints=cps)
        text = b"".join([c async for c in run.stream()]).decode()
        (subject,) = [json.loads(line)["actor"]["subject"] for line in text.splitlines() if "authz.denied" in line]
        assert "mallory" not in text and "globex" not in text
        return str(subject)

    secret = os.urandom(32)
    ed = await pseudonym(key, secret)
    assert ed.startswith("pseudonym:")
    assert await pseudonym(EcdsaSigner(LocalEcBackend()), secret) == ed  # an HSM- or KMS-style signer: the same
    assert await pseudonym(key, os.urandom(32)) != ed  # another gateway's secret: unrelated
    with pytest.raises(ExportError, match="pseudonym secret"):
        AuditExport(store, key, tenant="acme", pseudonymize=True, checkpoints=cps)
