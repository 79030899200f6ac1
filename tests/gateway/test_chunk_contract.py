"""One tier side, two modes: the same requests through the core in process (embedded mode) and
through a live ``kvgate serve`` from a remote worker end the same way, because both go through
``gateway.chunks.ChunkService``: a hit, a miss, another tenant's prompt, a disabled tenant, and
an envelope tampered with in the tier (``integrity.failure`` audited in both, the bad copy
dropped under the loading capability, and the next store and load whole again)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from gateway.errors import AccessDenied
from gateway.remote.client import RemoteGateway
from gateway.types import LookupResult, RetrieveResult, StoreResult
from tests.support import server_fixture
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import ALL_OPS, LiveServer

live_server = server_fixture.live_server  # a fixture, registered in this module

NUM_BLOCKS = 32
N = 16 * 3  # three chunks of 16 tokens (the test server's chunk size)
BLOCKS = list(range(12))
MODES = ["embedded", "remote"]


class Embedded:
    """The core of the live server's process, called as an embedded worker calls its own."""

    def __init__(self, live: LiveServer, tenant: str) -> None:
        self.live, self.tenant, self.gw = live, tenant, live.gateway

    async def _cap(self) -> str:
        return await self.live.call(self.gw.mint_capability, self.tenant, "default", ALL_OPS, 600)

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

    def __init__(self, live: LiveServer, tenant: str) -> None:
        self.client = RemoteGateway(live.base_url, live.worker_token(tenant), chunk_tokens=live.settings.chunk_tokens)

    async def store(self, model: Any, tokens: Sequence[int], kv: Any) -> StoreResult:
        return await self.client.store(model, tokens, kv, block_ids=BLOCKS)

    async def lookup(self, model: Any, tokens: Sequence[int]) -> LookupResult:
        return await self.client.lookup(model, tokens)

    async def retrieve(self, model: Any, tokens: Sequence[int], kv: Any) -> RetrieveResult:
        return await self.client.retrieve(model, tokens, kv, block_ids=BLOCKS)

    async def aclose(self) -> None:
        await self.client.aclose()


def _worker(mode: str, live: LiveServer, tenant: str) -> Embedded | Remote:
    return Embedded(live, tenant) if mode == "embedded" else Remote(live, tenant)


async def _tenants(live: LiveServer, *names: str) -> list[str]:
    async with live.client() as http:
        return [await live.create_tenant(http, n) for n in names]


async def _audit_rows(live: LiveServer, action: str) -> list[dict[str, Any]]:
    """The audit log's events of ``action``, read from the server's database (after a flush)."""
    from audit.db import create_audit_engine
    from audit.store import AuditStore

    await live.call(live.runtime.audit.flush, 10)
    engine = create_audit_engine(live.settings.db_url)
    try:
        out = []
        async for rec in AuditStore(engine).iter_records():
            e = rec.event
            if e.action == action:
                details = json.loads(e.details) if isinstance(e.details, str) else dict(e.details)
                out.append({"tenant": e.target.tenant, "outcome": e.outcome, "details": details})
        return out
    finally:
        await engine.dispose()


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
            held = await w._cap()
            w._cap = lambda: _held(held)  # type: ignore[method-assign]  # the capability it holds
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
