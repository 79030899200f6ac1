"""Registry, keyring and schema management against SQLite and a real Postgres."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest
from sqlalchemy import inspect

from crypto.errors import KeyUnavailable
from crypto.kek import LocalFileKek
from gateway import errors
from gateway.services import dbschema
from gateway.services.dbschema import SchemaBehind
from gateway.services.runtime import open_runtime
from tenancy.keyring import Keyring
from tenancy.registry import Registry, TenantExists
from tests.support.gw import ALL_OPS, gateway_runtime, migrate, model_for, random_cache, settings_for, small_geometry, zero_cache

REGISTRY_TABLES = {"kv_tenants", "kv_namespaces", "kv_data_keys", "kv_pins", "kv_clear_jobs", "kv_secrets", "kv_revocations"}


async def _tables(url: str) -> set[str]:
    reg = Registry.from_url(url)
    try:
        async with reg.engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await reg.aclose()


async def test_migrations_upgrade_and_downgrade(db_url):
    await asyncio.to_thread(dbschema.upgrade, db_url)
    tables = await _tables(db_url)
    assert REGISTRY_TABLES <= tables and "kv_audit_events" in tables
    await asyncio.to_thread(dbschema.downgrade, db_url, "base")
    assert not (REGISTRY_TABLES | {"kv_audit_events"}) & await _tables(db_url)
    await asyncio.to_thread(dbschema.upgrade, db_url)  # and up again
    assert REGISTRY_TABLES <= await _tables(db_url)


async def test_refuses_to_start_on_a_schema_that_is_behind(tmp_path, db_url):
    settings = settings_for(tmp_path, db_url)
    with pytest.raises(SchemaBehind, match="kvgate migrate"):
        await open_runtime(settings)
    await asyncio.to_thread(dbschema.upgrade, db_url, "0001_registry")
    with pytest.raises(SchemaBehind, match="kvgate migrate"):
        await open_runtime(settings)
    await migrate(db_url)
    rt = await open_runtime(settings)  # positive control
    await rt.aclose()


async def test_core_round_trip_and_clear_on_each_database(tmp_path, db_url):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(40))
    src = random_cache(g, 32)
    async with gateway_runtime(tmp_path, db_url) as rt:
        await rt.admin.create_tenant("acme")
        await rt.admin.create_tenant("globex")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        cap_b = await rt.gateway.mint_capability("globex", "default", ALL_OPS, 600)
        await rt.gateway.store(cap, model, tokens, src, block_ids=list(range(10)))
        assert (await rt.gateway.lookup(cap_b, model, tokens)).hit_tokens == 0
        dst = zero_cache(g, 32)
        assert (await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=list(range(10)))).loaded_tokens == 40
        with pytest.raises(errors.TenantExists):
            await rt.admin.create_tenant("acme")
        await rt.admin.clear("acme")
        fresh = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        assert (await rt.gateway.lookup(fresh, model, tokens)).hit_tokens == 0
        await rt.audit.flush(10)
        assert await rt.audit.store.count() >= 6


async def test_registry_races_settle_on_one_answer(db_url):
    await migrate(db_url)
    reg = Registry.from_url(db_url)
    try:
        await reg.create_tenant("acme")
        with pytest.raises(TenantExists):
            await reg.create_tenant("acme")
        results = await asyncio.gather(*(reg.create_namespace("acme", "ns", os.urandom(40)) for _ in range(8)))
        assert len({r.wrapped_salt for r in results}) == 1
        assert await reg.bump_epoch("acme", "ns", 1, b"x" * 40)
        assert not await reg.bump_epoch("acme", "ns", 1, b"y" * 40)  # a second bump of the same epoch
        assert (await reg.get_namespace("acme", "ns")).epoch == 1
    finally:
        await reg.aclose()


def _encrypt_many(url: str, kek_path: str, n: int, q) -> None:
    async def go() -> list[int]:
        reg = Registry.from_url(url)
        try:
            ring = Keyring(reg, LocalFileKek(kek_path), invocation_limit=50, reserve_block=7)
            return [(await ring.encryption_key("acme"))[0] for _ in range(n)]
        finally:
            await reg.aclose()

    q.put(asyncio.run(go()))


async def test_invocation_limit_holds_across_processes(tmp_path, db_url):
    await migrate(db_url)
    kek_path = tmp_path / "kek.key"
    reg = Registry.from_url(db_url)
    ring = Keyring(reg, LocalFileKek(kek_path), invocation_limit=50, reserve_block=7)
    await reg.create_tenant("acme")
    await ring.create("acme")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_encrypt_many, args=(db_url, str(kek_path), 120, q)) for _ in range(2)]
    for p in procs:
        p.start()
    versions = [v for _ in procs for v in q.get(timeout=120)]
    for p in procs:
        p.join(30)
    try:
        per_version = {v: versions.count(v) for v in set(versions)}
        assert len(versions) == 240
        assert all(count <= 50 for count in per_version.values()), per_version
        assert len(per_version) >= 5  # 240 encryptions at <= 50 each force at least 5 versions
        keys = {k.version: k for k in await reg.list_keys("acme")}
        assert all(keys[v].invocations <= 50 for v in per_version)
        assert sum(k.state == "active" for k in keys.values()) == 1
    finally:
        await reg.aclose()


async def test_destroyed_key_versions_are_gone(tmp_path, db_url):
    await migrate(db_url)
    reg = Registry.from_url(db_url)
    try:
        ring = Keyring(reg, LocalFileKek(tmp_path / "kek.key"))
        await reg.create_tenant("acme")
        v1 = await ring.create("acme")
        v2 = await ring.rotate("acme")
        assert (v1, v2) == (1, 2)
        assert len(await ring.decryption_key("acme", v1)) == 32  # retired still decrypts
        assert await ring.destroy("acme", [v1]) == [v1]
        with pytest.raises(KeyUnavailable):
            await ring.decryption_key("acme", v1)
        rec = await reg.get_key("acme", v1)
        assert rec.state == "destroyed" and rec.wrapped_key is None
        fresh = Keyring(reg, LocalFileKek(tmp_path / "kek.key"))  # another process's view
        with pytest.raises(KeyUnavailable):
            await fresh.decryption_key("acme", v1)
        assert len(await fresh.decryption_key("acme", v2)) == 32
    finally:
        await reg.aclose()


async def test_a_keyring_that_loses_a_key_version_race_keeps_the_winners_key(tmp_path, db_url):
    """Two keyrings (two processes) make a tenant's next key version at once: one takes the
    version number, the other's insert collides and it takes the winner's key as active. The
    loser must not keep its own, never stored key in memory under that version: every envelope
    it sealed with it would fail authentication wherever the stored key opens it."""
    await migrate(db_url)
    kek = LocalFileKek(tmp_path / "kek.key")
    reg = Registry.from_url(db_url)
    try:
        for i in range(12):
            tenant = f"race{i}"
            await reg.create_tenant(tenant)
            a, b = Keyring(reg, kek), Keyring(reg, kek)
            va, vb = await asyncio.gather(a.create(tenant, expect_active=None), b.create(tenant, expect_active=None))
            fresh = Keyring(reg, kek)  # no cache: each version's key unwrapped from the registry
            assert await a.decryption_key(tenant, va) == await fresh.decryption_key(tenant, va)
            assert await b.decryption_key(tenant, vb) == await fresh.decryption_key(tenant, vb)
            for ring in (a, b):  # and what each seals with is that key too
                version, dek = await ring.encryption_key(tenant)
                assert dek == await Keyring(reg, kek).decryption_key(tenant, version)
    finally:
        await reg.aclose()
