"""A remote store that races a secure clear, against a live server (Postgres registry and audit
log, a memory tier in front of a real Redis): the worker's sealing keys are issued, a clear of
its namespace (or tenant) bumps the epoch, then its upload arrives. Each item of the upload
names the storage key its sealing key came with, so the server refuses the batch whole (409
``urn:kvgate:problem:namespace-changed``), stores nothing and audits no ``integrity.failure``; the
worker counts a store that did not happen, and its next store seals under the new epoch. Each
race is forced (the clear runs between the keys and the upload) beside the same store with no
clear in between; an older worker's frame, which names no storage keys, is served as before."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from gateway.chunking import Chunk
from gateway.chunks import batches
from gateway.errors import NamespaceChanged
from gateway.protocol import frames
from gateway.remote.client import RemoteGateway
from tests.support import chunks
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import LiveServer, assert_problem, fake_envelope, random_hash, running_server

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

NUM_BLOCKS = 32
N = 16 * 3 + 5  # three full chunks (chunk_tokens=16 in the test settings) and a partial one
BLOCKS = list(range(14))
PROBLEM_TYPE = "urn:kvgate:problem:namespace-changed"


@pytest.fixture
def live(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_pg_url: str, redis_url: str, redis_prefix: str,
) -> Iterator[LiveServer]:
    tiers = getattr(request, "param", ["memory", "redis"])  # parametrized indirectly: other tiers
    with running_server(
        tmp_path / "state", fresh_pg_url, tiers=tiers, redis_url=redis_url, redis_prefix=redis_prefix,
    ) as server:
        yield server


class _ClearAfterKeys(RemoteGateway):
    """A worker whose next store runs ``clear`` right after its sealing keys came back, before a
    single envelope is sealed or sent: the race, forced."""

    clear: Callable[[], Awaitable[None]] | None = None

    async def session(self, token: str, op: str, chunks: Sequence[Chunk]) -> Any:
        session = await super().session(token, op, chunks)
        clear, self.clear = self.clear, None
        if op != "put" or clear is None:
            return session
        sealing_keys = session.sealing_keys

        async def keys_then_clear(indices: Sequence[int], sizes: Sequence[int] | None = None) -> Any:
            got = await sealing_keys(indices, sizes)
            await clear()
            return got

        session.sealing_keys = keys_then_clear  # type: ignore[method-assign]
        return session


def _clear(live: LiveServer, http: httpx.AsyncClient, tenant: str, namespace: str | None = "default") -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        body = {"scope": "namespace", "tenant": tenant, "namespace": namespace} if namespace else {"scope": "tenant", "tenant": tenant}
        r = await http.post("/v1/admin/clear", json=body, headers=live.headers(live.admin_token(tenant)))
        assert r.status_code == 200, r.text

    return run


async def _audited(live: LiveServer, http: httpx.AsyncClient, tenant: str) -> list[str]:
    await live.call(live.runtime.audit.flush, 10)
    r = await http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"},
                       headers=live.headers(live.admin_token(tenant)))
    assert r.status_code == 200, r.text
    return [row["action"] for row in map(json.loads, r.text.splitlines()) if "action" in row]


@pytest.mark.parametrize("scope", ["namespace", "tenant"])
async def test_a_store_that_races_a_clear_is_refused_whole_and_the_next_one_is_loadable(live: LiveServer, scope: str) -> None:
    g = small_geometry()
    model = model_for(g)
    src = random_cache(g, NUM_BLOCKS, seed=11)
    server = live.runtime.metrics
    async with live.client() as http:
        a = await live.create_tenant(http, "acme")
        async with _ClearAfterKeys(live.base_url, live.worker_token(a), chunk_tokens=live.settings.chunk_tokens) as ra:
            # positive control: the same store with no clear in between, stored whole and loadable
            calm = list(range(100, 100 + N))
            assert (await ra.store(model, calm, src, block_ids=BLOCKS)).stored == 4
            dst = zero_cache(g, NUM_BLOCKS)
            got = await ra.retrieve(model, calm, dst, block_ids=BLOCKS)
            assert (got.loaded_tokens, got.integrity_failures) == (N, 0)

            tokens = list(range(500, 500 + N))
            ra.clear = _clear(live, http, a, "default" if scope == "namespace" else None)
            refused = server.stores_namespace_changed
            res = await ra.store(model, tokens, src, block_ids=BLOCKS)
            assert ra.clear is None  # the clear ran between the keys and the upload
            if scope == "namespace":  # the capability stands: the upload meets the new epoch
                assert (res.chunks, res.stored, res.bytes_stored) == (4, 0, 0)
                assert ra.metrics.stores_namespace_changed == 1 and server.stores_namespace_changed == refused + 1
            else:  # the capability was revoked too: one more try with a fresh one and fresh keys
                assert (res.chunks, res.stored) == (4, 4)
            hashes = [c.chained_hash.hex() for c in ra._chunks(model, tokens)]
            hdr = live.headers(live.worker_token(a), await ra.capability())
            if scope == "namespace":
                assert await chunks.stored(http, hdr, hashes) == [False] * 4  # nothing landed under the new epoch
            dst = zero_cache(g, NUM_BLOCKS)
            got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)
            assert got.integrity_failures == 0  # a miss (or the retried store), never a false alarm
            assert got.loaded_tokens == (0 if scope == "namespace" else N)

            # the next store seals under the new epoch: stored and loadable, bit for bit
            again = await ra.store(model, tokens, src, block_ids=BLOCKS)
            assert again.stored + again.skipped == 4
            got = await ra.retrieve(model, tokens, dst, block_ids=BLOCKS)
            assert (got.loaded_tokens, got.integrity_failures) == (N, 0)
            assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        assert server.integrity_failures_reported == 0
        assert "integrity.failure" not in await _audited(live, http, a)


async def _seal_key(http: httpx.AsyncClient, hdr: dict[str, str], chunk_hash: str) -> bytes:
    r = await http.post("/v1/keys/envelopes", json={"purpose": "seal", "hashes": [chunk_hash]}, headers=hdr)
    assert r.status_code == 200, r.text
    return bytes.fromhex(r.json()["keys"][0]["storage_key"])


def _sealed_frame(items: Sequence[tuple[str, bytes, bytes]]) -> bytes:
    """A ``KVB2`` upload of ``(hash hex, storage key, envelope)`` items."""
    index = frames.encode_sealed_index([(bytes.fromhex(h), k, len(e)) for h, k, e in items])
    return index + b"".join(e for _h, _k, e in items)


async def test_the_upload_names_its_storage_keys_and_a_stale_one_is_a_409(live: LiveServer) -> None:
    """Through the route, frame by frame: a storage key of the epoch before a clear is a 409 of
    its problem type and stores nothing (the other items of the batch neither); the storage key of
    the epoch now is stored; a frame of an older worker (``KVB1``, no storage keys) is stored as
    before, unchecked."""
    env = fake_envelope()
    async with live.client() as http:
        a = await live.create_tenant(http, "acme")
        hdr = live.headers(live.worker_token(a), await live.capability(http, a))
        put = {**hdr, "Content-Type": chunks.BATCH}
        h_ok, h_stale, h_old = random_hash(), random_hash(), random_hash()
        k_ok_before, k_stale = await _seal_key(http, hdr, h_ok), await _seal_key(http, hdr, h_stale)
        # positive control: the key as issued, no clear in between
        r = await http.put("/v1/chunks", content=_sealed_frame([(h_ok, k_ok_before, env)]), headers=put)
        assert r.status_code == 204, r.text
        assert await chunks.stored(http, hdr, [h_ok]) == [True]

        await _clear(live, http, a)()
        k_ok = await _seal_key(http, hdr, h_ok)
        assert k_ok != k_ok_before  # a new epoch, new storage keys
        r = await http.put("/v1/chunks", content=_sealed_frame([(h_ok, k_ok, env), (h_stale, k_stale, env)]), headers=put)
        assert assert_problem(r, 409)["type"] == PROBLEM_TYPE
        assert await chunks.stored(http, hdr, [h_ok, h_stale]) == [False, False]  # refused whole
        r = await http.put("/v1/chunks", content=_sealed_frame([(h_ok, bytes(32), env)]), headers=put)
        assert assert_problem(r, 409)["type"] == PROBLEM_TYPE  # any key that is not the namespace's
        r = await http.put("/v1/chunks", content=_sealed_frame([(h_ok, k_ok, env)]), headers=put)
        assert r.status_code == 204, r.text
        assert await chunks.stored(http, hdr, [h_ok]) == [True]
        # an older worker's frame names no storage key: stored under the epoch of now, as before
        assert (await chunks.store(http, hdr, [(h_old, env)])).status_code == 204
        assert await chunks.stored(http, hdr, [h_old]) == [True]
        assert "integrity.failure" not in await _audited(live, http, a)


@pytest.mark.parametrize("live", [["redis"], ["memory", "redis"]], indirect=True, ids=["put", "reserved"])
async def test_a_clear_that_passes_while_a_batch_is_stored_takes_it_back(live: LiveServer) -> None:
    """The storage keys were the namespace's when the batch was opened and checked; a clear runs
    before it is committed (its deletion passes before the envelopes land): the commit finds the
    epoch moved on, removes what it stored from every tier and refuses it, where without the check
    ciphertext would stay in the tiers after a clear that was acknowledged to remove it. Both ways
    a batch is stored: put into tiers that hand out no extents, and into a reserved extent of the
    memory tier (which the clear cancels)."""
    env = fake_envelope()
    runtime = live.runtime
    async with live.client() as http:
        a = await live.create_tenant(http, "acme")
        cap = await live.capability(http, a)
        hdr = live.headers(live.worker_token(a), cap)
        h_calm, h_raced = random_hash(), random_hash()
        keys = {h: await _seal_key(http, hdr, h) for h in (h_calm, h_raced)}

        async def commit(h: str, clear_first: bool) -> tuple[str, list[list[str]]]:
            """Open, fill and commit a one-envelope batch on the server's loop (a clear of the
            namespace in between where ``clear_first``); what happened, and where the envelope's
            storage key is held afterwards."""
            batch = await batches.open_upload(state.plane, cap, [(bytes.fromhex(h), len(env))], [keys[h].hex()])
            batch.views[0][:] = env
            if clear_first:
                await runtime.admin.clear(a, "default")
            try:
                await batch.commit()
                outcome = "stored"
            except NamespaceChanged:
                outcome = "refused"
            key = runtime.resolver.chunk_key_of_labels(a, runtime.resolver.group_label(a, "default"), keys[h].hex())
            held, errors = await runtime.tiers.locate_many([key])
            assert not errors
            return outcome, [list(w) for w in held]

        state = live.state
        tiers = list(live.settings.tiers)
        assert await live.call(commit, h_calm, False) == ("stored", [tiers])  # positive control
        refused = runtime.metrics.stores_namespace_changed
        assert await live.call(commit, h_raced, True) == ("refused", [[]])
        assert runtime.metrics.stores_namespace_changed == refused + 1
        assert "integrity.failure" not in await _audited(live, http, a)
