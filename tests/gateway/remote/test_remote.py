"""Remote mode against a live server: a chunk sealed by a worker through REST (RemoteGateway)
opens bit-identically in the server's in-process core and back; another tenant misses; an
envelope moved to another chunk's place fails authentication and is a miss on both sides. Chunk
bytes are read and written behind the worker's back through the routes (tests.support.chunks)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from crypto.envelope import ChunkCipher, EnvelopeContext, IssuedKey, read_header
from crypto.errors import DecryptionFailed
from gateway.errors import AccessDenied, InvalidRequest
from gateway.protocol import frames
from gateway.remote.client import Connections, RemoteGateway, RemoteUnavailable
from tenancy.capabilities import read_unverified
from tests.support import chunks, server_fixture
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import ALL_OPS, LiveServer, random_hash

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
    return await live.call(live.gateway.mint_capability, tenant, "default", ALL_OPS, 600)


async def _both_directions(live: LiveServer) -> None:
    g = small_geometry()
    model = model_for(g)
    a, b = await _tenants(live, "acme", "globex")
    src = random_cache(g, NUM_BLOCKS, seed=1)
    tokens = list(range(500, 500 + N))
    gw = live.gateway
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


@pytest.mark.parametrize("server", ["live_server", "live_server_pg"])
async def test_rest_and_core_interoperate(server: str, request: pytest.FixtureRequest):
    """On SQLite and on Postgres."""
    await _both_directions(request.getfixturevalue(server))


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
        blob = await chunks.envelope(http, hdr, h1)
        assert blob is not None
        assert (await chunks.store(http, hdr, [(h2, blob)])).status_code == 204
        dst = zero_cache(g, NUM_BLOCKS)
        out = await ra.retrieve(model, t2, dst, block_ids=BLOCKS)
        assert (out.loaded_tokens, out.integrity_failures) == (0, 1)
        assert ra.metrics.integrity_failures == 1  # counted once, where it was found
        assert all(not t.any() for t in dst)  # nothing inauthentic reached the cache
        # the bad copy was deleted, the good one is untouched
        assert await chunks.envelope(http, hdr, h2) is None
        assert (await ra.retrieve(model, t1, dst, block_ids=BLOCKS)).loaded_tokens == 32
        # the core sees the same: a miss, counted
        assert (await chunks.store(http, hdr, [(h2, blob)])).status_code == 204
        before = live.runtime.metrics.integrity_failures
        dst2 = zero_cache(g, NUM_BLOCKS)
        got = await live.call(live.gateway.retrieve, await _core_cap(live, a), model, t2, dst2, block_ids=BLOCKS)
        assert (got.loaded_tokens, got.integrity_failures) == (0, 1)
        assert live.runtime.metrics.integrity_failures == before + 1


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
    # an admin-only principal may not get keys or store; a bad bearer is refused
    async with RemoteGateway(live.base_url, "not-a-token", chunk_tokens=16) as bad:
        with pytest.raises(AccessDenied):
            await bad.lookup(model, list(range(8)))
    async with RemoteGateway(live.base_url, live.admin_token(a), chunk_tokens=16) as admin:
        with pytest.raises(AccessDenied):
            await admin.store(model, list(range(8)), src, block_ids=BLOCKS)
    async with RemoteGateway("http://127.0.0.1:9", live.worker_token(a)) as nowhere:
        with pytest.raises(RemoteUnavailable):
            await nowhere.lookup(model, list(range(8)))


async def _stored_envelope(live: LiveServer, http, tenant: str, cap: str, chunk_hash: str) -> bytes:
    got = await chunks.envelope(http, live.headers(live.worker_token(tenant), cap), chunk_hash)
    assert got is not None
    return got


def _ctx(tenant: str, storage_key: str, model, version: int) -> EnvelopeContext:
    return EnvelopeContext(tenant, "default", storage_key, model.fingerprint_digest, version)


async def test_clear_revokes_the_remote_worker(live_server: LiveServer):
    """After a secure clear the worker's capability and the key version its envelopes were sealed
    under are dead: it renews its capability, stores under the new key, and what it stored before
    is gone."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=4)
    tokens = list(range(40))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, tokens, src, block_ids=BLOCKS)
        h0 = ra._chunks(model, tokens)[0].chained_hash.hex()
        old = read_header(await _stored_envelope(live, http, a, await ra.capability(), h0)).key_version
        r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == 0
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS)).stored == 3
        new = read_header(await _stored_envelope(live, http, a, await ra.capability(), h0)).key_version
        assert new != old
        assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == 40
        assert torch.equal(gathered(src, g, BLOCKS, 40), gathered(dst, g, BLOCKS, 40))


