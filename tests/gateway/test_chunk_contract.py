"""One tier side, two modes: the same requests through the core in process (embedded mode) and
through a live ``kvgate serve`` from a remote worker end the same way, because both go through
``gateway.chunks.ChunkService``: a hit, a miss, another tenant's prompt, a disabled tenant, a
revoked capability, an envelope tampered with in the tier (``integrity.failure`` audited in both,
the bad copy dropped under the loading capability), a tier that stalls past its deadline
(``tier_timeout``) or is down (``tier_unavailable``), and a KEK provider out of reach (keys
unavailable: nothing stored, nothing loaded); after each, the requests that follow are whole
again. The server's counters count each outcome in both modes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from gateway.errors import AccessDenied
from gateway.remote.client import RemoteGateway
from gateway.remote.wire import RemoteUnavailable
from gateway.types import LookupResult, RetrieveResult, StoreResult
from tests.support import server_fixture
from tests.support.audit_events import live_rows
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.moto_kms import moto_server
from tests.support.redis_server import Server
from tests.support.server_fixture import ALL_OPS, LiveServer, running_server
from tests.support.tcp_proxy import tcp_proxy

live_server = server_fixture.live_server  # a fixture, registered in this module

NUM_BLOCKS = 32
N = 16 * 3  # three chunks of 16 tokens (the test server's chunk size)
BLOCKS = list(range(12))
MODES = ["embedded", "remote"]


class Embedded:
    """The core of the live server's process, called as an embedded worker calls its own."""

    def __init__(self, live: LiveServer, tenant: str, namespace: str = "default") -> None:
        self.live, self.tenant, self.namespace, self.gw = live, tenant, namespace, live.gateway

    async def _cap(self) -> str:
        return await self.live.call(self.gw.mint_capability, self.tenant, self.namespace, ALL_OPS, 600)

    async def hold(self) -> None:
        """From now on, every request carries the capability held now (and no fresh one)."""
        held = await self._cap()
        self._cap = lambda: _held(held)  # type: ignore[method-assign]

    async def store(self, model: Any, tokens: Sequence[int], kv: Any) -> StoreResult:
        return await self.live.call(self.gw.store, await self._cap(), model, tokens, kv, block_ids=BLOCKS)

    async def lookup(self, model: Any, tokens: Sequence[int]) -> LookupResult:
        return await self.live.call(self.gw.lookup, await self._cap(), model, tokens)

    async def retrieve(self, model: Any, tokens: Sequence[int], kv: Any) -> RetrieveResult:
        return await self.live.call(self.gw.retrieve, await self._cap(), model, tokens, kv, block_ids=BLOCKS)

    async def aclose(self) -> None:
        return None


class Remote:
    """A remote worker of the tenant against the live server."""

    def __init__(self, live: LiveServer, tenant: str, namespace: str = "default") -> None:
        self.client = RemoteGateway(
            live.base_url, live.worker_token(tenant), namespace=namespace, chunk_tokens=live.settings.chunk_tokens,
        )

    async def hold(self) -> None:
        """From now on, every request carries the capability held now: the client's retry with a
        fresh one after a 403 gets the same one again (a worker that cannot mint another)."""
        held = await self.client.capability()
        self.client.capability = lambda: _held(held)  # type: ignore[method-assign]

    async def store(self, model: Any, tokens: Sequence[int], kv: Any) -> StoreResult:
        return await self.client.store(model, tokens, kv, block_ids=BLOCKS)

    async def lookup(self, model: Any, tokens: Sequence[int]) -> LookupResult:
        return await self.client.lookup(model, tokens)

    async def retrieve(self, model: Any, tokens: Sequence[int], kv: Any) -> RetrieveResult:
        return await self.client.retrieve(model, tokens, kv, block_ids=BLOCKS)

    async def aclose(self) -> None:
        await self.client.aclose()


def _worker(mode: str, live: LiveServer, tenant: str, namespace: str = "default") -> Embedded | Remote:
    return Embedded(live, tenant, namespace) if mode == "embedded" else Remote(live, tenant, namespace)


