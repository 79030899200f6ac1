"""Signed checkpoints against the database owner: each of the four rewrites an owner
can make with the append-only triggers disabled -- cut the tail, cut it and let new rows append,
edit a row and recompute the chain after it, insert a row and recompute -- still passes the
chain check and the next signed export (the old weakness, shown), and is caught by
``verify_export(..., checkpoints=[earlier checkpoint])`` and refused by the checkpointer.
An untampered log verifies against the same checkpoint (positive control). On SQLite and Postgres.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError
from sqlalchemy import delete, insert

from audit import (
    AuditSigningKey,
    AuditWriter,
    EcdsaSigner,
    create_audit_engine,
    create_audit_schema,
    export_to_files,
    verify_database,
    verify_export,
)
from audit.checkpoint import CheckpointDirectory, CheckpointError, read_checkpoint, verify_checkpoint_consistency
from audit.checkpointer import Checkpointer, CheckpointTampered
from audit.models import audit_events
from audit.record import AuditRecord
from audit.signing import load_public_key, load_public_key_pem
from gateway.config import Settings
from tests.support.audit_events import event

REWRITES = ["truncate", "delete_then_append", "edit_and_rechain", "insert_and_rechain"]


class LocalEcBackend:
    """A software P-256 key standing in for an HSM or KMS behind EcdsaSigner (those run in
    tests/crypto/test_kek_pkcs11.py and tests/crypto/test_kek_kms.py)."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes

        return self._key.sign(data, ec.ECDSA(hashes.SHA256()))

    def public_key_pem(self) -> bytes:
        return self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


class Log:
    """An audit database with a writer, a signing key, a checkpoint directory."""

    def __init__(self, url: str, tmp: Path, signer) -> None:
        self.url, self.tmp, self.signer = url, tmp, signer
        self.pub = tmp / "audit_public.pem"
        self.pub.write_bytes(signer.public_key_pem())
        self.cps = CheckpointDirectory(tmp / "checkpoints")
        self.exports = 0

    async def start(self) -> None:
        self.engine = create_audit_engine(self.url)
        await create_audit_schema(self.engine)
        await self.open_writer()

    async def open_writer(self) -> None:
        self.writer = AuditWriter(self.engine, spool_dir=self.tmp / "spool")
        await self.writer.start()
        self.checkpointer = Checkpointer(self.writer.store, self.signer, self.cps, sink=self.writer)

    async def close(self) -> None:
        await self.writer.aclose()
        await self.engine.dispose()

    async def emit(self, tag: str, n: int) -> None:
        for i in range(n):
            self.writer.emit(event(tag, i))
        await self.writer.flush(30)

    async def checkpoint(self) -> Path:
        """A checkpoint, copied where an auditor keeps it (outside the server's directory)."""
        cp = await self.checkpointer.checkpoint()
        kept = self.tmp / f"auditor-{cp.tree_size}.json"
        shutil.copy(self.cps.files()[0], kept)
        return kept

    async def export(self) -> tuple[Path, Path]:
        self.exports += 1
        out = self.tmp / f"export-{self.exports}.jsonl"
        man = self.tmp / f"export-{self.exports}.jsonl.manifest.json"
        await export_to_files(self.engine, self.signer, out, man)
        return out, man

    # -- the database owner ---------------------------------------------------------------
    async def owner_sql(self, statements) -> None:
        async with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                await conn.exec_driver_sql("ALTER TABLE kv_audit_events DISABLE TRIGGER USER")
            else:
                await conn.exec_driver_sql("DROP TRIGGER IF EXISTS kv_audit_events_no_update")
                await conn.exec_driver_sql("DROP TRIGGER IF EXISTS kv_audit_events_no_delete")
            for stmt in statements:
                await conn.execute(stmt)

    async def records(self) -> list[AuditRecord]:
        return [r async for r in self.writer.store.iter_records()]

    async def rechain_from(self, seq: int, events) -> None:
        """Replace every row from ``seq`` on by ``events``, with a recomputed chain."""
        rows = await self.records()
        prev = rows[seq - 2].hash if seq > 1 else "0" * 64
        new = []
        for i, e in enumerate(events):
            rec = AuditRecord.chain(e.event, seq=seq + i, recorded_at=e.recorded_at, prev_hash=prev)
            prev = rec.hash
            new.append(rec.to_row())
        await self.owner_sql([delete(audit_events).where(audit_events.c.seq >= seq), insert(audit_events).values(new)])