async def test_remote_reads_survive_a_key_rotation(live_server: LiveServer):
    """Envelopes sealed before a rotation open with keys of their own (older) version; new ones
    are sealed under the new key; a read-only worker (no put) can retrieve, and gets no sealing keys."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=5)
    t_old, t_new = list(range(32)), list(range(32)) + list(range(7000, 7016))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, t_old, src, block_ids=BLOCKS)
        hashes = [c.chained_hash.hex() for c in ra._chunks(model, t_new)]
        v1 = read_header(await _stored_envelope(live, http, a, await ra.capability(), hashes[0])).key_version
        r = await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200 and r.json()["key_version"] == v1 + 1
        async with _remote(live, a) as fresh:  # sealing keys come from the new key
            assert (await fresh.store(model, t_new, src, block_ids=BLOCKS)).stored == 1
            assert read_header(await _stored_envelope(live, http, a, await fresh.capability(), hashes[2])).key_version == v1 + 1
        async with _remote(live, a, ops=["lookup", "get"]) as reader:
            dst = zero_cache(g, NUM_BLOCKS)
            got = await reader.retrieve(model, t_new, dst, block_ids=BLOCKS)  # chunks of v1 and of v2
            assert (got.loaded_tokens, got.integrity_failures, got.unavailable) == (48, 0, 0)
            assert torch.equal(gathered(src, g, BLOCKS, 48), gathered(dst, g, BLOCKS, 48))
            with pytest.raises(AccessDenied):  # no put: no sealing keys
                await reader.envelope_keys({"purpose": "seal", "hashes": hashes[:1]})


@pytest.mark.parametrize("live_chunks", [0, 1])
async def test_a_destroyed_key_version_ends_the_prefix_as_key_unavailable(live_server: LiveServer, live_chunks: int):
    """Four chunks sealed under key version v1; the key rotated, the first ``live_chunks`` sealed
    again under v1 + 1, and v1 destroyed. Keys of a destroyed version are not issued: the stream
    sends the live chunks with their keys and ends at the first chunk of v1 with status
    key-unavailable (no bytes, no key), one key.issue event counting them; the worker loads those
    chunks, a counted miss with reason key_unavailable, nothing written past them; envelopes of
    the live version still load."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=23)
    tokens, t_live = list(range(8000, 8064)), list(range(3000, 3032))  # four chunks; two
    async with _remote(live, a) as ra, live.client() as http:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 4
        cap = await ra.capability()
        hashes = [c.chained_hash.hex() for c in ra._chunks(model, tokens)]
        v1 = read_header(await _stored_envelope(live, http, a, cap, hashes[0])).key_version
        r = await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200
        if live_chunks:  # chunk 0 sealed again, under v1 + 1 (it is the whole of these tokens); chunks 1..3 stay under v1
            assert (await ra.store(model, tokens[:16], src, block_ids=BLOCKS6, skip_existing=False)).stored == 1
            assert read_header(await _stored_envelope(live, http, a, cap, hashes[0])).key_version == v1 + 1
        assert (await ra.store(model, t_live, src, block_ids=BLOCKS)).stored == 2  # under v1 + 1
        control = zero_cache(g, NUM_BLOCKS)  # positive control: the whole prefix loads
        assert (await ra.retrieve(model, tokens, control, block_ids=BLOCKS6)).loaded_tokens == 64
        assert await live.call(live.runtime.keyring.destroy, a, [v1]) == [v1]
        cap_id = read_unverified(cap).cap_id
        seen = len(await _key_issue_rows(live, http, a, cap_id))
        _scope, items = await _keyed_fetch(live, http, a, cap, hashes)
        assert [(it.status, it.length == len(env) > 0, it.key == bytes(32)) for it, env in items] == [
            (frames.OK, True, False),
        ] * live_chunks + [(frames.KEY_UNAVAILABLE, False, True)]
        rows = (await _key_issue_rows(live, http, a, cap_id))[seen:]
        assert [(row["details"]["issued"], row["details"]["unavailable"]) for row in rows] == [(live_chunks, 1)]
        before, before_unavailable = ra.metrics.key_unavailable, ra.metrics.unavailable
        sentinel = random_cache(g, NUM_BLOCKS, seed=98)
        dst = [t.clone() for t in sentinel]
        got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS6)
        loaded = 16 * live_chunks
        assert (got.loaded_tokens, got.unavailable, got.integrity_failures, got.reason) == (loaded, 1, 0, "key_unavailable")
        assert ra.metrics.key_unavailable == before + 1 and ra.metrics.unavailable > before_unavailable
        if loaded:
            assert torch.equal(gathered(src, g, BLOCKS6, loaded), gathered(dst, g, BLOCKS6, loaded))
        past = BLOCKS6[loaded // 4 :]  # blocks of 4 tokens: nothing written from the destroyed version on
        assert torch.equal(gathered(sentinel, g, past, 64 - loaded), gathered(dst, g, past, 64 - loaded))
        assert (await ra.retrieve(model, t_live, zero_cache(g, NUM_BLOCKS), block_ids=BLOCKS)).loaded_tokens == 32


async def test_another_tenants_capability_gets_no_key_to_an_envelope(live_server: LiveServer):
    """The attacker is tenant B's worker holding A's envelope bytes (taken from a tier): it stores
    them under the same hash in its own namespace and fetches them back, so the server issues it a
    key from their header's version and salt. That key is B's own derivation, which opens nothing
    of A's, in A's context or B's; A's capability is refused to B."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    a, b = await _tenants(live, "acme", "globex")
    src = random_cache(g, NUM_BLOCKS, seed=8)
    tokens = list(range(16))
    async with _remote(live, a) as ra, _remote(live, b) as rb, live.client() as http:
        await ra.store(model, tokens, src, block_ids=BLOCKS)
        await rb.store(model, list(range(900, 916)), src, block_ids=BLOCKS)  # B has keys of its own
        h = ra._chunks(model, tokens)[0].chained_hash.hex()
        cap_a, cap_b = await ra.capability(), await rb.capability()
        _scope, [(mine, stolen)] = await _keyed_fetch(live, http, a, cap_a, [h])  # positive control
        ctx_a = _ctx(a, mine.storage_key.hex(), model, mine.key_version)
        assert bytes(ChunkCipher().open(IssuedKey(mine.salt, mine.key), ctx_a, stolen)) == gathered(src, g, BLOCKS, 16).numpy().tobytes()
        hdr_b = live.headers(live.worker_token(b), cap_b)
        assert (await chunks.store(http, hdr_b, [(h, stolen)])).status_code == 204  # the header parses: taken
        scope, [(got, same)] = await _keyed_fetch(live, http, b, cap_b, [h])
        assert scope == (b, "default") and (got.status, same) == (frames.OK, stolen)
        assert got.storage_key != mine.storage_key and got.key != mine.key
        ctx_b = _ctx(b, got.storage_key.hex(), model, got.key_version)
        for ctx in (ctx_a, ctx_b):
            with pytest.raises(DecryptionFailed):
                ChunkCipher().open(IssuedKey(got.salt, got.key), ctx, stolen)
        # nor can B use A's capability
        assert (await chunks.post_fetch(http, live.headers(live.worker_token(b), cap_a), [h])).status_code == 403


async def test_remote_keys_are_asked_once_per_request_counted_and_audited(live_server: LiveServer):
    """A store asks for the keys of all its chunks in one call, a retrieve gets the keys of all it
    fetched in its one fetch stream; each is one audit event with the count."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=9)
    tokens = list(range(N))
    metrics = live.runtime.metrics
    async with _remote(live, a) as ra, live.client() as http:
        seal0, open0 = metrics.envelope_keys_issued["seal"], metrics.envelope_keys_issued["open"]
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == N
        for _ in range(100):  # the server counts a fetch's keys as its walk ends: maybe just after the last item was read
            if metrics.envelope_keys_issued["open"] - open0 == 4:
                break
            await asyncio.sleep(0.02)
        assert (metrics.envelope_keys_issued["seal"] - seal0, metrics.envelope_keys_issued["open"] - open0) == (4, 4)
        cap_id = read_unverified(await ra.capability()).cap_id
        assert live.state.plane.issued_to(cap_id) == 8
        await live.call(live.runtime.audit.flush, 10)
        r = await http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"},
                           headers=live.headers(live.admin_token(a)))
        rows = [row for row in map(json.loads, r.text.splitlines()) if row.get("action") == "key.issue"]
        assert [
            (row["details"]["purpose"], row["details"]["issued"], row["details"]["route"])
            for row in rows if row["details"]["cap_id"] == cap_id
        ] == [("seal", 4, "/v1/keys/envelopes"), ("open", 4, "/v1/chunks/fetch")]


