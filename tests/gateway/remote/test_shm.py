"""Shared-memory loads on the server's Unix socket (``gateway.server.shm``, ``gateway.remote.shm``).

The server is the real CLI in its own process (``test_uds``'s fixture). Each property is tried as
a worker on the same host would try it, beside its positive control: a region lends its bytes
to its own tenant's loads only, a window never reaches past the region, an envelope in the region
is authenticated like one from the stream, a load cut off or a region the server forgot costs
one load's speed and nothing else, and a server without shared memory still serves every load."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from gateway.protocol import frames, shmpages
from gateway.remote.client import RemoteGateway
from gateway.remote.shm import ShmRegion, Window
from gateway.server.shm import MAX_UPLOADS, UPLOAD_TTL_S, CopyAhead, Regions, add_upload, copy_into
from kernels.layouts import KVLayout
from kernels.paged import PagedKV
from tenancy.devissuer import DevIssuer
from tests.support import uds_server
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.uds_server import BLOCKS, NOWHERE, NUM_BLOCKS, N, Served, create_tenant, serve, stop, wait_up

served = uds_server.served  # a fixture, registered in this module

REGION = 8 << 20


def _worker(s: Served, tenant: str, shm_bytes: int = REGION) -> RemoteGateway:
    return RemoteGateway(NOWHERE, s.issuer.mint(tenant, ["kv.worker"]), chunk_tokens=16, uds=str(s.path), shm_bytes=shm_bytes)


def _region(w: RemoteGateway) -> ShmRegion | None:
    """The worker's region (of its one tenant), as its clients share it."""
    assert w._shm is not None
    regions = list(w._shm._regions.values())
    return regions[0] if regions else None


def _setup(seed: int = 3) -> tuple[object, object, list[torch.Tensor], list[int]]:
    g = small_geometry()
    return g, model_for(g), random_cache(g, NUM_BLOCKS, seed=seed), list(range(800, 800 + N))


async def _load(w: RemoteGateway, g, model, tokens: list[int]) -> tuple[object, list[torch.Tensor]]:
    dst = zero_cache(g, NUM_BLOCKS)
    return await w.retrieve(model, tokens, dst, block_ids=BLOCKS), dst


async def test_loads_through_shared_memory_are_exact_and_stay_with_their_tenant(served: Served) -> None:
    with served.http() as http:
        a, b = create_tenant(served, http, "acme"), create_tenant(served, http, "globex")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa, _worker(served, b) as wb:
        assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        for rep in range(3):  # the region is lent again once a load is over, and used again
            got, dst = await _load(wa, g, model, tokens)
            assert got.loaded_tokens == N and got.integrity_failures == 0
            assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
            assert wa.metrics.shm_envelopes == 4 * (rep + 1)
            assert wa.metrics.arena_envelopes == 4 * (rep + 1)  # read in place in the namespace's arena
        assert _region(wa) is not None and not _region(wa).tainted
        # the server said it populates its side: the worker mapped the whole region ahead too
        _wait(lambda: _region(wa).populated == _region(wa).size)
        # another client of the same process and tenant (a connector makes one per capability)
        # borrows the same region: no second one is asked for
        shared = _region(wa)
        assert wa._wire.requests.count("POST /v1/shm/regions") == 1
        async with RemoteGateway(
            NOWHERE, served.issuer.mint(a, ["kv.worker"]), chunk_tokens=16, uds=str(served.path), shm_bytes=REGION,
            shm_cache=wa._shm,
        ) as wa2:
            got, dst = await _load(wa2, g, model, tokens)
            assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
            assert wa2.metrics.shm_envelopes == 4 and _region(wa2) is shared
            assert not any(r.startswith("POST /v1/shm") for r in wa2._wire.requests)
        # the other tenant on the same socket, with a region of its own: nothing of A's, and its own
        # copy of the same tokens (the positive control) comes back through its region
        got_b, dst_b = await _load(wb, g, model, tokens)
        assert got_b.loaded_tokens == 0 and all(not t.any() for t in dst_b) and wb.metrics.shm_envelopes == 0
        src_b = random_cache(g, NUM_BLOCKS, seed=9)
        assert (await wb.store(model, tokens, src_b, block_ids=BLOCKS)).stored == 4
        got_b, dst_b = await _load(wb, g, model, tokens)
        assert got_b.loaded_tokens == N and torch.equal(gathered(src_b, g, BLOCKS, N), gathered(dst_b, g, BLOCKS, N))
        assert wb.metrics.shm_envelopes == 4 and _region(wb) is not _region(wa)
        got, dst = await _load(wa, g, model, tokens)  # and A still gets A's
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


def _fetch(http: httpx.Client, s: Served, tenant: str, hashes: list[str], shm: dict | None, keys: bool = True) -> httpx.Response:
    token = s.issuer.mint(tenant, ["kv.worker"])
    r = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get", "lookup"]}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    body: dict = {"hashes": hashes, "keys": keys}
    if shm is not None:
        body["shm"] = shm
    return http.post("/v1/chunks/fetch", json=body, headers={"Authorization": f"Bearer {token}", "X-KV-Capability": r.json()["capability"]})


