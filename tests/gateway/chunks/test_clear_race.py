"""A store that races a secure clear, in process (embedded mode), on a Postgres registry and a
memory tier in front of a real Redis: the store's storage keys are computed when its session
opens, the clear bumps the namespace's epoch and deletes its chunks, then the store's chunks
land under the old epoch's keys, where nothing can load them and the clear was acknowledged to
have removed everything. The chunk service checks the epoch once a store's chunks are in
(``NamespaceChunks.confirm``) and removes them: ``NamespaceChanged``, a store that did not
happen, never an ``integrity.failure``. Each race is forced (the clear runs between the session's
keys and its writes) beside the same store with no clear in between."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.chunking import Chunk
from gateway.datapath.stores import TierStore
from gateway.errors import NamespaceChanged
from gateway.services.runtime import EmbeddedRuntime
from storage.types import ChunkKey
from tests.support.gw import ALL_OPS, gateway_runtime, gathered, model_for, random_cache, small_geometry, zero_cache

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

HASHES = [hashlib.sha256(b"race %d" % i).digest() for i in range(3)]
ENVELOPE = b"an envelope, opaque to the tiers " * 8
NUM_BLOCKS = 32
N = 16 * 3 + 5  # three full chunks (chunk_tokens=16) and a partial one
BLOCKS = list(range(14))


@pytest.fixture
async def rt(tmp_path: Path, fresh_pg_url: str, redis_url: str, redis_prefix: str) -> AsyncIterator[EmbeddedRuntime]:
    async with gateway_runtime(
        tmp_path / "state", fresh_pg_url, tiers=["memory", "redis"], redis_url=redis_url, redis_prefix=redis_prefix,
    ) as runtime:
        await runtime.admin.create_tenant("acme")
        yield runtime


async def _token(rt: EmbeddedRuntime) -> str:
    return await rt.access.mint("acme", "default", ALL_OPS, 600)


async def _held(rt: EmbeddedRuntime, keys: Sequence[ChunkKey]) -> list[list[str]]:
    """The tiers that hold each key (every tier asked)."""
    locations, errors = await rt.tiers.locate_many(list(keys))
    assert not errors
    return [list(w) for w in locations]


async def _actions(rt: EmbeddedRuntime) -> list[str]:
    await rt.audit.flush(10)
    return [r.event.action async for r in rt.audit.store.iter_records()]


async def test_chunks_that_land_after_a_clear_are_removed_and_the_store_refused(rt: EmbeddedRuntime) -> None:
    token = await _token(rt)
    # positive control: no clear in between, the chunks stay
    calm = await rt.chunks.session(token, "put", HASHES)
    await calm.put(0, memoryview(ENVELOPE))
    await calm.confirm()
    assert all(await _held(rt, calm.keys[:1]))

    raced = await rt.chunks.session(token, "put", HASHES)  # storage keys of the current epoch
    done = await rt.admin.clear("acme", "default")  # epoch bumped, the namespace's chunks deleted
    assert done.epochs == {"default": raced.ns.epoch + 1}
    assert not any(await _held(rt, calm.keys[:1]))  # the control's chunk went with the clear
    slot = raced.reserve(0, len(ENVELOPE))
    assert slot is not None
    slot.view[:] = ENVELOPE
    assert await raced.commit(slot) == ["memory"]
    await raced.put(1, memoryview(ENVELOPE))
    # without the check these would stay: under keys nothing can derive any more, after a clear
    # that said the namespace's chunks are gone
    assert all(await _held(rt, raced.keys[:2]))
    removed = rt.metrics.store_rollback_removed
    with pytest.raises(NamespaceChanged):
        await raced.confirm()
    assert not any(await _held(rt, raced.keys))
    assert rt.metrics.store_rollback_removed == removed + 2

    # the next store opens under the new epoch: stored, and it stays
    fresh = await rt.chunks.session(token, "put", HASHES)
    assert fresh.ns.epoch == raced.ns.epoch + 1 and fresh.keys[0] != raced.keys[0]
    await fresh.put(0, memoryview(ENVELOPE))
    await fresh.confirm()
    assert all(await _held(rt, fresh.keys[:1]))
    assert "integrity.failure" not in await _actions(rt)


async def test_a_tenant_clear_between_a_sessions_keys_and_its_writes_is_caught_too(rt: EmbeddedRuntime) -> None:
    raced = await rt.chunks.session(await _token(rt), "put", HASHES)
    await rt.admin.clear("acme")  # every namespace's epoch bumped, keys destroyed, capabilities revoked
    await raced.put(0, memoryview(ENVELOPE))
    with pytest.raises(NamespaceChanged):
        await raced.confirm()
    assert not any(await _held(rt, raced.keys))


@dataclass
class _ClearAfterKeys:
    """The process's own ``TierStore``, whose next store runs ``clear`` right after its sealing
    keys were handed out (before a single envelope is sealed or written): the race, forced. The
    store's storage keys are kept in ``keys``."""

    inner: TierStore
    clear: Callable[[], Awaitable[Any]] | None
    keys: list[ChunkKey] | None = None

    async def session(self, token: str, op: str, chunks: Sequence[Chunk]) -> Any:
        session = await self.inner.session(token, op, chunks)
        clear = self.clear
        if op != "put" or clear is None:
            return session
        self.clear, self.keys = None, list(session.opened.keys)
        sealing_keys = session.sealing_keys

        async def keys_then_clear(indices: Sequence[int], sizes: Sequence[int] | None = None) -> Any:
            got = await sealing_keys(indices, sizes)
            await clear()
            return got

        session.sealing_keys = keys_then_clear
        return session