async def _tenants(live: LiveServer, *names: str) -> list[str]:
    async with live.client() as http:
        return [await live.create_tenant(http, n) for n in names]


_audit_rows = live_rows  # the live server's audit events of one action


async def _tamper(live: LiveServer, tenant: str, model: Any, tokens: Sequence[int], index: int) -> None:
    """Flip one byte in the middle of chunk ``index``'s stored envelope, in the server's tiers (a
    tier that corrupts or swaps what it holds)."""
    gw, tiers = live.gateway, live.runtime.tiers

    async def flip() -> None:
        key = (await gw.keys_for(tenant, "default", model, tokens))[index]
        found = await tiers.get(key)
        blob = bytearray(found.data)
        blob[len(blob) // 2] ^= 0x01
        await tiers.delete(key)
        await tiers.put(key, memoryview(blob))

    await live.call(flip)


@pytest.mark.parametrize("mode", MODES)
async def test_a_hit_a_miss_and_another_tenant(live_server: LiveServer, mode: str):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    a, b = await _tenants(live, "acme", "globex")
    src = random_cache(g, NUM_BLOCKS, seed=11)
    tokens = list(range(700, 700 + N))
    wa, wb = _worker(mode, live, a), _worker(mode, live, b)
    try:
        assert (await wa.store(model, tokens, src)).stored == 3
        assert (await wa.lookup(model, tokens)).hit_tokens == N  # the hit
        dst = zero_cache(g, NUM_BLOCKS)
        got = await wa.retrieve(model, tokens, dst)
        assert (got.loaded_tokens, got.integrity_failures, got.reason) == (N, 0, "")
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        other = list(range(5000, 5000 + N))  # the miss
        assert (await wa.lookup(model, other)).hit_tokens == 0
        assert (await wa.retrieve(model, other, zero_cache(g, NUM_BLOCKS))).loaded_tokens == 0
        # another tenant on A's prompt: nothing, A's own hit above is the control
        assert (await wb.lookup(model, tokens)).hit_tokens == 0
        nothing = zero_cache(g, NUM_BLOCKS)
        assert (await wb.retrieve(model, tokens, nothing)).loaded_tokens == 0
        assert all(not t.any() for t in nothing)
    finally:
        await wa.aclose()
        await wb.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_a_tampered_envelope_is_audited_and_dropped_then_stored_again(live_server: LiveServer, mode: str):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=12)
    tokens = list(range(900, 900 + N))
    w = _worker(mode, live, a)
    try:
        await w.store(model, tokens, src)
        before = len(await _audit_rows(live, "integrity.failure"))
        await _tamper(live, a, model, tokens, 1)
        dst = zero_cache(g, NUM_BLOCKS)
        got = await w.retrieve(model, tokens, dst)
        assert (got.loaded_tokens, got.integrity_failures, got.reason) == (16, 1, "integrity")
        assert torch.equal(gathered(src, g, BLOCKS, 16), gathered(dst, g, BLOCKS, 16))  # chunk 0 authentic
        rows = (await _audit_rows(live, "integrity.failure"))[before:]
        assert len(rows) == 1, rows  # audited as integrity.failure in both modes, never as chunk.delete
        row = rows[0]
        assert row["tenant"] == a and row["outcome"] == "failure"
        assert row["details"]["dropped"] is True  # under the loading capability: no put op was needed
        assert (await w.lookup(model, tokens)).hit_tokens == 16  # the bad copy is gone
        # the recovery, and the requests after it: a recompute stores the chunk, loads are whole
        # chunk 1 again; chunk 2 was kept, and a remote worker's presence check is the prefix walk,
        # so it sends chunk 2 again too (stored over itself)
        assert (await w.store(model, tokens, src)).stored == (1 if mode == "embedded" else 2)
        for _ in range(2):
            again = zero_cache(g, NUM_BLOCKS)
            full = await w.retrieve(model, tokens, again)
            assert (full.loaded_tokens, full.integrity_failures) == (N, 0)
            assert torch.equal(gathered(src, g, BLOCKS, N), gathered(again, g, BLOCKS, N))
    finally:
        await w.aclose()