async def test_a_region_id_of_another_tenant_lends_nothing_and_a_window_never_passes_the_region(served: Served) -> None:
    with served.http() as http:
        a, b = create_tenant(served, http, "acme"), create_tenant(served, http, "globex")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa, _worker(served, b) as wb:
        await wa.store(model, tokens, src, block_ids=BLOCKS)
        await wb.store(model, tokens, random_cache(g, NUM_BLOCKS, seed=4), block_ids=BLOCKS)  # B's own copy
        await _load(wa, g, model, tokens)  # A's region exists and holds A's envelopes
        region = _region(wa)
        assert region is not None
        before = region._array.copy()
        hashes = [c.chained_hash.hex() for c in wb._chunks(model, tokens)]
        window = {"region": region.id, "offset": 0, "length": region.size}
        with served.http() as http:
            # B names A's region: answered as an unknown one, every item in the stream, A's bytes untouched
            r = _fetch(http, served, b, hashes, window)
            assert r.status_code == 200 and r.headers.get("x-kv-shm") == "gone"
            assert r.content[:4] == b"KVK1" and len(r.content) > 4 * 2000  # B's four envelopes, in the stream
            assert np.array_equal(region._array, before)
            # the control: A's own fetch of the same window lends it (items in the region, heads only)
            r = _fetch(http, served, a, hashes, {**window, "offset": 4096, "length": region.size - 4096})
            assert r.status_code == 200 and "x-kv-shm" not in r.headers
            assert len(r.content) < 2000 and not np.array_equal(region._array, before)
            # a window past the region's end, or a fetch without keys: a clear 422, nothing written
            # (in the region's tail, where no load has put anything: still zero)
            tail = region.size - (1 << 20)
            assert not region._array[tail:].any()
            bad = {**window, "offset": tail, "length": 1 << 20}
            for shm, keys, why in (
                ({**bad, "length": (1 << 20) + 64}, True, "window"), ({**bad, "offset": region.size}, True, "window"), (bad, False, "keys"),
            ):
                r = _fetch(http, served, a, hashes, shm, keys=keys)
                assert r.status_code == 422 and why in r.text, r.text
            assert not region._array[tail:].any()
            # the control: the same window within the region, with keys, is written into
            assert _fetch(http, served, a, hashes, bad).status_code == 200 and region._array[tail:].any()
            # a region is asked for with a capability that verifies: a forged one gets none
            token = served.issuer.mint(a, ["kv.worker"])
            good = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers={"Authorization": f"Bearer {token}"}).json()["capability"]
            for cap in (good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB"), good.replace(".", ".x", 1)):
                r = http.post("/v1/shm/regions", json={"bytes": 4096}, headers={"Authorization": f"Bearer {token}", "X-KV-Capability": cap})
                assert r.status_code in (401, 403), (r.status_code, r.text)
            # a region is asked for on the Unix socket only
            token = served.issuer.mint(a, ["kv.worker"])
            cap = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers={"Authorization": f"Bearer {token}"}).json()["capability"]
            headers = {"Authorization": f"Bearer {token}", "X-KV-Capability": cap}
            with httpx.Client(base_url=served.url, timeout=10.0) as tcp:
                r = tcp.post("/v1/shm/regions", json={"bytes": 4096}, headers=headers)
                assert r.status_code == 422 and "Unix socket" in r.json()["detail"]
                assert tcp.post("/v1/shm/regions", json={"bytes": 4096}, headers={"Authorization": f"Bearer {token}"}).status_code in (401, 403)