# -- the batched data plane, through the worker's client ---------------------------------
SIX = 16 * 6  # six full chunks
BLOCKS6 = list(range(24))


def _requests(log: list[str]):
    async def hook(request: httpx.Request) -> None:
        log.append(f"{request.method} {request.url.path}")

    return hook


async def test_a_prefix_moves_in_batched_requests(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch):
    """Puts go out as framed batches (here forced to two envelopes each, so three batches overlap
    the sealing), a load is one streamed fetch: no per-chunk request either way."""
    import gateway.remote.client as remote

    monkeypatch.setattr(remote, "_BATCH_ITEMS", 2)
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=11)
    tokens = list(range(100, 100 + SIX))
    log: list[str] = []
    http = httpx.AsyncClient(timeout=30, event_hooks={"request": [_requests(log)]})
    async with Connections(live.base_url, http=http) as connections:
        async with _remote(live, a, connections=connections) as ra:
            wire = ra._wire.requests  # the data plane's own client (gateway.remote.wire)
            assert (await ra.store(model, tokens, src, block_ids=BLOCKS6, skip_existing=False)).stored == 6
            assert [r for r in log if "/chunks" in r] == []
            assert wire == ["PUT /v1/chunks"] * 3
            log.clear()
            wire.clear()
            dst = zero_cache(g, NUM_BLOCKS)
            got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS6)
            assert (got.loaded_tokens, got.integrity_failures) == (SIX, 0)
            assert torch.equal(gathered(src, g, BLOCKS6, SIX), gathered(dst, g, BLOCKS6, SIX))
            assert (log, wire) == ([], ["POST /v1/chunks/fetch"])  # the whole load: its keys came in the stream