async def test_a_store_that_races_a_clear_stores_nothing_and_the_next_one_is_loadable(rt: EmbeddedRuntime) -> None:
    g = small_geometry()
    model = model_for(g)
    gw = rt.gateway
    token = await _token(rt)
    src = random_cache(g, NUM_BLOCKS, seed=7)

    # positive control: the same store with no clear in between is stored whole and loads back
    calm = list(range(100, 100 + N))
    control = _ClearAfterKeys(gw.store_, None)
    assert (await gw.plane.store(control, token, model, calm, src, block_ids=BLOCKS)).stored == 4
    dst = zero_cache(g, NUM_BLOCKS)
    got = await gw.retrieve(token, model, calm, dst, block_ids=BLOCKS)
    assert (got.loaded_tokens, got.integrity_failures) == (N, 0)

    tokens = list(range(500, 500 + N))
    racing = _ClearAfterKeys(gw.store_, lambda: rt.admin.clear("acme", "default"))
    failures = rt.metrics.store_failures
    res = await gw.plane.store(racing, token, model, tokens, src, block_ids=BLOCKS)
    assert (res.chunks, res.stored, res.bytes_stored) == (4, 0, 0)
    assert rt.metrics.stores_namespace_changed == 1 and rt.metrics.store_failures == failures + 4
    assert racing.keys is not None and not any(await _held(rt, racing.keys))  # nothing under the old epoch
    dst = zero_cache(g, NUM_BLOCKS)
    got = await gw.retrieve(token, model, tokens, dst, block_ids=BLOCKS)
    assert (got.loaded_tokens, got.integrity_failures) == (0, 0)  # a miss, not a false alarm
    assert all(not t.any() for t in dst)

    # the next store seals under the new epoch: stored and loadable, bit for bit
    again = await gw.store(token, model, tokens, src, block_ids=BLOCKS)
    assert (again.stored, again.skipped) == (4, 0)
    got = await gw.retrieve(token, model, tokens, dst, block_ids=BLOCKS)
    assert (got.loaded_tokens, got.integrity_failures) == (N, 0)
    assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
    assert rt.metrics.integrity_failures == 0 and rt.metrics.stores_namespace_changed == 1
    assert "integrity.failure" not in await _actions(rt)
