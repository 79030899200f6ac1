"""Remote mode against a live server: a chunk sealed by a worker through REST (RemoteGateway)
opens bit-identically in the server's in-process core and back; another tenant misses; an
envelope moved to another chunk's place fails authentication and is a miss on both sides."""

from __future__ import annotations

import httpx
import pytest
import torch

from gateway.errors import AccessDenied, InvalidRequest
from gateway.remote import RemoteGateway, RemoteUnavailable
from tests.support import server_fixture
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import ALL_OPS, LiveServer

live_server = server_fixture.live_server  # a fixture, registered in this module
live_server_pg = server_fixture.live_server_pg  # a fixture, registered in this module

NUM_BLOCKS = 32
N = 16 * 3 + 5  # three full chunks (chunk_tokens=16 in the test settings) and a partial one
BLOCKS = list(range(14))


async def _tenants(live: LiveServer, *names: str) -> list[str]:
    async with live.client() as http:
        return [await live.create_tenant(http, n) for n in names]


def _remote(live: LiveServer, tenant: str, **kw) -> RemoteGateway:
    return RemoteGateway(live.base_url, live.worker_token(tenant), chunk_tokens=live.settings.chunk_tokens, **kw)


async def _core_cap(live: LiveServer, tenant: str) -> str:
    return await live.call(live.runtime.gateway.mint_capability, tenant, "default", ALL_OPS, 600)


async def _both_directions(live: LiveServer) -> None:
    g = small_geometry()
    model = model_for(g)
    a, b = await _tenants(live, "acme", "globex")
    src = random_cache(g, NUM_BLOCKS, seed=1)
    tokens = list(range(500, 500 + N))
    gw = live.runtime.gateway
    async with _remote(live, a) as ra, _remote(live, b) as rb:
        # REST store, in-process retrieve
        res = await ra.store(model, tokens, src, block_ids=BLOCKS)
        assert (res.chunks, res.stored, res.skipped) == (4, 4, 0)
        assert (await ra.lookup(model, tokens)).hit_tokens == N
        dst = zero_cache(g, NUM_BLOCKS)
        got = await live.call(gw.retrieve, await _core_cap(live, a), model, tokens, dst, block_ids=BLOCKS)
        assert got.loaded_tokens == N and got.integrity_failures == 0
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        # the same tokens in tenant B: a miss, in process and through REST
        assert (await rb.lookup(model, tokens)).hit_tokens == 0
        dst_b = zero_cache(g, NUM_BLOCKS)
        got_b = await live.call(gw.retrieve, await _core_cap(live, b), model, tokens, dst_b, block_ids=BLOCKS)
        assert got_b.loaded_tokens == 0 and all(not t.any() for t in dst_b)
        assert (await rb.retrieve(model, tokens, dst_b, block_ids=BLOCKS)).loaded_tokens == 0
        assert all(not t.any() for t in dst_b)
        # storing again through REST skips what is there
        again = await ra.store(model, tokens, src, block_ids=BLOCKS)
        assert (again.stored, again.skipped) == (0, 4)

        # in-process store, REST retrieve (other tokens, a scattered block table)
        other = list(range(9000, 9000 + N))
        src2 = random_cache(g, NUM_BLOCKS, seed=2)
        blocks2 = torch.randperm(NUM_BLOCKS)[:14]
        await live.call(gw.store, await _core_cap(live, a), model, other, src2, block_ids=blocks2)
        dst2 = zero_cache(g, NUM_BLOCKS)
        out = await ra.retrieve(model, other, dst2, block_ids=BLOCKS)
        assert out.loaded_tokens == N and out.integrity_failures == 0
        assert torch.equal(gathered(src2, g, blocks2, N), gathered(dst2, g, BLOCKS, N))
        assert (await rb.retrieve(model, other, zero_cache(g, NUM_BLOCKS), block_ids=BLOCKS)).loaded_tokens == 0


async def test_rest_and_core_interoperate_sqlite(live_server: LiveServer):
    await _both_directions(live_server)


async def test_rest_and_core_interoperate_postgres(live_server_pg: LiveServer):
    await _both_directions(live_server_pg)