async def test_a_loads_envelopes_are_let_go_as_they_are_opened(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch):
    """A remote load receives each envelope into a buffer of ``wire.receive_buffers``; the buffer
    must come back to it as soon as its chunk is opened, not when the load ends, so a long
    prompt's later envelopes reuse the first ones' buffers (fresh memory faults in page by page:
    an 8K-token load ran 2x slower). Opened one chunk at a time: when chunk k is opened, the
    buffers of chunks 0..k-1 are back (the load's answer is right, the positive control)."""
    from gateway.datapath.plane import DataPlane
    from gateway.remote import wire

    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=31)
    tokens = list(range(700, 700 + SIX))
    back: list[int] = []
    give_back = wire.ReceiveBuffers._give_back

    def counted(self, raw):
        back.append(raw.nbytes)
        give_back(self, raw)

    monkeypatch.setattr(wire.ReceiveBuffers, "_give_back", counted)
    monkeypatch.setattr(DataPlane, "_batches", lambda self, n, model, chunks, layered=False: [[k] for k in range(n)])
    async with _remote(live, a) as ra:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6
        seen: list[int] = []
        open_batch = ra._plane.datapath.open_batch

        def opening(kv, jobs, on_layers=None):
            seen.append(len(back))
            return open_batch(kv, jobs, on_layers)

        monkeypatch.setattr(ra._plane.datapath, "open_batch", opening)
        monkeypatch.setattr(ra._plane.datapath, "threads", 1)  # one open at a time
        back.clear()
        dst = zero_cache(g, NUM_BLOCKS)
        got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS6)
        assert (got.loaded_tokens, got.integrity_failures) == (SIX, 0)
        assert torch.equal(gathered(src, g, BLOCKS6, SIX), gathered(dst, g, BLOCKS6, SIX))
        assert seen == [0, 1, 2, 3, 4, 5]  # every earlier envelope's buffer was back before the next opened


