"""Published prefixes below the gateway: migration 0003 up and down on SQLite and Postgres, the
sharing registry (scopes, members, publications, recorded chunks), a scope's owner id that no
tenant name can be, the capability's scopes claim, and the chain recomputed from a fingerprint
digest."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct

import pytest
from sqlalchemy import inspect, text

from crypto.kek import LocalFileKek
from gateway.chunking import ModelFingerprint, chain_hashes
from gateway.services import dbschema
from gateway.services.prefixes import chain_from_digest
from tenancy.capabilities import CapabilityAuthority, attenuate
from tenancy.errors import CapabilityDenied, CapabilityRequestInvalid
from tenancy.keyring import Keyring
from tenancy.names import InvalidName, check_name
from tenancy.registry import Registry, UnknownTenant
from tenancy.sharing import ScopeExists, SharingRegistry, UnknownScope, scope_owner
from tests.support.gw import migrate

SHARING_TABLES = {"kv_scopes", "kv_scope_members", "kv_prefixes", "kv_prefix_chunks"}


async def _tables(reg: Registry) -> set[str]:
    async with reg.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def _count(reg: Registry, sql: str) -> int:
    async with reg.engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


async def test_published_migration_upgrades_and_downgrades(tmp_path, db_url):
    await migrate(db_url)
    reg = Registry.from_url(db_url)
    try:
        assert SHARING_TABLES <= await _tables(reg)
        await reg.create_tenant("acme")
        sharing = SharingRegistry(reg)
        await sharing.create_scope("team", everyone=False, members=["acme"])
        ring = Keyring(reg, LocalFileKek(tmp_path / "kek.key"))
        await ring.create(scope_owner("team"))  # the scope's keys, under its owner row
        await sharing.add_publication("team", "m", "0" * 64, b"\0" * 64, 16, 1)
        await reg.engine.dispose()
        await asyncio.to_thread(dbschema.downgrade, db_url, "0002_audit")
        assert not SHARING_TABLES & await _tables(reg)
        # the scope's owner row and its keys went with the tables; the tenant stayed
        assert await _count(reg, "SELECT count(*) FROM kv_tenants WHERE id LIKE 'scope%'") == 0
        assert await _count(reg, "SELECT count(*) FROM kv_data_keys WHERE tenant_id LIKE 'scope%'") == 0
        assert await _count(reg, "SELECT count(*) FROM kv_tenants WHERE id = 'acme'") == 1
        await reg.engine.dispose()
        await asyncio.to_thread(dbschema.upgrade, db_url)  # and up again
        assert SHARING_TABLES <= await _tables(reg)
        assert [s.name for s in await SharingRegistry(reg).list_scopes()] == []
    finally:
        await reg.aclose()


async def test_published_sharing_registry(db_url):
    await migrate(db_url)
    reg = Registry.from_url(db_url)
    try:
        for t in ("acme", "globex", "initech"):
            await reg.create_tenant(t)
        sharing = SharingRegistry(reg)
        rec = await sharing.create_scope("team", everyone=False, members=["acme", "globex"])
        assert rec.members == ("acme", "globex")
        await sharing.create_scope("all", everyone=True)
        with pytest.raises(ScopeExists):
            await sharing.create_scope("team", everyone=False)
        with pytest.raises(UnknownTenant):
            await sharing.create_scope("other", everyone=False, members=["nobody"])
        with pytest.raises(UnknownTenant):  # a scope's owner is never a member
            await sharing.add_member("team", scope_owner("all"))
        with pytest.raises(UnknownScope):
            await sharing.add_member("nope", "acme")
        assert await sharing.scopes_of("acme") == ["all", "team"]
        assert await sharing.scopes_of("initech") == ["all"]
        assert await sharing.remove_member("team", "acme") is True
        assert await sharing.remove_member("team", "acme") is False
        assert await sharing.scopes_of("acme") == ["all"]
        assert [t for t, _s in await reg.list_tenants()] == ["acme", "globex", "initech"]  # no owner rows
        pub = await sharing.add_publication("team", "m", "ab" * 32, b"\1" * 128, 32, 1)
        hashes = ["11" * 32, "22" * 32]
        await sharing.record_chunks(pub.id, "f" * 64, hashes)
        await sharing.record_chunks(pub.id, "f" * 64, hashes)  # idempotent
        table = await sharing.table()
        assert table.hashes == {"team": frozenset(hashes)} and table.everyone == {"all"}
        assert table.members["team"] == {"globex"}
        assert await sharing.set_state(pub.id, "revoking", expect=("active",)) is True
        assert await sharing.set_state(pub.id, "revoking", expect=("active",)) is False  # once
        assert (await sharing.table()).hashes == {}  # not matched once revoking
        assert await sharing.chunks_of(pub.id) == sorted(hashes)  # kept for the deletion
    finally:
        await reg.aclose()


def test_published_scope_owner_is_never_a_tenant_name():
    owner = scope_owner("team")
    with pytest.raises(InvalidName):
        check_name(owner, "tenant")
    with pytest.raises(InvalidName):
        scope_owner("Team")  # a scope name is a name too
    assert check_name("team") == "team"  # positive control


def test_published_capability_scopes_claim():
    authority = CapabilityAuthority({"k1": os.urandom(32)}, "k1")
    token, cap = authority.issue("acme", "default", ["lookup", "get"], 60, scopes=["team", "all"])
    assert cap.scopes == {"team", "all"}
    assert authority.verify(token, tenant="acme", namespace="default", op="get").scopes == {"team", "all"}
    narrowed = attenuate(token, scopes=["team"])
    assert authority.verify(narrowed, tenant="acme", namespace="default", op="get").scopes == {"team"}
    none = attenuate(narrowed, scopes=[])
    assert authority.verify(none, tenant="acme", namespace="default", op="get").scopes == frozenset()
    with pytest.raises(CapabilityDenied):
        attenuate(narrowed, scopes=["team", "all"])  # widening is refused
    plain, plain_cap = authority.issue("acme", "default", ["get"], 60)
    assert plain_cap.scopes == frozenset() and '"sc"' not in plain  # no claim: the format as before
    # the claim is under the tag: a token whose root lists another scope does not verify
    kvc, kid, root, tag = token.split(".")
    raw = json.loads(base64.urlsafe_b64decode(root + "=" * (-len(root) % 4)))
    raw["sc"] = ["secret"]
    forged_root = base64.urlsafe_b64encode(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).rstrip(b"=").decode()
    with pytest.raises(CapabilityDenied):
        authority.verify(".".join([kvc, kid, forged_root, tag]), tenant="acme", namespace="default", op="get")
    with pytest.raises(CapabilityRequestInvalid):
        authority.issue("acme", "default", ["get"], 60, scopes=["x" * 65])


def test_published_chain_from_digest_matches_chain_hashes():
    fp = ModelFingerprint("m", "float16", 2, 2, 8)
    tokens = list(range(1000, 1000 + 70))
    raw = struct.pack(f"<{len(tokens)}i", *tokens)
    got = chain_from_digest(fp.digest, raw, 16)
    want = [c.chained_hash.hex() for c in chain_hashes(tokens, fp, 16) if c.num_tokens == 16]
    assert got == want and len(got) == 4  # whole chunks only: the 6 tokens after them are not
    other = ModelFingerprint("m", "float16", 2, 2, 8, tp_rank=1)
    assert chain_from_digest(other.digest, raw, 16) != got  # the fingerprint is in every hash