async def tamper(log: Log, how: str) -> None:
    rows = await log.records()
    if how == "truncate":
        await log.owner_sql([delete(audit_events).where(audit_events.c.seq > 15)])
    elif how == "delete_then_append":
        await log.owner_sql([delete(audit_events).where(audit_events.c.seq > 15)])
        await log.writer.aclose()  # a restart: new rows chain onto the cut log
        await log.open_writer()
        await log.emit("after", 12)
    elif how == "edit_and_rechain":
        victim = rows[4]
        edited = dataclasses.replace(victim.event, details='{"i":999}')  # canonical JSON text
        tail = [dataclasses.replace(victim, event=edited)] + rows[5:]
        await log.rechain_from(5, tail)
    elif how == "insert_and_rechain":
        forged = dataclasses.replace(rows[6], event=dataclasses.replace(
            rows[6].event, event_id="00000000-0000-7000-8000-000000000001", details='{"forged":true}'))
        await log.rechain_from(8, [forged] + rows[7:])
    else:  # pragma: no cover
        raise AssertionError(how)


@pytest.fixture
async def log(db_url: str, tmp_path: Path):
    lg = Log(db_url, tmp_path, AuditSigningKey.generate())
    await lg.start()
    try:
        yield lg
    finally:
        await lg.close()


@pytest.mark.parametrize("how", REWRITES)
async def test_owner_rewrite_is_caught_by_an_earlier_checkpoint(log: Log, how: str) -> None:
    await log.emit("before", 20)
    kept = await log.checkpoint()  # 20 rows; the checkpoint event itself is row 21
    await log.emit("more", 4)
    out, man = await log.export()
    control = verify_export(out, man, log.pub, [kept])  # positive control: the untampered log
    assert control.ok, control.problems
    assert control.checkpoints and "consistency proof" in control.checkpoints[0]

    await tamper(log, how)

    assert (await verify_database(log.engine)).ok  # the chain alone does not see it
    out, man = await log.export()
    assert verify_export(out, man, log.pub).ok  # nor does the freshly signed export
    report = verify_export(out, man, log.pub, [kept])
    assert not report.ok, how
    assert any("checkpoint" in p for p in report.problems), report.problems
    with pytest.raises(CheckpointTampered):  # and no new checkpoint is signed over it
        await log.checkpointer.checkpoint()


async def test_checkpoints_chain_and_prove_consistency(log: Log) -> None:
    await log.emit("a", 10)
    first = await log.checkpoint()
    await log.emit("b", 7)
    second = await log.checkpoint()
    key = load_public_key(log.pub)
    a, b = read_checkpoint(first, key), read_checkpoint(second, key)
    assert (a.tree_size, b.tree_size) == (10, 18)  # 10 rows; then 10 + checkpoint event + 7
    proof = await log.checkpointer.consistency(a.tree_size, b.tree_size)
    assert proof["first_root"] == a.root_hash and proof["second_root"] == b.root_hash
    assert verify_checkpoint_consistency(a, b, proof) is None
    bad = dict(proof, proof=list(reversed(proof["proof"])))
    assert verify_checkpoint_consistency(a, b, bad) is not None
    # the log carries its own checkpoints
    rows = await log.records()
    cps = [json.loads(r.event.details) for r in rows if r.event.action == "audit.checkpoint"]
    assert [c["tree_size"] for c in cps] == [10, 18] and cps[1]["root_hash"] == b.root_hash
    # rewritten after the second checkpoint: the database's proof no longer joins the signed roots
    await tamper(log, "edit_and_rechain")
    proof = await log.checkpointer.consistency(a.tree_size, b.tree_size)
    assert proof["first_root"] != a.root_hash
    assert verify_checkpoint_consistency(a, b, proof) is not None


@pytest.mark.parametrize("signer", ["ed25519", "ecdsa-p256"])
async def test_checkpoint_signature_verifies_with_the_exported_public_key(sqlite_url: str, tmp_path: Path, signer) -> None:
    key = AuditSigningKey.generate() if signer == "ed25519" else EcdsaSigner(LocalEcBackend())
    lg = Log(sqlite_url, tmp_path, key)
    await lg.start()
    try:
        await lg.emit("x", 3)
        kept = await lg.checkpoint()
        out, man = await lg.export()
    finally:
        await lg.close()
    cp = read_checkpoint(kept, load_public_key(lg.pub))
    assert cp.tree_size == 3 and cp.document["signature_algorithm"] == key.algorithm
    assert verify_export(out, man, lg.pub, [kept]).ok
    other = tmp_path / "other.pem"
    other.write_bytes(AuditSigningKey.generate().public_key_pem())
    with pytest.raises(CheckpointError, match="signature"):
        read_checkpoint(kept, load_public_key(other))
    doc = json.loads(kept.read_text())
    doc["tree_size"] = 2  # a checkpoint edited by hand
    kept.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError):
        read_checkpoint(kept, load_public_key(lg.pub))
    report = verify_export(out, man, lg.pub, [kept])
    assert not report.ok and "checkpoint" in report.problems[0]