async def test_a_load_from_a_later_chunk_reads_only_the_chunks_from_there(live_server: LiveServer):
    """An engine that holds a prompt's first chunks itself (vLLM's own prefix cache) asks for the
    rest only (``first_chunk``): with chunk 2 gone from the tier, a whole-prefix load ends there
    (positive control) and a load from chunk 3 does not; what it writes is bit-exact and lands
    only in the blocks it was given, through REST and in process alike."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=12)
    tokens = list(range(300, 300 + SIX))
    async with _remote(live, a) as ra:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6
        await _spoil(live, ra, ra, model, tokens, "missing")
        whole = await ra.retrieve(model, tokens, zero_cache(g, NUM_BLOCKS), block_ids=BLOCKS6)
        assert (whole.loaded_tokens, whole.reason) == (32, "miss")  # chunks 0-1, then the missing chunk 2
        later = BLOCKS6[12:]  # the blocks of tokens 48.. (chunks 3-5)
        dst = zero_cache(g, NUM_BLOCKS)
        got = await ra.retrieve(model, tokens, dst, block_ids=later, first_chunk=3)
        assert (got.loaded_tokens, got.loaded_chunks, got.integrity_failures, got.reason) == (SIX, 3, 0, "")
        assert torch.equal(gathered(src, g, later, 48), gathered(dst, g, later, 48))
        assert not gathered(dst, g, BLOCKS6[:12], 48).any()  # the engine's own blocks: not written
        core = zero_cache(g, NUM_BLOCKS)
        got = await live.call(
            live.gateway.retrieve, await _core_cap(live, a), model, tokens, core, block_ids=later, first_chunk=3
        )
        assert (got.loaded_tokens, got.loaded_chunks) == (SIX, 3)
        assert torch.equal(gathered(src, g, later, 48), gathered(core, g, later, 48))
        for bad in (-1, 6):
            with pytest.raises(InvalidRequest):
                await ra.retrieve(model, tokens, dst, block_ids=later, first_chunk=bad)


async def _spoil(live: LiveServer, ra: RemoteGateway, rb: RemoteGateway, model, tokens, how: str) -> None:
    """Make chunk 2 of ``tokens`` in A's namespace missing, tampered, another tenant's, or bytes
    whose header does not parse (written into the tier behind the server's back)."""
    h = ra._chunks(model, tokens)[2].chained_hash.hex()
    async with live.client() as http:
        hdr = live.headers(live.worker_token("acme"), await ra.capability())
        if how == "missing":
            r = await chunks.remove(http, live.headers(live.admin_token("acme")), "acme", "default", [h])
            assert r.status_code == 200 and r.json()["deleted_chunk_copies"] >= 1
            return
        if how == "junk":
            _cap, keys = await live.call(live.state.plane.keys_for, await ra.capability(), "get", [h])
            await live.call(live.runtime.tiers.put, keys[0], memoryview(b"junk" * 64))
            return
        if how == "tampered":
            blob = bytearray(await _stored_envelope(live, http, "acme", await ra.capability(), h))
            blob[-1] ^= 1  # the last tag: the header still parses, the server takes it
        else:  # B's envelope of the same chunk (same tokens, same model), put in A's place
            blob = bytearray(await _stored_envelope(live, http, "globex", await rb.capability(), h))
        assert (await chunks.store(http, hdr, [(h, bytes(blob))])).status_code == 204


@pytest.mark.parametrize("how", ["missing", "tampered", "foreign", "junk"])
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
        # past the prefix no byte of chunks 2..5 is left: every slot as it was, or zeroed where the
        # bad chunk's segment was decrypted in place before its tag failed (the engine recomputes
        # those slots); none holds the chunk's plaintext, which a one-bit change leaves whole
        past = BLOCKS6[8:]
        was, now = gathered(sentinel, g, past, SIX - 32), gathered(dst, g, past, SIX - 32)
        assert bool(((now == was) | (now == 0)).all())
        # the blocks of the table nobody named are untouched too
        assert all(torch.equal(s[:, 24:], d[:, 24:]) for s, d in zip(sentinel, dst))  # KV_FIRST: blocks are dim 1
        # an inauthentic chunk was deleted, so a recompute stores a good copy
        h = ra._chunks(model, tokens)[2].chained_hash.hex()
        async with live.client() as http:
            hdr = live.headers(live.worker_token("acme"), await ra.capability())
            assert await chunks.stored(http, hdr, [h]) == [False]


# -- the opening keys in the fetch stream -----------------------------------------------------------
async def _keyed_fetch(live: LiveServer, http, tenant: str, cap: str, hashes: list[str]):
    """``POST /v1/chunks/fetch`` as a worker of ``tenant``: the frame's scope and its items
    (item head, envelope bytes)."""
    got = await chunks.fetch(http, live.headers(live.worker_token(tenant), cap), hashes)
    assert got.chunk_tokens == live.settings.chunk_tokens
    return (got.tenant, got.namespace), got.items


async def _key_issue_rows(live: LiveServer, http, tenant: str, cap_id: str) -> list[dict]:
    await live.call(live.runtime.audit.flush, 10)
    r = await http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"},
                       headers=live.headers(live.admin_token(tenant)))
    rows = [row for row in map(json.loads, r.text.splitlines()) if row.get("action") == "key.issue"]
    return [row for row in rows if row["details"]["cap_id"] == cap_id]


