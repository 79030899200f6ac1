"""The chunk service (gateway/chunks/service.py), directly, over a memory tier and real Redis
tiers that are stalled (a redis-server of the test's own, SIGSTOP'd) or down (nothing listening):
the prefix walk and why it came back short, a fetch and why it failed, the store path (reserve,
commit, abort, put) and the rollback of a refused batch, an integrity failure audited with the
bad copy dropped (never a good one), and a tenant gone refused; each beside its positive control."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.chunks.service import ChunkService, FetchFailed, NamespaceChunks
from gateway.errors import AccessDenied
from gateway.services.runtime import Runtime
from storage.base import Tier
from storage.manager import TierManager
from storage.memory import MemoryTier
from storage.redis import RedisTier
from storage.types import TierTimeout, TierUnavailable
from tests.support.gw import ALL_OPS, gateway_runtime
from tests.support.redis_server import Server
from tests.support.services import free_port

HASHES = [hashlib.sha256(b"chunk %d" % i).digest() for i in range(3)]
ENVELOPE = memoryview(b"an envelope, opaque to the tiers " * 8)


@dataclass
class World:
    rt: Runtime
    make: Any  # tiers -> ChunkService over the runtime's access, namespaces and audit log

    async def opened(self, chunks: ChunkService, tenant: str = "acme", op: str = "put",
                     hashes: Sequence[bytes] = HASHES) -> NamespaceChunks:
        token = await self.rt.access.mint(tenant, "default", ALL_OPS, 600)
        return await chunks.session(token, op, hashes)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with gateway_runtime(tmp_path / "state", tiers=["memory"]) as rt:
        await rt.admin.create_tenant("acme")
        await rt.admin.create_tenant("globex")
        managers: list[TierManager] = []

        def make(*tiers: Tier) -> ChunkService:
            managers.append(TierManager(list(tiers), promote=False))
            return ChunkService(access=rt.access, resolver=rt.resolver, tiers=managers[-1], audit=rt.audit, metrics=rt.metrics)

        yield World(rt, make)
        for m in managers:
            await m.aclose()


def _memory() -> MemoryTier:
    return MemoryTier(8 << 20)


def _down() -> RedisTier:
    """A Redis tier nothing listens behind: every call fails at once (connection refused)."""
    return RedisTier(f"redis://127.0.0.1:{free_port()}/0", prefix="kvgate-svc:", breaker_failures=1000)


def _stalled(srv: Server) -> RedisTier:
    return RedisTier(srv.url, prefix="kvgate-svc:", op_timeout_s=0.1, read_timeout_s=0.1, breaker_failures=1000)


def _pause(srv: Server, stop: bool) -> None:
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)


async def _events(rt: Runtime, action: str) -> list[dict[str, Any]]:
    await rt.audit.flush(10)
    return [json.loads(r.event.details) async for r in rt.audit.store.iter_records() if r.event.action == action]


# -- the prefix walk --------------------------------------------------------------------------
async def test_locate_walks_the_prefix_in_the_namespace_of_the_capability(world: World) -> None:
    chunks = world.make(_memory())
    acme = await world.opened(chunks)
    for i in (0, 1):
        await acme.put(i, ENVELOPE)
    found = await acme.locate()
    assert (found.present, found.hits, found.degraded) == ([True, True, False], 2, "")
    where = await acme.locate(where=True)
    assert (where.hits, where.locations[:2]) == (2, [["memory"], ["memory"]])
    # another tenant asking for the same chained hashes reaches other storage keys: nothing
    globex = await world.opened(chunks, "globex", "lookup")
    assert set(globex.keys).isdisjoint(acme.keys)
    assert (await globex.locate()).present == [False, False, False]


async def test_a_walk_cut_short_by_a_tier_that_cannot_answer_says_why(world: World) -> None:
    chunks = world.make(_memory(), _down())
    acme = await world.opened(chunks)
    for i in (0, 1):
        await acme.put(i, ENVELOPE)  # the memory tier takes it; the Redis tier is down
    for where in (False, True):
        found = await acme.locate(where=where)
        assert (found.hits, found.degraded) == (2, "tier_unavailable")  # the down tier may hold chunk 2
        assert all(isinstance(e, TierUnavailable) for e in found.errors) and found.errors
    await acme.put(2, ENVELOPE)
    whole = await acme.locate(where=True)
    assert (whole.hits, whole.degraded) == (3, "")  # not short: nothing to explain


# -- fetch and its reasons --------------------------------------------------------------------
async def test_fetch_finds_a_chunk_and_names_a_miss(world: World) -> None:
    chunks = world.make(_memory())
    acme = await world.opened(chunks)
    await acme.put(0, ENVELOPE)
    got = await acme.fetch(0)
    assert (bytes(got.chunk.data), got.chunk.tier, got.passed_over) == (bytes(ENVELOPE), "memory", [])
    with pytest.raises(FetchFailed) as info:
        await acme.fetch(1)
    assert (info.value.reason, info.value.unavailable) == ("miss", False)


async def test_a_miss_behind_a_tier_that_is_down_is_tier_unavailable_and_a_hit_past_it_is_passed_over(world: World) -> None:
    behind = world.make(_memory(), _down())
    acme = await world.opened(behind)
    with pytest.raises(FetchFailed) as info:
        await acme.fetch(0)
    assert info.value.reason == "tier_unavailable"  # not a miss: the down tier may hold it
    in_front = world.make(_down(), _memory())
    acme = await world.opened(in_front)
    await acme.put(0, ENVELOPE)
    got = await acme.fetch(0)  # served by the slower tier; the failed faster one is reported
    assert got.chunk.tier == "memory" and [type(e) for e in got.passed_over] == [TierUnavailable]


@pytest.mark.redis
async def test_a_stalled_tier_is_tier_timeout_and_served_once_it_answers(world: World, server: Server) -> None:
    chunks = world.make(_stalled(server))
    acme = await world.opened(chunks)
    await acme.put(0, ENVELOPE)
    assert bytes((await acme.fetch(0)).chunk.data) == bytes(ENVELOPE)  # the control
    _pause(server, True)
    try:
        with pytest.raises(FetchFailed) as info:
            await acme.fetch(0)
        found = await acme.locate()
    finally:
        _pause(server, False)
    assert info.value.reason == "tier_timeout"
    assert (found.hits, found.degraded) == (0, "tier_timeout") and isinstance(found.errors[0], TierTimeout)
    assert bytes((await acme.fetch(0)).chunk.data) == bytes(ENVELOPE)  # answering again


# -- the store path ---------------------------------------------------------------------------
async def test_a_reserved_extent_is_stored_on_commit_and_nothing_on_abort(world: World) -> None:
    chunks = world.make(_memory())
    acme = await world.opened(chunks)
    slot = acme.reserve(0, ENVELOPE.nbytes)
    assert slot is not None
    slot.view[:] = ENVELOPE
    assert await acme.commit(slot) == ["memory"]
    aborted = acme.reserve(1, ENVELOPE.nbytes)
    assert aborted is not None
    aborted.view[:] = ENVELOPE
    acme.abort(aborted)
    assert (await acme.locate()).present == [True, False, False]
    assert acme.reserve(2, 64 << 20) is None  # no room: the caller seals into a buffer and puts


async def test_a_tier_without_extents_hands_none_out(world: World) -> None:
    acme = await world.opened(world.make(_down()))
    assert acme.reserve(0, ENVELOPE.nbytes) is None


async def test_roll_back_removes_a_refused_batch_and_counts_what_a_down_tier_may_keep(world: World) -> None:
    chunks = world.make(_memory())
    acme = await world.opened(chunks)
    for i in range(3):
        await acme.put(i, ENVELOPE)
    removed, left = world.rt.metrics.store_rollback_removed, world.rt.metrics.store_rollback_left
    assert await acme.roll_back(range(2)) == 0
    assert (await acme.locate()).present == [False, False, True]  # only the batch's chunks
    assert (world.rt.metrics.store_rollback_removed, world.rt.metrics.store_rollback_left) == (removed + 2, left)
    with_down = world.make(_memory(), _down())
    acme = await world.opened(with_down)
    await acme.put(0, ENVELOPE)
    assert await acme.roll_back([0]) == 1  # the down tier could not be asked: it may hold a copy
    assert (world.rt.metrics.store_rollback_removed, world.rt.metrics.store_rollback_left) == (removed + 2, left + 1)
    assert (await acme.locate()).present[0] is False  # gone from the tier that answered


# -- integrity failures -----------------------------------------------------------------------
async def test_an_integrity_failure_is_audited_and_drops_only_the_bad_copy(world: World) -> None:
    chunks = world.make(_memory())
    acme = await world.opened(chunks, op="get")
    await acme.put(0, ENVELOPE)
    await acme.put(1, ENVELOPE)
    reported = world.rt.metrics.integrity_failures_reported
    other = hashlib.sha256(b"another envelope").digest()
    assert await acme.integrity_failure(1, envelope_sha256=other) is False  # a good copy stored since
    assert await acme.integrity_failure(0, tier="memory", index=0,
                                        envelope_sha256=hashlib.sha256(ENVELOPE).digest()) is True
    assert await acme.integrity_failure(2, envelope_sha256=other) is False  # nothing stored
    assert (await acme.locate()).present == [False, True, False]
    events = await _events(world.rt, "integrity.failure")
    assert [(e["dropped"], e.get("kept"), e.get("chunk_index")) for e in events] == [
        (False, "the stored copy is another envelope", None), (True, None, 0), (False, "no copy is stored", None),
    ]
    assert world.rt.metrics.integrity_failures_reported == reported + 3


# -- the namespace ----------------------------------------------------------------------------
async def test_a_disabled_tenant_is_refused_and_counted(world: World) -> None:
    chunks = world.make(_memory())
    token = await world.rt.access.mint("acme", "default", ALL_OPS, 600)
    assert len((await chunks.session(token, "lookup", HASHES)).keys) == 3  # the control
    await world.rt.registry.disable_tenant("acme")
    world.rt.resolver.forget("acme")
    denials = world.rt.metrics.denials
    with pytest.raises(AccessDenied):
        await chunks.session(token, "lookup", HASHES)
    assert world.rt.metrics.denials == denials + 1
    other = await world.rt.access.mint("globex", "default", ALL_OPS, 600)
    assert len((await chunks.session(other, "lookup", HASHES)).keys) == 3  # another tenant unaffected


async def test_a_capability_is_checked_for_the_operation_and_every_chunk(world: World) -> None:
    chunks = world.make(_memory())
    lookup_only = await world.rt.access.mint("acme", "default", ["lookup"], 600)
    assert (await chunks.session(lookup_only, "lookup", HASHES)).cap.tenant == "acme"  # the control
    with pytest.raises(AccessDenied):
        await chunks.session(lookup_only, "put", HASHES)
