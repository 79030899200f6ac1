"""A revoke cut short after it stopped matching (state ``revoking``) is finished when the next
runtime opens: the key versions destroyed, the chunks gone, ``prefix.revoke`` audited."""

from __future__ import annotations

from gateway.services.runtime import open_embedded
from tenancy.sharing import SCOPE_NAMESPACE, scope_owner
from tests.support.gw import ALL_OPS, migrate, model_for, random_cache, settings_for, small_geometry

BLOCKS = list(range(8))


async def test_published_revoke_is_resumed_after_a_crash(tmp_path, db_url):
    settings = settings_for(tmp_path / "state", db_url)
    await migrate(settings.db_url)
    g = small_geometry()
    model = model_for(g)
    prefix = list(range(4000, 4032))
    rt = await open_embedded(settings)
    try:
        await rt.admin.create_tenant("acme")
        await rt.prefixes.create_scope("team", members=["acme"])
        pub = await rt.prefixes.publish("team", model.name, prefix)
        hashes = [c.chained_hash for c in rt.gateway.plane.chunks(model, prefix)]
        await rt.prefixes.warm(pub.capability, pub.publication.id, model.fingerprint_digest, [h.hex() for h in hashes])
        assert (await rt.gateway.store(pub.capability, model, prefix, random_cache(g, 16), block_ids=BLOCKS)).stored == 2
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS)
        assert (await rt.gateway.lookup(cap, model, prefix)).hit_chunks == 2  # positive control
        ns = await rt.resolver.keys(scope_owner("team"), SCOPE_NAMESPACE)
        keys = rt.resolver.chunk_keys(ns, hashes)
        await rt.tiers.flush()
        assert all(await rt.tiers.tier("disk").contains_many(keys))  # what the next process finds
        # the crash: the revoke stopped matching and went no further
        assert await rt.prefixes.sharing.set_state(pub.publication.id, "revoking", expect=("active",))
        rt.prefixes.invalidate()
        assert (await rt.gateway.lookup(cap, model, prefix)).hit_chunks == 0
    finally:
        await rt.aclose()
    rt = await open_embedded(settings)  # the disk tier (and the registry) outlive the process
    try:
        got = await rt.prefixes.get(pub.publication.id)
        assert got.state == "revoked"
        assert not any(await rt.tiers.contains_many(keys))
        assert [k.state for k in await rt.registry.list_keys(scope_owner("team"))] == ["destroyed"]
    finally:
        await rt.aclose()