async def test_the_fetch_stream_carries_each_envelopes_key_counted_and_audited_per_fetch(live_server: LiveServer):
    """Every envelope of the stored prefix comes with its key version, salt, key and storage key;
    the keys open exactly those envelopes; they count as issued keys of the capability, and each
    fetch is one key.issue event with its count (not one per envelope)."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=21)
    tokens = list(range(400, 400 + N))
    metrics = live.runtime.metrics
    async with _remote(live, a) as ra, live.client() as http:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        cap = await ra.capability()
        cap_id = read_unverified(cap).cap_id
        hashes = [c.chained_hash.hex() for c in ra._chunks(model, tokens)]
        issued0, open0, budget0 = metrics.envelope_keys_issued.total(), metrics.envelope_keys_issued["open"], live.state.plane.issued_to(cap_id)
        for _ in range(2):
            scope, items = await _keyed_fetch(live, http, a, cap, hashes + [random_hash()])  # a miss ends it
            assert scope == (a, "default")
            assert [it.status for it, _env in items] == [frames.OK] * 4 + [frames.MISSING]
            ns = await live.call(live.runtime.resolver.keys, a, "default")
            for k, (it, env) in enumerate(items[:4]):
                header = read_header(env)
                assert (it.chained_hash.hex(), it.key_version, it.salt) == (hashes[k], header.key_version, header.salt)
                assert it.storage_key.hex() == ns.storage_key(it.chained_hash)
                ctx = _ctx(a, it.storage_key.hex(), model, it.key_version)
                plain = ChunkCipher().open(IssuedKey(it.salt, it.key), ctx, env)
                if k == 0:  # the others authenticated too (open checks every tag)
                    assert bytes(plain) == gathered(src, g, BLOCKS, 16).numpy().tobytes()
            assert items[4][0].key == bytes(32)  # nothing is issued for a miss
        assert (metrics.envelope_keys_issued.total() - issued0, metrics.envelope_keys_issued["open"] - open0) == (8, 8)
        assert live.state.plane.issued_to(cap_id) - budget0 == 8  # charged 5 per fetch, the miss refunded
        rows = [row for row in await _key_issue_rows(live, http, a, cap_id) if row["details"]["route"] == "/v1/chunks/fetch"]
        assert [(row["outcome"], row["details"]["purpose"], row["details"]["issued"], row["target"]["chunk_count"]) for row in rows] == [
            ("success", "open", 4, 4), ("success", "open", 4, 4),
        ]
        # a fetch without keys is refused, and nothing is issued or audited
        r = await http.post("/v1/chunks/fetch", json={"hashes": hashes}, headers=live.headers(live.worker_token(a), cap))
        assert r.status_code == 422 and metrics.envelope_keys_issued.total() - issued0 == 8
        assert len(await _key_issue_rows(live, http, a, cap_id)) == len(rows) + 1  # + the store's seal


async def test_a_key_kept_from_a_fetch_opens_no_other_envelope(live_server: LiveServer):
    """The attacker is a worker that kept the key a fetch stream handed it for one envelope: it
    opens that envelope (positive control) and no other envelope of the tenant, with that
    envelope's true context or with its header rewritten to carry the kept salt; the other
    envelope's own key from the stream opens it (so the refusal is the key's)."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=22)
    t1, t2 = list(range(16)), list(range(6000, 6016))
    async with _remote(live, a) as ra, live.client() as http:
        await ra.store(model, t1, src, block_ids=BLOCKS)
        await ra.store(model, t2, src, block_ids=BLOCKS)
        cap = await ra.capability()
        h1, h2 = ra._chunks(model, t1)[0].chained_hash.hex(), ra._chunks(model, t2)[0].chained_hash.hex()
        _scope, [(kept, env1)] = await _keyed_fetch(live, http, a, cap, [h1])
        _scope, [(own2, env2)] = await _keyed_fetch(live, http, a, cap, [h2])
        key1 = IssuedKey(kept.salt, kept.key)
        plain = ChunkCipher().open(key1, _ctx(a, kept.storage_key.hex(), model, kept.key_version), env1)
        assert bytes(plain) == gathered(src, g, BLOCKS, 16).numpy().tobytes()  # positive control
        ctx2 = _ctx(a, own2.storage_key.hex(), model, own2.key_version)
        with pytest.raises(DecryptionFailed):
            ChunkCipher().open(key1, ctx2, env2)
        forged = bytearray(env2)
        forged[8:40] = kept.salt  # the header claims the kept salt
        with pytest.raises(DecryptionFailed):
            ChunkCipher().open(key1, ctx2, bytes(forged))
        with pytest.raises(DecryptionFailed):  # nor the raw key under the other salt
            ChunkCipher().open(IssuedKey(own2.salt, kept.key), ctx2, env2)
        assert ChunkCipher().open(IssuedKey(own2.salt, own2.key), ctx2, env2) == plain