async def test_a_late_report_does_not_drop_a_good_copy_stored_since(live_server: LiveServer):
    """An attacker-controlled or late worker reports an envelope it got as inauthentic after a good
    copy replaced it: the server audits the report and keeps the good copy."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=13)
    tokens = list(range(1300, 1300 + N))
    w = Remote(live, a)
    try:
        await w.store(model, tokens, src)
        chunk = w.client._chunks(model, tokens)[0]
        await w.client._report_integrity_failure(chunk, b"\x00" * 32)  # not the stored envelope's digest
        assert (await w.lookup(model, tokens)).hit_tokens == N  # kept
        rows = await _audit_rows(live, "integrity.failure")
        assert len(rows) == 1 and rows[0]["tenant"] == a  # the report is audited
        assert rows[0]["details"]["dropped"] is False and "another envelope" in rows[0]["details"]["kept"]
    finally:
        await w.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_a_disabled_tenant_is_refused(live_server: LiveServer, mode: str):
    """A worker holding a capability minted before its tenant was disabled gets nothing more:
    the lookup is refused (AccessDenied) and a load puts nothing in the cache, in both modes."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=14)
    tokens = list(range(1700, 1700 + N))
    w = _worker(mode, live, a)
    try:
        assert (await w.store(model, tokens, src)).stored == 3  # the control: served before
        assert (await w.lookup(model, tokens)).hit_tokens == N
        if isinstance(w, Embedded):
            await w.hold()
        async with live.client() as http:
            r = await http.delete(f"/v1/admin/tenants/{a}", headers=live.headers(live.operator_token()))
        assert r.status_code == 200, r.text
        with pytest.raises(AccessDenied):
            await w.lookup(model, tokens)
        dst = zero_cache(g, NUM_BLOCKS)
        try:
            got = await w.retrieve(model, tokens, dst)
        except AccessDenied:
            pass
        else:
            assert got.loaded_tokens == 0
        assert all(not t.any() for t in dst)
    finally:
        await w.aclose()


async def _held(cap: str) -> str:
    return cap


def _stats(live: LiveServer) -> Any:
    """The server's counters: what its chunk service counts in either mode."""
    return live.runtime.metrics


async def _refused_or_nothing(w: Embedded | Remote, model: Any, tokens: Sequence[int]) -> None:
    """A load that is refused (AccessDenied) or ends before the first chunk, writing nothing."""
    g = small_geometry()
    dst = zero_cache(g, NUM_BLOCKS)
    try:
        got = await w.retrieve(model, tokens, dst)
    except AccessDenied:
        pass
    else:
        assert got.loaded_tokens == 0
    assert all(not t.any() for t in dst)


async def _whole(w: Embedded | Remote, model: Any, tokens: Sequence[int], src: Any) -> None:
    """The prompt's every chunk is stored and loads authentic (twice: the requests after)."""
    g = small_geometry()
    assert (await w.lookup(model, tokens)).hit_tokens == N
    for _ in range(2):
        dst = zero_cache(g, NUM_BLOCKS)
        got = await w.retrieve(model, tokens, dst)
        assert (got.loaded_tokens, got.integrity_failures, got.reason) == (N, 0, "")
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))


@pytest.mark.parametrize("mode", MODES)
async def test_a_revoked_capability_is_refused_and_a_fresh_one_served(live_server: LiveServer, mode: str):
    """A worker holding a capability revoked since (a secure clear of its tenant, through the
    admin API) is refused its lookups, stores and loads in both modes, each refusal counted; a
    worker of the same tenant with a fresh capability stores, looks up and loads (the control)."""
    live = live_server
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=15)
    tokens, other = list(range(2100, 2100 + N)), list(range(2300, 2300 + N))
    w, fresh = _worker(mode, live, a), _worker(mode, live, a)
    try:
        assert (await w.store(model, tokens, src)).stored == 3
        await w.hold()
        async with live.client() as http:
            r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200, r.text
        denials = _stats(live).denials
        with pytest.raises(AccessDenied):
            await w.lookup(model, tokens)
        with pytest.raises(AccessDenied):
            await w.store(model, other, src)
        await _refused_or_nothing(w, model, tokens)
        assert _stats(live).denials > denials + 1  # the server refused and counted each
        # the control: the same tenant with a fresh capability is served, and nothing of the
        # refused store is there
        assert (await fresh.lookup(model, other)).hit_tokens == 0
        assert (await fresh.store(model, tokens, src)).stored == 3
        await _whole(fresh, model, tokens, src)
    finally:
        await w.aclose()
        await fresh.aclose()


