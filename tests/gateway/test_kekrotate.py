"""KEK rotation over 10,000 wrapped data keys (killed halfway, then finished by a restart), its
resumability and audit, the keyring cache's TTL and size bound, and the KEK provider settings.

Rotation here moves between two real key files; the HSM and KMS providers are rotated in
tests/crypto/test_kek_pkcs11.py. The setup inserts the 10,000 wrapped keys with one bulk INSERT.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from sqlalchemy import func, insert, select

from audit.models import audit_events
from audit.types import AuditEvent
from crypto.contexts import ns_salt_context as salt_context
from crypto.errors import KekError, KeyUnavailable
from crypto.kek import LocalFileKek
from gateway.config import Settings
from gateway.services.kekrotate import ROTATE_ACTION, rotate_kek
from tenancy.keyring import Keyring, dek_context
from tenancy.models import DataKey, Tenant
from tenancy.registry import Registry
from tests.support.gw import (
    ALL_OPS,
    gateway_runtime,
    gathered,
    migrate,
    model_for,
    random_cache,
    small_geometry,
    zero_cache,
)
from tests.support.paths import REPO

NUM_BLOCKS = 32
REPO = REPO


# -- helpers ---------------------------------------------------------------------------------------
async def _bulk_keys(registry: Registry, kek: LocalFileKek, tenants: int, versions: int) -> dict:
    """Insert tenants x versions wrapped data keys in one transaction; returns a sample of DEKs."""
    sample: dict[tuple[str, int], bytes] = {}
    rows = []
    for i in range(tenants):
        tenant = f"bulk-{i:05d}"
        for v in range(1, versions + 1):
            dek = os.urandom(32)
            if i % 97 == 0:
                sample[(tenant, v)] = dek
            rows.append({
                "tenant_id": tenant, "version": v, "wrapped_key": kek.wrap(dek, dek_context(tenant, v)),
                "kek_id": kek.key_id, "state": "active" if v == versions else "retired",
                "invocations": 0, "invocation_limit": 2**32,
            })
    async with registry.engine.begin() as conn:
        await conn.execute(insert(Tenant), [{"id": f"bulk-{i:05d}", "status": "active"} for i in range(tenants)])
        await conn.execute(insert(DataKey), rows)
    return sample


async def _count_under(registry: Registry, kek_id: str) -> int:
    async with registry.engine.connect() as conn:
        q = select(func.count()).select_from(DataKey).where(DataKey.kek_id == kek_id)
        return (await conn.execute(q)).scalar_one()


async def _store_chunks(state_dir: Path, db: str | None, tenants=("acme", "globex")) -> tuple:
    g = small_geometry()
    model = model_for(g)
    src, blocks, tokens = random_cache(g, NUM_BLOCKS, seed=11), list(range(10)), list(range(40))
    async with gateway_runtime(state_dir, db, kek_file=state_dir / "kek-a.key") as rt:
        for tenant in tenants:
            await rt.admin.create_tenant(tenant)
            cap = await rt.gateway.mint_capability(tenant, "default", ALL_OPS, 600)
            assert (await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)).stored == 3
    return g, model, src, blocks, tokens


async def _chunks_load(state_dir: Path, db: str | None, kek_file: Path, stored: tuple, tenants=("acme", "globex")) -> None:
    g, model, src, blocks, tokens = stored
    async with gateway_runtime(state_dir, db, migrate_first=False, kek_file=kek_file) as rt:
        for tenant in tenants:
            cap = await rt.gateway.mint_capability(tenant, "default", ALL_OPS, 600)
            dst = zero_cache(g, NUM_BLOCKS)
            got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)
            assert got.loaded_tokens == 40 and got.integrity_failures == 0
            assert torch.equal(gathered(src, g, blocks, 40), gathered(dst, g, blocks, 40))


class _Events:
    """An audit sink that keeps events in a list (the real writer is used by the CLI test)."""

    def __init__(self) -> None:
        self.events: list[AuditEvent] = []

    def emit(self, event: AuditEvent) -> None:
        self.events.append(event)


class _CrashAfter:
    """The new KEK, but the process "dies" (RuntimeError) after ``n`` wraps."""

    def __init__(self, kek: LocalFileKek, n: int) -> None:
        self.kek, self.left = kek, n
        self.key_id = kek.key_id

    def wrap(self, key: bytes, context: bytes) -> bytes:
        if self.left <= 0:
            raise RuntimeError("crash")
        self.left -= 1
        return self.kek.wrap(key, context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        return self.kek.unwrap(wrapped, context)

    def health(self) -> None:
        self.kek.health()


# -- rotation --------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_rotation_of_10000_keys_killed_halfway_then_finished(tmp_path: Path, db_url: str) -> None:
    db = db_url
    stored = await _store_chunks(tmp_path, db)
    old, new_path = LocalFileKek(tmp_path / "kek-a.key", create=False), tmp_path / "kek-b.key"
    new = LocalFileKek(new_path)
    registry = Registry.from_url(db)
    try:
        sample = await _bulk_keys(registry, old, tenants=2000, versions=5)
        total = await _count_under(registry, old.key_id)
        assert total == 10_000 + 2  # plus acme's and globex's own keys
        env = os.environ | {
            "KVGATE_STATE_DIR": str(tmp_path), "KVGATE_DATABASE_URL": db, "KVGATE_KEK_FILE": str(new_path),
        }
        env.pop("KVGATE_CONFIG", None)
        cmd = [sys.executable, "-m", "gateway", "keys", "rotate-kek", "--from-kek-file", str(old.path), "--batch-size", "50"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        done = 0
        while done < 1000 and proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            done = await _count_under(registry, new.key_id)
        assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]  # still running: kill it
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        halfway = await _count_under(registry, new.key_id)
        assert 0 < halfway < total and await _count_under(registry, old.key_id) == total - halfway

        run = await asyncio.to_thread(
            subprocess.run, cmd, check=False, cwd=REPO, env=env, capture_output=True, timeout=300
        )
        out = run.stdout.decode()
        assert run.returncode == 0, out[-2000:] + run.stderr.decode()[-2000:]
        assert '"complete": true' in out and f'"data_keys": {total - halfway}' in out  # only the rest
        assert await _count_under(registry, new.key_id) == total
        assert await _count_under(registry, old.key_id) == 0
        for (tenant, v), dek in sample.items():  # same DEKs, now under the new KEK
            rec = await registry.get_key(tenant, v)
            assert rec is not None and new.unwrap(rec.wrapped_key, dek_context(tenant, v)) == dek
        for name in ("namespace-master", "capability-key", "audit-pseudonym"):
            assert (await registry.get_secret(name))[1] == new.key_id
        for tenant in ("acme", "globex"):
            ns = await registry.get_namespace(tenant, "default")
            new.unwrap(ns.wrapped_salt, salt_context(tenant, "default", ns.epoch))
        async with registry.engine.connect() as conn:
            q = select(audit_events.c.outcome).where(audit_events.c.action == ROTATE_ACTION)
            outcomes = [r[0] for r in (await conn.execute(q)).all()]
        assert outcomes.count("success") >= 2  # started (twice) and completed; the killed run left no end
    finally:
        await registry.aclose()
    old.path.unlink()  # the old KEK is gone: every chunk written before the rotation still loads
    await _chunks_load(tmp_path, db, new_path, stored)


async def test_rotation_resumes_after_a_crash_and_is_audited(tmp_path: Path, db_url: str) -> None:
    db = db_url
    stored = await _store_chunks(tmp_path, db)
    old, new = LocalFileKek(tmp_path / "kek-a.key", create=False), LocalFileKek(tmp_path / "kek-b.key")
    registry = Registry.from_url(db)
    try:
        await _bulk_keys(registry, old, tenants=100, versions=3)
        total = 300 + 2
        events = _Events()
        with pytest.raises(RuntimeError, match="crash"):
            await rotate_kek(registry, _CrashAfter(new, 120), previous=[old], audit=events, batch_size=50)
        assert await _count_under(registry, new.key_id) == 100  # two whole batches were committed
        assert [e.details["phase"] for e in events.events] == ["started", "interrupted"]
        assert events.events[-1].outcome == "failure"

        report = await rotate_kek(registry, new, previous=[old], audit=events, batch_size=50)
        assert report.complete and report.failed == []
        assert (report.data_keys, report.secrets, report.salts, report.already_current) == (total - 100, 3, 2, 0)  # three gateway secrets
        assert events.events[-1].details["phase"] == "completed" and events.events[-1].outcome == "success"
        again = await rotate_kek(registry, new, previous=[old], batch_size=50)
        assert (again.rewrapped, again.already_current) == (0, 2)

        # a row no configured KEK can unwrap is reported, left as it is, and does not stop the rest
        stranger = LocalFileKek(tmp_path / "kek-c.key")
        await registry.create_tenant("stray")
        await registry.add_key("stray", lambda v: stranger.wrap(b"s" * 32, dek_context("stray", v)),
                               stranger.key_id, 2**32, expect_active=None)
        report = await rotate_kek(registry, new, previous=[old], audit=events, batch_size=50)
        assert not report.complete and report.failed == ["data_key:stray/1"]
        assert events.events[-1].details["phase"] == "incomplete" and events.events[-1].outcome == "failure"
        assert (await registry.get_key("stray", 1)).kek_id == stranger.key_id
    finally:
        await registry.aclose()
    await _chunks_load(tmp_path, db, new.path, stored)


async def test_destroyed_key_is_not_resurrected(tmp_path: Path, sqlite_url: str) -> None:
    await migrate(sqlite_url)
    old, new = LocalFileKek(tmp_path / "a.key"), LocalFileKek(tmp_path / "b.key")
    registry = Registry.from_url(sqlite_url)
    try:
        keyring = Keyring(registry, old)
        await registry.create_tenant("acme")
        await keyring.create("acme")
        await keyring.rotate("acme")
        await keyring.destroy("acme", [1])
        report = await rotate_kek(registry, new, previous=[old])
        assert report.data_keys == 1
        assert (await registry.get_key("acme", 1)).wrapped_key is None
        assert (await registry.get_key("acme", 2)).kek_id == new.key_id
        assert await Keyring(registry, new).decryption_key("acme", 2)
    finally:
        await registry.aclose()


# -- keyring cache: TTL and size bound --------------------------------------------------------------
async def test_keyring_cache_has_a_ttl_and_a_size_bound(tmp_path: Path, sqlite_url: str) -> None:
    await migrate(sqlite_url)
    now = [1000.0]
    registry = Registry.from_url(sqlite_url)
    try:
        kek = LocalFileKek(tmp_path / "kek.key")
        keyring = Keyring(registry, kek, cache_ttl=60, cache_size=2, clock=lambda: now[0])
        await registry.create_tenant("acme")
        for _ in range(3):
            await keyring.rotate("acme")  # versions 1, 2, 3 (cached when made)
        version, dek = await keyring.encryption_key("acme")
        assert version == 3
        # the registry loses the wrapped keys behind the keyring's back: only the cache answers
        await registry.destroy_keys("acme")
        assert await keyring.decryption_key("acme", 3) == dek
        assert await keyring.decryption_key("acme", 2)
        with pytest.raises(KeyUnavailable):  # evicted by the size bound (2 entries)
            await keyring.decryption_key("acme", 1)
        assert (await keyring.encryption_key("acme"))[0] == 3  # the budget is still live
        now[0] += 61
        with pytest.raises(KeyUnavailable):  # expired: unwrapped again, and it is gone
            await keyring.decryption_key("acme", 3)
        assert (await keyring.encryption_key("acme"))[0] == 4  # the old budget expired too
        with pytest.raises(ValueError):
            Keyring(registry, kek, cache_ttl=0)
    finally:
        await registry.aclose()


# -- settings ---------------------------------------------------------------------------------------
def test_development_provider_refuses_production(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="development only"):
        Settings(state_dir=tmp_path, mode="production", dev_issuer=False)
    with pytest.raises(ValidationError, match="development only"):
        Settings(state_dir=tmp_path, mode="production", dev_issuer=False, kek_provider="file")


def test_hsm_and_kms_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(state_dir=tmp_path, mode="production", dev_issuer=False, kek_provider="pkcs11",
                 pkcs11_module="/usr/lib/softhsm/libsofthsm2.so", pkcs11_token_label="kv", pkcs11_pin="s3cret-pin")
    assert s.pkcs11_pin is not None and s.pkcs11_pin.get_secret_value() == "s3cret-pin"
    assert "s3cret-pin" not in repr(s) and "s3cret-pin" not in str(s.model_dump())
    with pytest.raises(ValidationError, match="pkcs11_pin"):
        Settings(state_dir=tmp_path, kek_provider="pkcs11", pkcs11_module="/x.so", pkcs11_token_label="kv")
    with pytest.raises(ValidationError, match="kms_key_id"):
        Settings(state_dir=tmp_path, kek_provider="kms")
    with pytest.raises(ValidationError):
        Settings(state_dir=tmp_path, kek_provider="vault")
    monkeypatch.setenv("KVGATE_KEK_PROVIDER", "kms")
    monkeypatch.setenv("KVGATE_KMS_KEY_ID", "alias/kvgate")
    monkeypatch.setenv("KVGATE_KMS_ENDPOINT_URL", "http://127.0.0.1:4566")
    monkeypatch.setenv("KVGATE_KMS_PREVIOUS_KEY_IDS", '["alias/kvgate-old"]')
    with pytest.raises(ValidationError, match="audit_kms_key_id"):  # production signs audit with KMS too
        Settings(state_dir=tmp_path, mode="production", dev_issuer=False)
    monkeypatch.setenv("KVGATE_AUDIT_KMS_KEY_ID", "alias/kvgate-audit")
    s = Settings(state_dir=tmp_path, mode="production", dev_issuer=False)
    assert (s.kek_provider, s.kms_key_id, s.kms_previous_key_ids) == ("kms", "alias/kvgate", ["alias/kvgate-old"])
    assert (s.audit_signer_kind, s.audit_kms_key_id) == ("kms", "alias/kvgate-audit")


def test_make_kek_reports_a_missing_module_as_kek_error(tmp_path: Path) -> None:
    if importlib.util.find_spec("pkcs11") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("python-pkcs11 is not installed (CI must install kvgate[pkcs11])")
        pytest.skip("python-pkcs11 is not installed")
    from gateway.services.runtime import make_kek

    s = Settings(state_dir=tmp_path, kek_provider="pkcs11", pkcs11_module=tmp_path / "nope.so",
                 pkcs11_token_label="kv", pkcs11_pin="1234")
    with pytest.raises(KekError, match="cannot load"):
        make_kek(s)