async def test_the_fetch_charges_the_key_budget_before_it_sends_anything(live_server: LiveServer):
    """Past the capability's key budget a keyed fetch is a typed 403 before any byte of an
    envelope is sent (audited as a denial); the worker's load renews its capability and loads."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=24)
    tokens = list(range(9000, 9000 + N))
    plane = live.state.plane
    saved = plane.max_keys_per_capability
    async with _remote(live, a) as ra, live.client() as http:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        cap = await ra.capability()
        hashes = [c.chained_hash.hex() for c in ra._chunks(model, tokens)]
        plane.max_keys_per_capability = plane.issued_to(read_unverified(cap).cap_id) + 3  # room for 3 of 4
        try:
            r = await http.post("/v1/chunks/fetch", json={"hashes": hashes, "keys": True},
                                headers=live.headers(live.worker_token(a), cap))
            assert r.status_code == 403 and r.json()["type"] == "urn:kvgate:problem:key-budget-spent"
            rows = await _key_issue_rows(live, http, a, read_unverified(cap).cap_id)
            assert [(row["outcome"], row["details"]["route"]) for row in rows][-1] == ("denied", "/v1/chunks/fetch")
            dst = zero_cache(g, NUM_BLOCKS)
            assert (await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)).loaded_tokens == N  # a fresh capability
            assert await ra.capability() != cap
        finally:
            plane.max_keys_per_capability = saved


# -- the data plane's own client (gateway.remote.wire) -----------------------------------------------------
def _hang_up(*socks) -> None:
    import socket

    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)  # wakes the other pump, blocked on it; a close alone would not
        except OSError:
            pass
        s.close()


class _CuttingProxy:
    """A TCP proxy in front of the live server that cuts a ``POST /v1/chunks/fetch`` response
    after ``cut`` bytes (the connection closed under the client, mid-envelope)."""

    def __init__(self, upstream: tuple[str, int], cut: int = 1 << 62, stall_put_after: int | None = None) -> None:
        import socket
        import threading

        self.upstream, self.cut, self.stall_put_after = upstream, cut, stall_put_after
        self.release = threading.Event()  # a stalled upload is let go (its connections closed) once set
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.cuts = 0
        self._threading = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            state = {"fetch": False}
            self._threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            self._threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    def _up(self, src, dst, state) -> None:
        put = 0
        try:
            while data := src.recv(1 << 16):
                if b"POST /v1/chunks/fetch" in data:
                    state["fetch"] = True
                if b"PUT /v1/chunks " in data:
                    put = 1
                if put and self.stall_put_after is not None:
                    put += len(data)
                    if put > self.stall_put_after:  # stop reading: the client's send blocks
                        self.release.wait(30)
                        break
                dst.sendall(data)
        except OSError:
            pass
        _hang_up(src, dst)

    def _down(self, src, dst, state) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if state["fetch"]:
                    if sent + len(data) >= self.cut:
                        dst.sendall(data[: self.cut - sent])
                        self.cuts += 1
                        break
                    sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        _hang_up(src, dst)

    def close(self) -> None:
        self.sock.close()


async def test_a_fetch_cut_mid_envelope_loads_only_the_whole_envelopes_before_it(live_server: LiveServer):
    """The connection closes inside chunk 2's envelope: the worker's client reads a torn response
    (a typed error, counted unavailable), the load is chunks 0 and 1, and not a byte of chunk 2
    or later reaches the engine's cache."""
    from urllib.parse import urlsplit

    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=21)
    tokens = list(range(700, 700 + SIX))
    u = urlsplit(live.base_url)
    async with _remote(live, a, threads=1) as ra:
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6
        # positive control: straight to the server, the whole prefix loads
        ok = zero_cache(g, NUM_BLOCKS)
        assert (await ra.retrieve(model, tokens, ok, block_ids=BLOCKS6)).loaded_tokens == SIX
        h = ra._chunks(model, tokens)[0].chained_hash.hex()
        async with live.client() as http:
            env = await _stored_envelope(live, http, a, await ra.capability(), h)
        item = frames.KEYED_ITEM_HEAD + len(env)
        assert len(env) > 4096  # so the response head and chunk framing fit in half an item
    proxy = _CuttingProxy((u.hostname, u.port), cut=int(2.5 * item))
    try:
        async with RemoteGateway(proxy.url, live.worker_token(a), chunk_tokens=live.settings.chunk_tokens, threads=1) as rp:
            sentinel = random_cache(g, NUM_BLOCKS, seed=98)
            dst = [t.clone() for t in sentinel]
            got = await rp.retrieve(model, tokens, dst, block_ids=BLOCKS6)
            assert proxy.cuts == 1
            assert (got.loaded_tokens, got.integrity_failures) == (32, 0)
            assert rp.metrics.unavailable == 1
            assert torch.equal(gathered(src, g, BLOCKS6, 32), gathered(dst, g, BLOCKS6, 32))
            past = BLOCKS6[8:]
            assert torch.equal(gathered(sentinel, g, past, SIX - 32), gathered(dst, g, past, SIX - 32))
    finally:
        proxy.close()