@pytest.fixture
def redis_tier(tmp_path: Path) -> Iterator[tuple[Server, LiveServer]]:
    """A live server whose only tier is a redis-server of this test's own (stopped by its pid),
    with short tier deadlines."""
    srv = Server()
    srv.start()
    try:
        with running_server(tmp_path / "state", tiers=["redis"], redis_url=srv.url, redis_prefix="kvgate-contract:",
                            tier_lookup_timeout_s=0.2, tier_read_timeout_s=0.2) as live:
            yield srv, live
    finally:
        srv.kill()


@contextmanager
def _paused(srv: Server) -> Iterator[None]:
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)


@pytest.mark.redis
@pytest.mark.parametrize("mode", MODES)
async def test_a_stalled_tier_is_a_tier_timeout_then_served_again(redis_tier: tuple[Server, LiveServer], mode: str):
    """The redis-server stops answering (SIGSTOP) past the tier's deadline: a lookup comes back
    short and a load ends on its first chunk as ``tier_timeout``, in both modes, counted by that
    reason; once it answers again (SIGCONT) the same prompt is whole again."""
    srv, live = redis_tier
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=16)
    tokens = list(range(2500, 2500 + N))
    w = _worker(mode, live, a)
    try:
        assert (await w.store(model, tokens, src)).stored == 3
        await _whole(w, model, tokens, src)  # the control
        stats = _stats(live)
        before = (stats.lookup_degraded["tier_timeout"], stats.load_failed["tier_timeout"])
        dst = zero_cache(g, NUM_BLOCKS)
        with _paused(srv):
            look = await w.lookup(model, tokens)
            got = await w.retrieve(model, tokens, dst)
        assert look.hit_tokens == 0 and look.degraded == "tier_timeout"  # the server says why, too
        assert (got.loaded_tokens, got.reason, got.integrity_failures) == (0, "tier_timeout", 0)
        assert all(not t.any() for t in dst)
        assert (stats.lookup_degraded["tier_timeout"], stats.load_failed["tier_timeout"]) == (before[0] + 1, before[1] + 1)
        await _whole(w, model, tokens, src)  # the recovery, and the requests after it
    finally:
        await w.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("mode", MODES)
async def test_a_tier_that_is_down_is_tier_unavailable_then_served_again(redis_tier: tuple[Server, LiveServer], mode: str):
    """The redis-server is killed: a lookup comes back short and a load ends as
    ``tier_unavailable`` (not a miss), in both modes, counted by that reason; a store stores
    nothing (in process its result says so, through the server it is a 503). Started again (empty), the tier takes the prompt again and serves it whole."""
    srv, live = redis_tier
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=17)
    tokens = list(range(2700, 2700 + N))
    w = _worker(mode, live, a)
    try:
        assert (await w.store(model, tokens, src)).stored == 3
        await _whole(w, model, tokens, src)  # the control
        stats = _stats(live)
        before = (stats.lookup_degraded["tier_unavailable"], stats.load_failed["tier_unavailable"], stats.load_failed["miss"])
        srv.kill()
        look = await w.lookup(model, tokens)
        dst = zero_cache(g, NUM_BLOCKS)
        got = await w.retrieve(model, tokens, dst)
        assert look.hit_tokens == 0 and look.degraded == "tier_unavailable"  # the server says why, too
        assert (got.loaded_tokens, got.reason, got.integrity_failures) == (0, "tier_unavailable", 0)
        assert all(not t.any() for t in dst)
        after = (stats.lookup_degraded["tier_unavailable"], stats.load_failed["tier_unavailable"], stats.load_failed["miss"])
        assert after == (before[0] + 1, before[1] + 1, before[2])
        stored = stats.chunks_stored
        try:  # nothing stored: in process a result that says so, through the server a 503
            assert (await w.store(model, list(range(2900, 2900 + N)), src)).stored == 0
        except RemoteUnavailable as exc:
            assert mode == "remote" and str(exc).endswith(": 503"), exc
        assert stats.chunks_stored == stored
        srv.start()  # the same port, nothing stored
        for _ in range(50):  # until the tier's breaker lets requests through again (a 503 till then)
            try:
                if (await w.store(model, tokens, src)).stored == 3:
                    break
            except RemoteUnavailable:
                pass
            await asyncio.sleep(0.2)
        await _whole(w, model, tokens, src)  # the recovery, and the requests after it
    finally:
        await w.aclose()