async def test_moved_envelope_is_an_integrity_failure_on_both_sides(live_server: LiveServer):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=3)
    t1, t2 = list(range(32)), list(range(1000, 1032))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, t1, src, block_ids=BLOCKS)
        # copy chunk 0 of t1 into chunk 0 of t2's place (a tier that swaps blobs)
        h1 = ra._chunks(model, t1)[0].chained_hash.hex()
        h2 = ra._chunks(model, t2)[0].chained_hash.hex()
        hdr = live.headers(live.worker_token(a), await ra.capability())
        blob = (await http.get(f"/v1/chunks/{h1}", headers=hdr)).content
        assert (await http.put(f"/v1/chunks/{h2}", content=blob, headers=hdr)).status_code == 204
        dst = zero_cache(g, NUM_BLOCKS)
        out = await ra.retrieve(model, t2, dst, block_ids=BLOCKS)
        assert (out.loaded_tokens, out.integrity_failures) == (0, 1)
        assert all(not t.any() for t in dst)  # nothing inauthentic reached the cache
        # the bad copy was deleted, the good one is untouched
        assert (await http.get(f"/v1/chunks/{h2}", headers=hdr)).status_code == 404
        assert (await ra.retrieve(model, t1, dst, block_ids=BLOCKS)).loaded_tokens == 32
        # the core sees the same: a miss, counted
        assert (await http.put(f"/v1/chunks/{h2}", content=blob, headers=hdr)).status_code == 204
        before = live.runtime.gateway.stats["integrity_failures"]
        dst2 = zero_cache(g, NUM_BLOCKS)
        got = await live.call(live.runtime.gateway.retrieve, await _core_cap(live, a), model, t2, dst2, block_ids=BLOCKS)
        assert (got.loaded_tokens, got.integrity_failures) == (0, 1)
        assert live.runtime.gateway.stats["integrity_failures"] == before + 1


async def test_bad_input_and_denials(live_server: LiveServer, tmp_path):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS)
    async with _remote(live, a) as ra:
        with pytest.raises(InvalidRequest):
            await ra.store(model, [], src, block_ids=BLOCKS)
        with pytest.raises(InvalidRequest):
            await ra.store(model, [-1, 2], src, block_ids=BLOCKS)
        with pytest.raises(InvalidRequest):  # block table too short for the tokens
            await ra.store(model, list(range(100)), src, block_ids=[0, 1])
        with pytest.raises(InvalidRequest):
            await ra.store(model, list(range(8)), src, block_ids=[0, 1], slot_mapping=list(range(8)))
        with pytest.raises(InvalidRequest):
            await ra.store(model, list(range(8)), src, slot_mapping=[0, 1, 2, 3, 4, 5, 6, 10**6])
        assert (await ra.lookup(model, list(range(8)))).hit_tokens == 0  # nothing was stored
    # a worker whose chunk size differs from the server's is refused before it stores anything
    async with RemoteGateway(live.base_url, live.worker_token(a), chunk_tokens=7) as wrong:
        with pytest.raises(InvalidRequest):
            await wrong.store(model, list(range(8)), src, block_ids=BLOCKS)
    # an admin-only principal may not lease keys or store; a bad bearer is refused
    async with RemoteGateway(live.base_url, "not-a-token", chunk_tokens=16) as bad:
        with pytest.raises(AccessDenied):
            await bad.lookup(model, list(range(8)))
    async with RemoteGateway(live.base_url, live.admin_token(a), chunk_tokens=16) as admin:
        with pytest.raises(AccessDenied):
            await admin.store(model, list(range(8)), src, block_ids=BLOCKS)
    async with RemoteGateway("http://127.0.0.1:9", live.worker_token(a)) as nowhere:
        with pytest.raises(RemoteUnavailable):
            await nowhere.lookup(model, list(range(8)))


async def test_clear_revokes_the_remote_worker(live_server: LiveServer):
    """After a secure clear the worker's lease and capability are dead: it renews them (the new
    key), and what it stored before is gone."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=4)
    tokens = list(range(40))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, tokens, src, block_ids=BLOCKS)
        old = await ra.lease()
        r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == 0
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS)).stored == 3
        new = await ra.lease()
        assert new.key_version != old.key_version and new.index_key != old.index_key
        assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == 40
        assert torch.equal(gathered(src, g, BLOCKS, 40), gathered(dst, g, BLOCKS, 40))


async def test_remote_reads_survive_a_key_rotation(live_server: LiveServer):
    """Envelopes sealed before a rotation open with a lease on their own (older) version; new ones
    are sealed under the new key; a read-only worker (no put) can retrieve too."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=5)
    t_old, t_new = list(range(32)), list(range(32)) + list(range(7000, 7016))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, t_old, src, block_ids=BLOCKS)
        v1 = (await ra.lease()).key_version
        r = await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200 and r.json()["key_version"] == v1 + 1
        async with _remote(live, a) as fresh:  # a new worker leases the new key
            assert (await fresh.store(model, t_new, src, block_ids=BLOCKS)).stored == 1
            assert (await fresh.lease()).key_version == v1 + 1
        async with _remote(live, a, ops=["lookup", "get"]) as reader:
            dst = zero_cache(g, NUM_BLOCKS)
            got = await reader.retrieve(model, t_new, dst, block_ids=BLOCKS)  # chunks of v1 and of v2
            assert (got.loaded_tokens, got.integrity_failures, got.unavailable) == (48, 0, 0)
            assert torch.equal(gathered(src, g, BLOCKS, 48), gathered(dst, g, BLOCKS, 48))
            with pytest.raises(AccessDenied):  # no put: no sealing lease
                await reader.lease()
        # the endpoint itself: an unknown version is 404; a version needs the get op; bad input 422
        worker = live.worker_token(a)
        cap = await ra.capability()
        assert (await http.post("/v1/keys/lease", json={"version": v1}, headers=live.headers(worker, cap))).json()["invocations"] == 0
        r = await http.post("/v1/keys/lease", json={"version": 99}, headers=live.headers(worker, cap))
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")
        put_only = await live.capability(http, a, ops=["put"])
        r = await http.post("/v1/keys/lease", json={"version": v1}, headers=live.headers(worker, put_only))
        assert r.status_code == 403
        r = await http.post("/v1/keys/lease", json={"version": 0}, headers=live.headers(worker, cap))
        assert r.status_code == 422