async def test_a_store_cancelled_mid_upload_stores_nothing_and_frees_the_connection(live_server: LiveServer):
    """A worker that goes away while its batch is on the wire (the session closed mid-body): the
    server stores none of the batch, and the client's connection slot comes back."""
    import time
    from urllib.parse import urlsplit

    import gateway.remote.client as remote

    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=22)
    tokens = list(range(900, 900 + SIX))
    u = urlsplit(live.base_url)
    proxy = _CuttingProxy((u.hostname, u.port), stall_put_after=256 << 10)
    try:
        async with RemoteGateway(proxy.url, live.worker_token(a), chunk_tokens=live.settings.chunk_tokens) as rp:
            prompt = rp._chunks(model, tokens)
            session = await rp.session("", "put", prompt)
            env = memoryview(bytearray(32 << 20))  # far larger than the socket buffers: the send blocks at the proxy
            session._pending = [(0, env)]
            session._storage_keys[0] = "0" * 64  # the storage key a sealing key comes with
            await session._send_pending()  # the batch goes on the wire in the background, as put sends it
            sent = session._sending
            assert sent is not None
            await asyncio.sleep(0.5)
            assert not sent.done()  # blocked mid-body
            t0 = time.monotonic()
            await session.aclose()  # cancels the batch on the wire
            assert sent.cancelled()
            for _ in range(50):
                if rp._wire._slots._value == remote._CONNECTIONS:  # every connection slot is back
                    break
                await asyncio.sleep(0.05)
            assert rp._wire._slots._value == remote._CONNECTIONS and time.monotonic() - t0 < 2.5
    finally:
        proxy.release.set()
        proxy.close()
    async with _remote(live, a) as ra:
        async with live.client() as http:
            hdr = live.headers(live.worker_token(a), await ra.capability())
            for _ in range(100):  # the server saw the body torn: every extent it reserved given back
                if live.runtime.tiers.tiers[0].stats().reservations == 0:
                    break
                await asyncio.sleep(0.05)
            assert live.runtime.tiers.tiers[0].stats().reservations == 0
            assert await chunks.stored(http, hdr, [prompt[0].chained_hash.hex()]) == [False]
        # positive control: a client straight to the server stores the prefix whole
        assert (await ra.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6


async def test_remote_mode_over_https_with_the_servers_certificate_checked(live_server: LiveServer, tmp_path):
    """A worker's store and load over TLS (a TLS front in this test's loop, the live server behind
    it): every call, the data plane's own client included, checks the certificate; an untrusted
    certificate is refused before anything is sent."""
    import ssl
    from urllib.parse import urlsplit

    from tests.gateway.remote.test_wire import _certificate

    cert, key = _certificate(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    u = urlsplit(live_server.base_url)
    connections = []

    async def pump(rd: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await rd.read(1 << 20):
                w.write(data)
                await w.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            w.close()

    async def front(rd: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(w.get_extra_info("ssl_object").version())
        up_rd, up_w = await asyncio.open_connection(u.hostname, u.port)
        await asyncio.gather(pump(rd, up_w), pump(up_rd, w))

    tls = await asyncio.start_server(front, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://localhost:{tls.sockets[0].getsockname()[1]}"
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=23)
    tokens = list(range(1100, 1100 + SIX))
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        async with RemoteGateway(url, live.worker_token(a), chunk_tokens=live.settings.chunk_tokens, ssl_context=trusted) as rt:
            assert (await rt.store(model, tokens, src, block_ids=BLOCKS6)).stored == 6
            dst = zero_cache(g, NUM_BLOCKS)
            got = await rt.retrieve(model, tokens, dst, block_ids=BLOCKS6)
            assert (got.loaded_tokens, got.integrity_failures) == (SIX, 0)
            assert torch.equal(gathered(src, g, BLOCKS6, SIX), gathered(dst, g, BLOCKS6, SIX))
            # the store's presence check, its upload, the load: all on the data plane's own client
            assert rt._wire.requests == ["POST /v1/lookup", "PUT /v1/chunks", "POST /v1/chunks/fetch"]
        assert connections and all(v.startswith("TLS") for v in connections)
        # a certificate the worker does not trust (a man in the middle): refused, nothing stored
        seen = len(connections)
        async with RemoteGateway(url, live.worker_token(a), chunk_tokens=live.settings.chunk_tokens) as untrusting:
            with pytest.raises(RemoteUnavailable):
                await untrusting.store(model, list(range(5000, 5000 + SIX)), src, block_ids=BLOCKS6)
            assert untrusting._wire.requests == []
        assert len(connections) == seen  # no TLS session was ever set up
    finally:
        tls.close()
        await tls.wait_closed()