@pytest.fixture
def kms_behind_a_proxy(tmp_path: Path) -> Iterator[tuple[Any, LiveServer]]:
    """A live server whose KEK is in KMS (moto's server, a process of this test's own) reached
    through a TCP path the test cuts and restores; unwrapped data keys are kept 0.3 s."""
    import boto3

    with moto_server(tmp_path / "moto.log") as moto:
        u = urlsplit(moto.endpoint)
        assert u.hostname is not None and u.port is not None
        arn = boto3.client("kms", region_name="us-east-1", endpoint_url=moto.endpoint).create_key()["KeyMetadata"]["Arn"]
        with tcp_proxy(u.hostname, u.port) as path:
            kms = {"kek_provider": "kms", "kms_key_id": arn, "kms_region": "us-east-1",
                   "kms_endpoint_url": path.url_for("http"), "kek_cache_ttl_s": 0.3}
            with running_server(tmp_path / "state", **kms) as live:
                yield path, live


@pytest.mark.parametrize("mode", MODES)
async def test_a_kek_outage_loads_and_stores_nothing_then_both_are_served_again(kms_behind_a_proxy: Any, mode: str):
    """KMS out of reach once the data keys expired from memory: a load ends as
    ``key_unavailable`` and a store stores nothing, in both modes (the server answers a 503 of
    type keys-unavailable, which the worker makes what it is in process); a namespace whose keys
    were never unwrapped is a lookup miss with ``degraded`` ``key_unavailable``, nothing refused.
    Once KMS is reachable again, the stored prompt loads whole and the store that failed succeeds."""
    path, live = kms_behind_a_proxy
    g = small_geometry()
    model = model_for(g)
    (a,) = await _tenants(live, "acme")
    src = random_cache(g, NUM_BLOCKS, seed=18)
    tokens, other = list(range(3100, 3100 + N)), list(range(3300, 3300 + N))
    w, fresh = _worker(mode, live, a), _worker(mode, live, a, "fresh")
    try:
        assert (await w.store(model, tokens, src)).stored == 3
        await _whole(w, model, tokens, src)  # the control
        stats = _stats(live)
        stored, unavailable = stats.chunks_stored, stats.load_failed["key_unavailable"]
        path.cut()
        try:
            await asyncio.sleep(0.5)  # past the data keys' time in memory
            dst = zero_cache(g, NUM_BLOCKS)
            got = await w.retrieve(model, tokens, dst)
            assert (got.loaded_tokens, got.reason, got.integrity_failures) == (0, "key_unavailable", 0)
            assert all(not t.any() for t in dst)
            assert (await w.store(model, other, src)).stored == 0  # through the server: its 503, typed
            look = await fresh.lookup(model, tokens)
            assert (look.hit_tokens, look.degraded) == (0, "key_unavailable")
            assert stats.chunks_stored == stored
            assert stats.load_failed["key_unavailable"] == unavailable + 1
        finally:
            path.restore()
        await asyncio.sleep(1.2)  # past the KMS client's pause after a connection failure
        await _whole(w, model, tokens, src)  # the recovery, and the requests after it
        assert (await w.lookup(model, other)).hit_tokens == 0  # nothing of the failed store
        assert (await w.store(model, other, src)).stored == 3
        await _whole(w, model, other, src)
        assert (await fresh.lookup(model, tokens)).hit_tokens == 0  # its own namespace: opened now, empty
    finally:
        await w.aclose()
        await fresh.aclose()