# -- issue 18: the batched data plane, through the worker's client ---------------------------------
SIX = 16 * 6  # six full chunks
BLOCKS6 = list(range(24))


def _requests(log: list[str]):
    async def hook(request: httpx.Request) -> None:
        log.append(f"{request.method} {request.url.path}")

    return hook


async def test_a_prefix_moves_in_batched_requests(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch):
    """Puts go out as framed batches (here forced to two envelopes each, so three batches overlap
    the sealing), a load is one streamed fetch: no per-chunk request either way."""
    import gateway.remote as remote

    monkeypatch.setattr(remote, "_BATCH_ITEMS", 2)
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=11)
    tokens = list(range(100, 100 + SIX))
    log: list[str] = []
    async with httpx.AsyncClient(timeout=30, event_hooks={"request": [_requests(log)]}) as http:
        async with _remote(live, a, http=http) as ra:
            assert (await ra.store(model, tokens, src, block_ids=BLOCKS6, skip_existing=False)).stored == 6
            assert [r for r in log if "/chunks" in r] == ["PUT /v1/chunks"] * 3
            log.clear()
            dst = zero_cache(g, NUM_BLOCKS)
            got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS6)
            assert (got.loaded_tokens, got.integrity_failures) == (SIX, 0)
            assert torch.equal(gathered(src, g, BLOCKS6, SIX), gathered(dst, g, BLOCKS6, SIX))
            assert [r for r in log if "/chunks" in r] == ["POST /v1/chunks/fetch"]


async def _spoil(live: LiveServer, ra: RemoteGateway, rb: RemoteGateway, model, tokens, how: str) -> None:
    """Make chunk 2 of ``tokens`` in A's namespace missing, tampered or another tenant's."""
    h = ra._chunks(model, tokens)[2].chained_hash.hex()
    async with live.client() as http:
        hdr = live.headers(live.worker_token("acme"), await ra.capability())
        if how == "missing":
            assert (await http.delete(f"/v1/chunks/{h}", headers=hdr)).status_code == 204
            return
        if how == "tampered":
            blob = bytearray((await http.get(f"/v1/chunks/{h}", headers=hdr)).content)
            blob[-1] ^= 1  # the last tag: the header still parses, the server takes it
        else:  # B's envelope of the same chunk (same tokens, same model), put in A's place
            hdr_b = live.headers(live.worker_token("globex"), await rb.capability())
            blob = bytearray((await http.get(f"/v1/chunks/{h}", headers=hdr_b)).content)
        assert (await http.put(f"/v1/chunks/{h}", content=bytes(blob), headers=hdr)).status_code == 204


@pytest.mark.parametrize("how", ["missing", "tampered", "foreign"])
async def test_a_bad_chunk_mid_batch_ends_the_prefix_and_nothing_past_it_lands(live_server: LiveServer, how: str):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    a, b = await _tenants(live, "acme", "globex")
    src = random_cache(g, NUM_BLOCKS, seed=12)
    tokens = list(range(300, 300 + SIX))
    async with _remote(live, a, threads=1) as ra, _remote(live, b, threads=1) as rb:  # one batch: nothing unpacked past a failure
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6
        assert (await rb.store(model, tokens, random_cache(g, NUM_BLOCKS, seed=13), block_ids=BLOCKS6)).stored == 6
        # positive control: the whole prefix loads
        ok = zero_cache(g, NUM_BLOCKS)
        assert (await ra.retrieve(model, tokens, ok, block_ids=BLOCKS6)).loaded_tokens == SIX
        await _spoil(live, ra, rb, model, tokens, how)
        sentinel = random_cache(g, NUM_BLOCKS, seed=99)  # what the engine's cache held before
        dst = [t.clone() for t in sentinel]
        got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS6)
        assert got.loaded_tokens == 32  # chunks 0 and 1
        assert got.integrity_failures == (0 if how == "missing" else 1)
        assert torch.equal(gathered(src, g, BLOCKS6, 32), gathered(dst, g, BLOCKS6, 32))
        # past the prefix: every slot as it was (no byte of chunks 2..5 reached the cache)
        past = BLOCKS6[8:]
        assert torch.equal(gathered(sentinel, g, past, SIX - 32), gathered(dst, g, past, SIX - 32))
        # the blocks of the table nobody named are untouched too
        assert all(torch.equal(s[:, 24:], d[:, 24:]) for s, d in zip(sentinel, dst))  # KV_FIRST: blocks are dim 1