def _tamper_second_envelope(monkeypatch: pytest.MonkeyPatch):
    """The worker reads the second envelope of its region with one bit flipped in its body (the
    server's copy is untouched); returns what puts the plain view back."""
    view = ShmRegion.view
    seen = [0]

    def flipped(self: ShmRegion, offset: int, n: int, arena: bool = False):
        holder, out = view(self, offset, n, arena)
        seen[0] += 1
        if seen[0] != 2:
            return holder, out
        bad = holder.copy()
        bad[n // 2] ^= 1
        return bad, bad.data.cast("B")

    monkeypatch.setattr(ShmRegion, "view", flipped)
    return lambda: monkeypatch.setattr(ShmRegion, "view", view)


async def test_a_tampered_envelope_in_the_region_ends_the_prefix_and_nothing_of_it_lands(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    with served.http() as http:
        a = create_tenant(served, http, "acme")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa:
        await wa.store(model, tokens, src, block_ids=BLOCKS)
        untamper = _tamper_second_envelope(monkeypatch)
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == 16 and got.integrity_failures == 1  # the first chunk only
        assert torch.equal(gathered(src, g, BLOCKS, 16), gathered(dst, g, BLOCKS, 16))
        assert not gathered(dst, g, BLOCKS[4:8], 16).any()  # the tampered chunk (tokens 16-31): nothing of it
        for k, n in ((8, 16), (12, N - 48)):  # chunks opened beside it (another batch): authentic bytes, or none
            chunk = gathered(dst, g, BLOCKS[k:], n)
            assert not chunk.any() or torch.equal(chunk, gathered(src, g, BLOCKS[k:], n))
        untamper()
        # the next load, with nothing tampered: the prefix is whole again (the bad copy was dropped
        # by the failure, so it is stored again first)
        await wa.store(model, tokens, src, block_ids=BLOCKS)
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == N and got.integrity_failures == 0
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


async def test_a_layer_wise_load_through_the_region_says_a_layer_only_once_it_is_in_and_a_tampered_one_lands_nothing(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RemoteGateway.retrieve(on_layers=)`` through a region: an engine's forward could run beside
    the load, told layer by layer what is in place in every chunk still loading."""
    with served.http() as http:
        a = create_tenant(served, http, "acme")
    g = small_geometry(KVLayout.CPU, torch.float32)  # vLLM's CPU cache: opened in place, layer by layer
    model, src, tokens = model_for(g), random_cache(g, NUM_BLOCKS, seed=5), list(range(900, 900 + N))
    layer = 2 * 16 * g.num_kv_heads * g.head_size * 4  # a chunk's layer: a segment of its own
    async with RemoteGateway(NOWHERE, served.issuer.mint(a, ["kv.worker"]), chunk_tokens=16, uds=str(served.path),
                             shm_bytes=REGION, segment_bytes=layer) as wa:
        await wa.store(model, tokens, src, block_ids=BLOCKS)
        dst = zero_cache(g, NUM_BLOCKS)
        said: list[int] = []
        early: list[int] = []  # layers said before their whole blocks were in

        def on_layers(n: int) -> None:  # layers [0, n) of every chunk: in place, and authentic
            said.append(n)  # (told from an opening thread: what it finds is checked after)
            early.extend(k for k in range(n) if not torch.equal(dst[k][BLOCKS[:-1]], src[k][BLOCKS[:-1]]))

        got = await wa.retrieve(model, tokens, dst, block_ids=BLOCKS, on_layers=on_layers)
        assert got.loaded_tokens == N and got.integrity_failures == 0 and wa.metrics.shm_envelopes == 4
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert said == sorted(said) and said[-1] == g.num_layers and said[0] < g.num_layers  # one by one
        assert early == []

        untamper = _tamper_second_envelope(monkeypatch)
        dst = zero_cache(g, NUM_BLOCKS)
        said.clear()
        got = await wa.retrieve(model, tokens, dst, block_ids=BLOCKS, on_layers=said.append)
        assert got.loaded_tokens == 16 and got.integrity_failures == 1  # the first chunk only
        assert said[-1] == g.num_layers  # the forward is let go however the load ended
        assert torch.equal(gathered(src, g, BLOCKS, 16), gathered(dst, g, BLOCKS, 16))
        assert not gathered(dst, g, BLOCKS[4:8], 16).any()  # the tampered chunk: nothing of it
        for k, n in ((8, 16), (12, N - 48)):  # chunks after it: authentic bytes, or none
            chunk = gathered(dst, g, BLOCKS[k:], n)
            assert not chunk.any() or torch.equal(chunk, gathered(src, g, BLOCKS[k:], n))
        untamper()
        await wa.store(model, tokens, src, block_ids=BLOCKS)  # the failure dropped the bad copy
        dst = zero_cache(g, NUM_BLOCKS)
        got = await wa.retrieve(model, tokens, dst, block_ids=BLOCKS, on_layers=lambda n: None)
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


async def test_a_forgotten_or_tainted_region_costs_one_load_its_speed_and_is_replaced(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served.http() as http:
        a = create_tenant(served, http, "acme")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa:
        await wa.store(model, tokens, src, block_ids=BLOCKS)
        await _load(wa, g, model, tokens)
        first = _region(wa)
        assert first is not None and wa.metrics.shm_envelopes == 4
        first.id = "0" * 32  # as if the server had been restarted (or had evicted it)
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert wa.metrics.shm_envelopes == 4 and first.tainted  # through the stream; the region is dropped
        for _ in range(2):  # the loads after: a new region, used
            got, dst = await _load(wa, g, model, tokens)
            assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert _region(wa) is not None and _region(wa) is not first and wa.metrics.shm_envelopes == 12
        # a load cut off (cancelled) mid-stream taints the region it had (the server may still be
        # copying into it): the next ones get a new one and are whole
        second = _region(wa)
        entered, go_on = threading.Event(), threading.Event()
        take = Window.take

        def stalled(self: Window, n: int, arena_offset: int | None = None) -> memoryview:
            entered.set()
            go_on.wait(10)
            return take(self, n, arena_offset)

        monkeypatch.setattr(Window, "take", stalled)
        load = asyncio.ensure_future(_load(wa, g, model, tokens))
        assert await asyncio.to_thread(entered.wait, 10)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        go_on.set()
        assert second.tainted
        fresh: list[int] = []  # envelopes read from a region other than the tainted one (the cut
        # load's thread may still take a few from that one as it ends)

        def counted(self: Window, n: int, arena_offset: int | None = None) -> memoryview:
            if self.region is not second:
                fresh.append(n)
            return take(self, n, arena_offset)

        monkeypatch.setattr(Window, "take", counted)
        for _ in range(2):
            got, dst = await _load(wa, g, model, tokens)
            assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert _region(wa) is not second and len(fresh) == 8  # both through the new region


async def _attached(w: RemoteGateway) -> ShmRegion:
    """The worker's region, asked for now (a store asks for it in the background)."""
    region = await w._region()
    assert region is not None
    return region


async def test_a_store_seals_in_place_into_its_namespaces_arena_and_loads_back_exact(served: Served) -> None:
    with served.http() as http:
        a, b = create_tenant(served, http, "acme"), create_tenant(served, http, "globex")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa, _worker(served, b) as wb:
        region = await _attached(wa)
        assert region.arena is not None
        sent = len(wa._wire.requests)
        assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        calls = wa._wire.requests[sent:]
        assert "PUT /v1/chunks" not in calls and calls.count("POST /v1/chunks/commit") == 1  # no envelope crossed the socket
        assert wa.metrics.arena_sealed == 4
        got, dst = await _load(wa, g, model, tokens)  # read where it was sealed
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert wa.metrics.arena_envelopes == 4
        # the control beside it: B's same tokens are not A's (a miss), and B stores and loads its own in place
        got_b, dst_b = await _load(wb, g, model, tokens)
        assert got_b.loaded_tokens == 0 and all(not t.any() for t in dst_b)
        await _attached(wb)
        src_b = random_cache(g, NUM_BLOCKS, seed=9)
        assert (await wb.store(model, tokens, src_b, block_ids=BLOCKS)).stored == 4 and wb.metrics.arena_sealed == 4
        got_b, dst_b = await _load(wb, g, model, tokens)
        assert got_b.loaded_tokens == N and torch.equal(gathered(src_b, g, BLOCKS, N), gathered(dst_b, g, BLOCKS, N))


async def test_a_workers_first_store_waits_for_the_region_it_asks_for_and_seals_in_place(served: Served) -> None:
    """A fresh worker has no region yet: its first store asks for one and waits for that answer
    (a local call) rather than sending every envelope up the socket. The control is the test of
    servers without shared memory or arenas below: there the first store uploads, and nothing
    waits."""
    with served.http() as http:
        a = create_tenant(served, http, "acme")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa:
        assert _region(wa) is None
        sent = len(wa._wire.requests)
        assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4
        calls = wa._wire.requests[sent:]
        assert "POST /v1/shm/regions" in calls and "PUT /v1/chunks" not in calls and wa.metrics.arena_sealed == 4
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


async def test_a_store_sealed_in_place_that_races_a_clear_stores_nothing_and_the_next_one_does(served: Served) -> None:
    """A clear of the namespace between the store's keys (its extents reserved) and its commit: the
    reservations are cancelled and the commit is a 409; nothing is stored. The control: the same
    store after it is kept and loads exact."""
    with served.http() as http:
        a = create_tenant(served, http, "acme")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa:
        await _attached(wa)
        opened = wa.session

        async def racing(token: str, op: str, chunks):
            session = await opened(token, op, chunks)
            keys = session.sealing_keys

            async def keys_then_clear(indices, sizes=None):
                got = await keys(indices, sizes)
                assert session._slots  # extents were reserved
                body = {"scope": "namespace", "tenant": a, "namespace": "default"}
                with served.http() as http:
                    r = http.post("/v1/admin/clear", json=body, headers=served.bearer(a, ["kv.admin"]))
                assert r.status_code == 200, r.text
                return got

            session.sealing_keys = keys_then_clear
            return session

        wa.session = racing  # type: ignore[method-assign]
        res = await wa.store(model, tokens, src, block_ids=BLOCKS)
        assert res.stored == 0 and wa.metrics.stores_namespace_changed == 1
        wa.session = opened  # type: ignore[method-assign]
        assert (await wa.lookup(model, tokens)).hit_tokens == 0
        assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4 and wa.metrics.arena_sealed == 8
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


@contextlib.contextmanager
def _served_with(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Served, str]]:
    """A server of the test's own (``env`` over the usual settings) and its tenant acme's id."""
    path = tmp_path / "k.sock"
    proc, url, log = serve(tmp_path, path, extra_env=env)
    try:
        wait_up(path, proc, log)
        s = Served(url, path, proc, DevIssuer(tmp_path / "state", issuer_url=url + "/dev-issuer"), log)
        with s.http() as http:
            yield s, create_tenant(s, http, "acme")
    finally:
        stop(proc)


def _arena_items(content: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of each item a keyed fetch answered in the arena (status 7)."""
    _ct, t_len, n_len = frames.parse_keyed_head(content[: frames.KEYED_HEAD])
    at, out = frames.KEYED_HEAD + t_len + n_len, []
    while at < len(content):
        item = frames.parse_keyed_item_head(content[at : at + frames.KEYED_ITEM_HEAD])
        at += frames.KEYED_ITEM_HEAD
        if item.status == frames.IN_ARENA:
            out.append((frames.parse_arena_offset(content[at : at + frames.ARENA_OFFSET]), item.length))
            at += frames.ARENA_OFFSET
        elif item.status == frames.OK:
            at += item.length
    return out


async def test_a_store_after_a_hit_seals_where_the_hit_read_once_it_is_over_and_never_under_a_load_still_reading(
    tmp_path: Path,
) -> None:
    """A memory tier with room for one prompt's envelopes: a hit leaves its extents leased to the
    region; a store of another prompt after the hit is over says so (``returned``) and seals in
    place where the hit read. The attack on it, as a worker would make it: a load that still reads
    (its window lent, its items in the arena) must keep its bytes while the next store runs: that
    store uploads (no room), and the extents the load reads hold what they held."""
    with _served_with(tmp_path, {"KVGATE_MEMORY_BYTES": str(40 << 10)}) as (s, a):
        g, model, src, tokens = _setup()
        prompts = [list(range(3000 * k, 3000 * k + N)) for k in (1, 2, 3)]
        async with _worker(s, a) as wa:
            region = await _attached(wa)
            assert region.arena is not None
            assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4 and wa.metrics.arena_sealed == 4
            got, dst = await _load(wa, g, model, tokens)  # in place: the server keeps what it read leased
            assert got.loaded_tokens == N and wa.metrics.arena_envelopes == 4
            # the load's views go as its last holder drops them (a pool thread may hold one a moment)
            for _ in range(100):
                if region.returned == region.lends:
                    break
                await asyncio.sleep(0.02)
            assert region.returned == region.lends
            # the hit is over: the next store reuses its extents, sealed in place (nothing uploaded)
            src1 = random_cache(g, NUM_BLOCKS, seed=11)
            sent = len(wa._wire.requests)
            assert (await wa.store(model, prompts[0], src1, block_ids=BLOCKS)).stored == 4
            assert "PUT /v1/chunks" not in wa._wire.requests[sent:] and wa.metrics.arena_sealed == 8
            got, dst = await _load(wa, g, model, prompts[0])
            assert got.loaded_tokens == N and torch.equal(gathered(src1, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
            # a load still reading: its window lent and its fetch answered in the arena, not ended
            window = region.lend(5.0)  # once the last load's views are gone
            assert window is not None
            hashes = [c.chained_hash.hex() for c in wa._chunks(model, prompts[0])]
            with s.http() as http:
                r = _fetch(http, s, a, hashes, window.request())
            assert r.status_code == 200
            reading = _arena_items(r.content)
            assert len(reading) == 4
            held = [region.arena[off : off + n].copy() for off, n in reading]
            src2 = random_cache(g, NUM_BLOCKS, seed=12)
            sent = len(wa._wire.requests)
            assert (await wa.store(model, prompts[1], src2, block_ids=BLOCKS)).stored == 4  # stored, by upload
            assert "PUT /v1/chunks" in wa._wire.requests[sent:] and wa.metrics.arena_sealed == 8
            assert wa.metrics.arena_unreserved == 4  # asked for extents, got none: sent up the socket
            assert all(np.array_equal(region.arena[off : off + n], h) for (off, n), h in zip(reading, held, strict=True))
            window.end(True)
            # that load over, the next store seals in place again, and both later prompts load exact
            src3 = random_cache(g, NUM_BLOCKS, seed=13)
            sent = len(wa._wire.requests)
            assert (await wa.store(model, prompts[2], src3, block_ids=BLOCKS)).stored == 4
            assert "PUT /v1/chunks" not in wa._wire.requests[sent:] and wa.metrics.arena_sealed == 12
            assert wa.metrics.arena_unreserved == 4
            got, dst = await _load(wa, g, model, prompts[2])
            assert got.loaded_tokens == N and torch.equal(gathered(src3, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


async def test_a_reservation_commits_only_for_its_worker_and_only_envelopes_that_check(served: Served) -> None:
    """The commit route tried as a worker would abuse it: another tenant's reservation, a region
    that is not the caller's, another namespace's capability, an extent holding something other
    than a sealed envelope; beside the control, a commit of a real seal."""
    with served.http() as http:
        a, b = create_tenant(served, http, "acme"), create_tenant(served, http, "globex")
    g, model, src, tokens = _setup()
    async with _worker(served, a) as wa, _worker(served, b) as wb:
        ra, rb = await _attached(wa), await _attached(wb)
        cap_a, cap_b = await wa.capability(), await wb.capability()
        session = await wa.session(cap_a, "put", wa._chunks(model, tokens))
        sizes = [wa._plane.datapath.envelope_nbytes(PagedKV(src, g), 16)] * 4
        await session.sealing_keys([0, 1, 2, 3], sizes)
        upload = next(iter(session._commits))
        slot = session.reserve(0, sizes[0])
        assert slot is not None
        slot.view[:] = b"\x5a" * sizes[0]  # not an envelope
        with served.http() as http:
            def commit(cap: str, headers_of: RemoteGateway, region: str, items: list[int], last: bool = True) -> httpx.Response:
                return http.post("/v1/chunks/commit", json={"region": region, "upload": upload, "items": items, "last": last},
                                 headers=dict(headers_of._data_headers(cap, "application/json")))

            r = commit(cap_b, wb, rb.id, [0])
            assert r.status_code == 404 and "no such reservation" in r.text  # B names its own region: no such upload there
            assert commit(cap_b, wb, ra.id, [0]).status_code == 404  # nor A's region, which is not B's
            async with RemoteGateway(NOWHERE, served.issuer.mint(a, ["kv.worker"]), chunk_tokens=16, uds=str(served.path),
                                     namespace="other") as wo:  # A's worker of another namespace, on A's region
                assert commit(await wo.capability(), wo, ra.id, [0]).status_code == 404
            r = commit(cap_a, wa, ra.id, [0], last=False)
            assert r.status_code == 400 and "not a kvgate envelope" in r.text  # and the reservation ends
            assert commit(cap_a, wa, ra.id, [1]).status_code == 404
        await session.aclose()
        assert (await wa.lookup(model, tokens)).hit_tokens == 0  # nothing of it was stored
        # the control: a store through the same worker seals, commits and loads
        assert (await wa.store(model, tokens, src, block_ids=BLOCKS)).stored == 4 and wa.metrics.arena_sealed == 4
        got, dst = await _load(wa, g, model, tokens)
        assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


@pytest.mark.parametrize(
    ("env", "through"),
    [({"KVGATE_SHM_MAX_BYTES": "0"}, "socket"), ({"KVGATE_SHM_ARENAS": "false"}, "region")],
    ids=["no-shared-memory", "no-arenas"],
)
async def test_a_server_without_shared_memory_or_arenas_serves_every_load_through_the_socket_or_region(
    tmp_path: Path, env: dict[str, str], through: str,
) -> None:
    with _served_with(tmp_path, env) as (s, a):
        g, model, src, tokens = _setup()
        async with _worker(s, a) as wa:
            await wa.store(model, tokens, src, block_ids=BLOCKS)
            for _ in range(2):
                got, dst = await _load(wa, g, model, tokens)
                assert got.loaded_tokens == N and torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
            assert wa.metrics.arena_envelopes == 0 and wa.metrics.arena_sealed == 0
            if through == "socket":
                assert wa.metrics.shm_envelopes == 0 and wa.metrics.shm_unavailable == 1  # asked once, then left alone
            else:  # every envelope copied into the region, which came without an arena
                assert wa.metrics.shm_envelopes == 8 and _region(wa) is not None and _region(wa).arena is None


def test_regions_are_sealed_bounded_and_bound_to_their_tenant_and_user() -> None:
    regions = Regions(max_bytes=1 << 20, max_regions=3, populate=False)  # lazy: pages as copies touch them
    peer = f"unix:uid={os.getuid()}:pid=1"
    region, fd = regions.create("acme", peer, 256 << 10)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # a worker cannot pull the pages from under the server
        mapped = ShmRegion(region.id, os.dup(fd), region.size)  # what a worker maps: read-only
        with pytest.raises(TypeError):
            mapped.view(0, 16)[1][0] = 1
        region.view[: 64 << 10] = 1  # a load's copy allocates the pages it writes
        assert os.fstat(fd).st_blocks * 512 >= 64 << 10
        assert regions.get(region.id, "acme", peer) is region  # the control
        assert regions.get(region.id, "globex", peer) is None
        assert regions.get(region.id, "acme", "unix:uid=99999:pid=1") is None
        assert regions.get(region.id, "acme", "127.0.0.1") is None
        # dropped while the worker still holds the descriptor: its pages are freed all the same
        regions.drop(region.id)
        assert os.fstat(fd).st_blocks == 0 and regions.bytes == 0
    finally:
        os.close(fd)
    with pytest.raises(Exception, match="Unix socket"):
        regions.create("acme", "127.0.0.1", 4096)
    with pytest.raises(Exception, match="bytes"):
        regions.create("acme", peer, 2 << 20)

    def made(tenant: str, size: int = 256 << 10):
        r, fd = regions.create(tenant, peer, size)
        os.close(fd)
        return r

    # a tenant holds at most a quarter (here: one region's worth, 1 MiB); past it, its own idle
    # regions make room, least recently used first, never another tenant's
    a1, a2 = made("acme"), made("acme")
    g1 = made("globex")
    a1.busy = 1  # a fetch is copying into it
    a3 = made("acme", 512 << 10)  # 1 MiB quota: a2 (idle) goes, a1 (busy) stays
    assert regions.get(a2.id, "acme", peer) is None and regions.get(a1.id, "acme", peer) is a1
    assert regions.get(g1.id, "globex", peer) is g1
    # a request refused anyway drops nothing
    a3.busy = 1
    with pytest.raises(Exception, match="all in use"):
        made("acme", 512 << 10)
    assert {r.id for r in regions._regions.values()} == {a1.id, a3.id, g1.id}
    # another tenant's request past the server's limits takes idle regions of others, not busy ones
    with pytest.raises(Exception, match="all in use"):
        made("initech", 1 << 20)
    assert {r.id for r in regions._regions.values()} == {a1.id, a3.id, g1.id}
    a1.busy = a3.busy = 0
    i1 = made("initech", 256 << 10)
    assert regions.get(i1.id, "initech", peer) is i1 and len(regions._regions) == 3
    # 8 regions a minute per tenant and user, then a refusal (the worker backs off)
    for _ in range(2):
        made("umbrella", 64 << 10)
    with pytest.raises(Exception, match="last minute"):
        for _ in range(8):
            made("acme", 64 << 10)
    regions.close()
    assert regions.bytes == 0
    unsealed = os.memfd_create("plain")
    os.ftruncate(unsealed, 4096)
    with pytest.raises(ValueError, match="sealed"):
        ShmRegion("x" * 32, unsealed, 4096)  # a worker maps only a region it cannot be made to fault on


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_region_is_populated_behind_on_both_sides_and_a_dropped_one_keeps_no_pages() -> None:
    size = 24 << 20
    lazy = Regions(max_bytes=64 << 20, populate=False)
    r0, fd0 = lazy.create("acme", f"unix:uid={os.getuid()}:pid=1", size)
    try:  # the control: a region nobody populates has no pages
        time.sleep(0.2)
        assert os.fstat(fd0).st_blocks == 0 and r0.populated == -1
    finally:
        os.close(fd0)
        lazy.close()
    regions = Regions(max_bytes=64 << 20)
    region, fd = regions.create("acme", f"unix:uid={os.getuid()}:pid=1", size)
    try:
        _wait(lambda: region.populated == size)  # the server's side: every page allocated, mapped writable
        assert os.fstat(fd).st_blocks * 512 == size
        mapped = ShmRegion(region.id, os.dup(fd), size)  # the worker's side maps them (read-only)
        assert mapped.populated == -1
        mapped.populate_behind()
        _wait(lambda: mapped.populated == size)
        # dropped: its pages are punched out, and a populating thread that is stopped by the drop
        # leaves none behind either
        regions.drop(region.id)
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)
    big, fd = regions.create("acme", f"unix:uid={os.getuid()}:pid=1", 48 << 20)
    try:
        regions.drop(big.id)  # at once: its thread stops within a step
        _wait(lambda: big.populated >= 0)
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)
    regions.close()


def test_populating_runs_at_nice_19_a_step_at_a_time_and_stops_when_asked(tmp_path: Path) -> None:
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, 16 << 20)
        mm = mmap.mmap(fd, 16 << 20)
        view = np.frombuffer(mm, dtype=np.uint8)
        seen: dict[str, int] = {}
        calls = [0]

        def stop() -> bool:
            calls[0] += 1
            return calls[0] > 2  # two steps, then stop

        def done(n: int) -> None:
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            seen["n"] = n

        shmpages.populate_behind(view, shmpages.POPULATE_WRITE, stop, done).join(10)
        assert seen == {"nice": 19, "n": 2 * shmpages._STEP}
        assert os.fstat(fd).st_blocks * 512 == 2 * shmpages._STEP
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # only that thread
        # a refusal (here: an advice the kernel does not know) ends it quietly: nothing populated
        assert shmpages.populate(view, 999) == 0
        del view
        mm.close()
    finally:
        os.close(fd)


class _Batch:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def test_a_region_with_a_store_in_flight_is_not_dropped_and_a_stale_upload_is_given_back() -> None:
    regions = Regions(max_bytes=1 << 20, max_regions=1, populate=False)
    peer = f"unix:uid={os.getuid()}:pid=1"
    r1, fd = regions.create("acme", peer, 256 << 10)
    os.close(fd)
    live = _Batch()
    assert add_upload(r1, live, time.monotonic()) is not None
    with pytest.raises(Exception, match="all in use"):  # its reserved extents are being sealed into
        regions.create("acme", peer, 256 << 10)
    r1.uploads.clear()
    stale = _Batch()
    assert add_upload(r1, stale, time.monotonic() - UPLOAD_TTL_S - 1) is not None  # never committed in time
    r2, fd = regions.create("acme", peer, 256 << 10)  # a stale reservation does not hold the region
    os.close(fd)
    assert regions.get(r1.id, "acme", peer) is None and r1.closed and stale.aborted == 1  # given back with it
    older = _Batch()
    assert add_upload(r2, older, time.monotonic() - UPLOAD_TTL_S - 1) is not None
    assert add_upload(r2, live, time.monotonic()) is not None and older.aborted == 1  # swept when the next one came
    r2.uploads.clear()
    kept = [_Batch() for _ in range(MAX_UPLOADS + 1)]
    ids = [add_upload(r2, batch, time.monotonic()) for batch in kept]
    assert all(ids[:MAX_UPLOADS]) and ids[-1] is None and kept[-1].aborted == 1  # bounded per region
    regions.drop(r2.id)
    assert all(batch.aborted == 1 for batch in kept)  # a dropped region gives every reservation back
    regions.close()


def test_a_hold_keeps_its_region_from_being_dropped_and_counts_once() -> None:
    regions = Regions(max_bytes=1 << 20, populate=False)
    peer = f"unix:uid={os.getuid()}:pid=1"
    region, fd = regions.create("acme", peer, 512 << 10)
    os.close(fd)
    assert regions.hold(region.id, "globex", peer) is None  # another tenant's id holds nothing
    first, second = regions.hold(region.id, "acme", peer), regions.hold(region.id, "acme", peer)
    assert first is not None and second is not None and region.busy == 2
    with pytest.raises(Exception, match="all in use"):  # held: not dropped to make room
        regions.create("acme", peer, 1 << 20)
    first.release()
    first.release()  # the stream's end and an error path both release: it counts once
    assert region.busy == 1

    class Stream:  # a response stream that never started
        pass

    stream = Stream()
    second.tie(stream)
    del stream
    assert region.busy == 0  # collected unstarted: the region is let go
    made, fd = regions.create("acme", peer, 1 << 20)  # the control: idle, it makes room now
    os.close(fd)
    assert regions.get(region.id, "acme", peer) is None and made.size == 1 << 20
    regions.close()


async def test_copies_into_a_window_run_one_ahead_and_an_item_comes_back_only_once_its_copy_ended() -> None:
    gates = [threading.Event() for _ in range(3)]
    running: list[int] = []
    most = 0

    def gated(dst: np.ndarray, src: memoryview) -> None:
        nonlocal most
        k = int(np.frombuffer(src, dtype=np.uint8)[0]) - 1
        running.append(k)
        most = max(most, len(running))
        try:
            if not gates[k].wait(10):
                raise TimeoutError(k)
            if k == 2:
                raise OSError("the copy failed")
            copy_into(dst, src)
        finally:
            running.remove(k)

    async def until(cond) -> None:
        for _ in range(1000):
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("never")

    dst = np.zeros((3, 1 << 20), dtype=np.uint8)
    srcs = [memoryview(bytes([k + 1]) * (1 << 20)) for k in range(3)]
    copies: CopyAhead[str] = CopyAhead(gated)
    assert await copies.push(dst[0], srcs[0], "item 0") is None  # the first has none before it
    second = asyncio.ensure_future(copies.push(dst[1], srcs[1], "item 1"))
    await until(lambda: running == [0, 1])  # the second copy started while the first still runs
    await asyncio.sleep(0.05)
    assert not second.done() and not dst[0].any()  # its item waits for the first copy to end
    gates[0].set()
    assert await second == "item 0" and bool((dst[0] == 1).all())  # the first is whole when its item is back
    assert running == [1] and not dst[1].any()
    drained = asyncio.ensure_future(copies.drain())
    await asyncio.sleep(0.05)
    assert not drained.done()  # the last item too waits for its copy
    gates[1].set()
    assert await drained == "item 1" and bool((dst[1] == 2).all())
    assert await copies.drain() is None and most == 2

    # a copy that fails is raised to the fetch by the call that would hand its item back
    assert await copies.push(dst[2], srcs[2], "item 2") is None
    gates[2].set()
    with pytest.raises(OSError, match="the copy failed"):
        await copies.drain()

    # a fetch cut short lets its region go only once no copy writes any more, and raises nothing
    gates[0].clear()
    assert await copies.push(dst[0], srcs[0], "cut") is None
    settled = asyncio.ensure_future(copies.settle())
    await asyncio.sleep(0.05)
    assert not settled.done() and running == [0]
    gates[0].set()
    await settled
    assert running == [] and await copies.drain() is None
    gates[2].clear()
    assert await copies.push(dst[2], srcs[2], "failing") is None
    gates[2].set()
    await copies.settle()  # its failure is taken, not raised


def test_a_backend_asks_for_its_tenants_region_while_the_forward_before_a_first_store_runs(served: Served) -> None:
    """``Backend.prepare`` (the worker calls it as a step that ends in a store begins): it returns
    at once, and the region, with the namespace's arena the server makes for it, is mapped by the
    time the forward would end, before any store asked; asked again, nothing more is asked for.
    The control: a backend without shared memory asks for nothing."""
    from gateway.vllm import backend as backends

    with served.http() as http:
        a = create_tenant(served, http, "acme")
        r = http.post("/v1/capabilities", json={"tenant": a, "namespace": "default", "ops": ["lookup", "get", "put"], "ttl": 600},
                      headers=served.bearer("platform", ["kv.operator"]))
        assert r.status_code == 201, r.text
        cap = r.json()["capability"]
    token = served.issuer.mint(a, ["kv.worker"])
    shm = backends.RemoteBackend(NOWHERE, token, 16, uds=str(served.path), shm_bytes=REGION)
    plain = backends.RemoteBackend(NOWHERE, token, 16, uds=str(served.path))
    for b in (shm, plain):
        backends.start(b)
    try:
        for b in (shm, plain):
            t0 = time.monotonic()
            b.prepare(cap)
            assert time.monotonic() - t0 < 0.5  # the engine's step does not wait for it
        deadline = time.monotonic() + 10
        while (shm._shm is None or shm._shm.cached(a) is None) and time.monotonic() < deadline:
            time.sleep(0.02)
        region = shm._shm.cached(a) if shm._shm is not None else None
        assert region is not None and region.arena is not None  # mapped, with the namespace's arena
        shm.prepare(cap)
        time.sleep(0.2)
        assert shm._shm.cached(a) is region
        asked = [r for c in shm._clients.values() for r in c._wire.requests if r == "POST /v1/shm/regions"]
        assert asked == ["POST /v1/shm/regions"]
        assert plain._shm is None and not plain._clients  # the control: nothing asked for
    finally:
        for b in (shm, plain):
            backends.close(b)