async def test_a_tenant_export_is_checked_against_its_own_checkpoint(sqlite_url: str, tmp_path: Path) -> None:
    """A tenant export is proved against the checkpoint in its manifest: one the auditor holds
    must be that one; another size is a matter for ``kvgate audit verify-consistency``."""
    lg = Log(sqlite_url, tmp_path, AuditSigningKey.generate())
    await lg.start()
    try:
        await lg.emit("x", 3)
        kept = await lg.checkpoint()
        out, man = tmp_path / "t.jsonl", tmp_path / "t.jsonl.manifest.json"
        await export_to_files(lg.engine, lg.signer, out, man, tenant="t1", checkpoints=lg.checkpointer)
        await lg.emit("y", 2)
        later = await lg.checkpoint()
    finally:
        await lg.close()
    report = verify_export(out, man, lg.pub, [kept])
    assert report.ok and report.tree_size == 3 and report.checkpoints, report.problems
    report = verify_export(out, man, lg.pub, [later])
    assert not report.ok and "verify-consistency" in " ".join(report.problems)


def test_production_refuses_the_pem_signer(tmp_path: Path) -> None:
    hsm = dict(kek_provider="pkcs11", pkcs11_module="/usr/lib/softhsm/libsofthsm2.so", pkcs11_token_label="kv",
               pkcs11_pin="1234")
    with pytest.raises(ValidationError, match="PEM audit signing key is for development only"):
        Settings(state_dir=tmp_path, mode="production", dev_issuer=False, audit_signer="file", **hsm)
    s = Settings(state_dir=tmp_path, mode="production", dev_issuer=False, **hsm)
    assert s.audit_signer_kind == "pkcs11"  # auto: where the KEK lives
    assert Settings(state_dir=tmp_path, **hsm).audit_signer_kind == "file"  # development
    with pytest.raises(ValidationError, match="audit_kms_key_id"):
        Settings(state_dir=tmp_path, audit_signer="kms")


async def test_periodic_checkpoints_keep_going_and_refuse_a_tampered_log(sqlite_url: str, tmp_path: Path, caplog) -> None:
    import asyncio
    import logging

    lg = Log(sqlite_url, tmp_path, AuditSigningKey.generate())
    await lg.start()
    try:
        await lg.emit("x", 5)
        task = asyncio.create_task(lg.checkpointer.run_every(0.05))
        await asyncio.sleep(0.4)
        assert len(lg.cps.files()) >= 2  # and each one extends the last (they are signed only if so)
        await lg.owner_sql([delete(audit_events).where(audit_events.c.seq > 2)])
        with caplog.at_level(logging.CRITICAL, logger="audit.checkpointer"):
            for _ in range(100):  # a checkpoint already in flight may still land: wait for the refusal
                if "tampering detected" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            made = len(lg.cps.files())
            await asyncio.sleep(0.3)  # several more periods: none of them may sign a checkpoint
        assert not task.done() and len(lg.cps.files()) == made
        assert "tampering detected" in caplog.text
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await lg.close()


async def test_checkpoints_are_mirrored_to_a_redis_stream(sqlite_url: str, tmp_path: Path, redis_url: str,
                                                          redis_prefix: str) -> None:
    """Where Redis is configured, every checkpoint is also appended to a Redis stream (a second
    store outside the audit database); the copy verifies like the file."""
    from audit.checkpoint import parse_checkpoint
    from storage.streams import RedisStream
    from tests.support.gw import gateway_runtime

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    async with gateway_runtime(state, None, redis_url=redis_url, redis_prefix=redis_prefix) as rt:
        await rt.admin.create_tenant("acme")
        cp = await rt.checkpointer.checkpoint()
        pem = rt.signer.public_key_pem()
    stream = RedisStream(redis_url, redis_prefix + "audit-checkpoints")
    try:
        (latest,) = await stream.latest()
    finally:
        await stream.aclose()
    copy = parse_checkpoint(json.loads(latest), load_public_key_pem(pem))
    assert (copy.tree_size, copy.root_hash) == (cp.tree_size, cp.root_hash)
