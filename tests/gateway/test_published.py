"""Published prefixes through a live ``kvgate serve`` (Postgres registry; memory, disk and Redis
tiers), read by embedded and remote workers alike: a member hits the published chunks and an
outsider misses; a member never reads another member's private suffix; a prompt that differs in
the last token of a chunk reads nothing of the scope; a member, with its own capability or a
forged or stolen one, cannot write, overwrite, drop, pin or clear a scope's chunks through any
route, and the next load is the published bytes; a revoke leaves every member missing and no
ciphertext of the scope in any tier; a tenant clear leaves the scope whole; a tenant removed
from the scope or disabled misses."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch

from gateway.errors import AccessDenied
from gateway.remote.client import RemoteGateway
from gateway.types import LookupResult, RetrieveResult, StoreResult
from tenancy.capabilities import CapabilityAuthority, read_unverified
from tenancy.sharing import SCOPE_NAMESPACE, scope_owner
from tests.support.audit_events import live_rows
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import ALL_OPS, LiveServer, running_server, scratch_pg_database
from tests.support.services import REDIS_URL, _need

NUM_BLOCKS = 32
BLOCKS = list(range(12))  # 48 tokens of 4-token blocks: three chunks of 16 (the server's chunk size)
MODES = ["embedded", "remote"]
PREFIX_TOKENS = 40  # two whole chunks are published; the 8 tokens after them are not


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    _need("Redis", REDIS_URL, 6379)
    prefix = f"kvgate-test:{os.getpid()}:{secrets.token_hex(4)}:"
    state = tmp_path_factory.mktemp("kvgate-published")
    try:
        with scratch_pg_database() as url, running_server(
            state, url, tiers=["memory", "disk", "redis"], redis_url=REDIS_URL, redis_prefix=prefix,
        ) as server:
            yield server
    finally:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.unlink(key)
        client.close()


async def _held(token: str) -> str:
    return token


class Embedded:
    """The core of the live server's process, as an embedded worker of ``tenant`` calls it."""

    def __init__(self, live: LiveServer, tenant: str, capability: str | None = None) -> None:
        self.live, self.tenant, self.held = live, tenant, capability

    async def cap(self) -> str:
        if self.held is not None:
            return self.held
        return await self.live.call(self.live.gateway.mint_capability, self.tenant, "default", ALL_OPS, 600)

    async def store(self, model: Any, tokens: Sequence[int], kv: Any, **kw: Any) -> StoreResult:
        return await self.live.call(self.live.gateway.store, await self.cap(), model, tokens, kv, block_ids=BLOCKS, **kw)

    async def lookup(self, model: Any, tokens: Sequence[int]) -> LookupResult:
        return await self.live.call(self.live.gateway.lookup, await self.cap(), model, tokens)

    async def retrieve(self, model: Any, tokens: Sequence[int], kv: Any) -> RetrieveResult:
        return await self.live.call(self.live.gateway.retrieve, await self.cap(), model, tokens, kv, block_ids=BLOCKS)

    async def aclose(self) -> None:
        return None


class Remote:
    """A remote worker of ``tenant`` (``bearer``'s principal) against the live server; with
    ``capability`` it holds that one and mints none."""

    def __init__(self, live: LiveServer, tenant: str, capability: str | None = None, bearer: str | None = None) -> None:
        self.client = RemoteGateway(
            live.base_url, bearer or live.worker_token(tenant), chunk_tokens=live.settings.chunk_tokens,
        )
        if capability is not None:
            self.client.capability = lambda: _held(capability)  # type: ignore[method-assign]

    async def store(self, model: Any, tokens: Sequence[int], kv: Any, **kw: Any) -> StoreResult:
        return await self.client.store(model, tokens, kv, block_ids=BLOCKS, **kw)

    async def lookup(self, model: Any, tokens: Sequence[int]) -> LookupResult:
        return await self.client.lookup(model, tokens)

    async def retrieve(self, model: Any, tokens: Sequence[int], kv: Any) -> RetrieveResult:
        return await self.client.retrieve(model, tokens, kv, block_ids=BLOCKS)

    async def aclose(self) -> None:
        await self.client.aclose()


def _worker(mode: str, live: LiveServer, tenant: str) -> Embedded | Remote:
    return Embedded(live, tenant) if mode == "embedded" else Remote(live, tenant)


class Published:
    """A scope of fresh member tenants and a fresh outsider, a prefix published into it and
    warmed by a worker of ``mode`` holding the publish answer's capability."""

    def __init__(self, live: LiveServer, http: httpx.AsyncClient, model: Any, members: int = 2) -> None:
        self.live, self.http, self.model = live, http, model
        self.op = live.headers(live.operator_token())
        self.scope = f"s-{secrets.token_hex(4)}"
        self.members = [f"m{k}-{secrets.token_hex(3)}" for k in range(members)]
        self.outsider = f"out-{secrets.token_hex(3)}"
        base = int.from_bytes(os.urandom(2), "little") * 64
        self.prefix = list(range(base, base + PREFIX_TOKENS))
        self.src = random_cache(model_geometry(model), NUM_BLOCKS, seed=base % 1000)
        self.id = ""
        self.capability = ""

    async def setup(self, mode: str) -> None:
        for t in [*self.members, self.outsider]:
            await self.live.create_tenant(self.http, t)
        r = await self.http.post("/v1/admin/scopes", json={"name": self.scope, "members": self.members}, headers=self.op)
        assert r.status_code == 201, r.text
        r = await self.http.post(
            "/v1/admin/prefixes", json={"scope": self.scope, "model": self.model.name, "token_ids": self.prefix},
            headers=self.op,
        )
        assert r.status_code == 201, r.text
        got = r.json()
        assert got["whole_chunks"] == 2 and got["digest"] == hashlib.sha256(
            b"".join(t.to_bytes(4, "little") for t in self.prefix)).hexdigest()
        self.id, self.capability = got["id"], got["capability"]
        r = await self.http.post(
            f"/v1/admin/prefixes/{self.id}/chunks", json={"fingerprint": self.model.fingerprint_digest, "hashes": self.hashes()},
            headers=self.live.headers(self.live.operator_token(), self.capability),
        )
        assert r.status_code == 200 and r.json()["recorded"] == 2, r.text
        # the warm-up: a worker holding the scope's write capability, its ordinary store path
        warm: Embedded | Remote = (
            Embedded(self.live, scope_owner(self.scope), self.capability) if mode == "embedded"
            else Remote(self.live, "platform", self.capability, bearer=self.live.operator_token())
        )
        try:
            assert (await warm.store(self.model, self.prefix[:32], self.src)).stored == 2
        finally:
            await warm.aclose()
        await self.live.call(self.live.runtime.tiers.flush)

    def hashes(self, tokens: Sequence[int] | None = None) -> list[str]:
        chunks = self.live.gateway.plane.chunks(self.model, tokens or self.prefix)
        return [c.chained_hash.hex() for c in chunks if c.num_tokens == 16]

    async def scope_copies(self) -> int:
        """Envelopes of the scope's owner held by any tier (its owner label)."""
        rt = self.live.runtime

        async def count() -> int:
            await rt.tiers.flush()
            owner = rt.resolver.owner_label(scope_owner(self.scope))
            n = 0
            for tier in rt.tiers.tiers:
                n += sum(1 for k in await tier.list_keys() if k.owner == owner)
            return n

        return await self.live.call(count)

    def prompt(self, suffix_start: int) -> list[int]:
        return self.prefix[:32] + list(range(suffix_start, suffix_start + 16))


def model_geometry(model: Any) -> Any:
    return model.geometry


_audit = live_rows  # the live server's audit events of one action


def _same(a: list[torch.Tensor], b: list[torch.Tensor], model: Any, tokens: int) -> bool:
    g = model.geometry
    return torch.equal(gathered(a, g, BLOCKS, tokens), gathered(b, g, BLOCKS, tokens))


@pytest.mark.parametrize("mode", MODES)
async def test_published_prefix_member_hits_outsider_misses_never_a_private_suffix(live: LiveServer, mode: str):
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model)
        await pub.setup(mode)
        a, b = pub.members
        wa, wb, wc = _worker(mode, live, a), _worker(mode, live, b), _worker(mode, live, pub.outsider)
        try:
            prompt_a = pub.prompt(60_000)
            # a member's first request: the published chunks, the publisher's bytes
            assert (await wa.lookup(model, prompt_a)).hit_tokens == 32
            dst = zero_cache(model.geometry, NUM_BLOCKS)
            got = await wa.retrieve(model, prompt_a, dst)
            assert (got.loaded_tokens, got.integrity_failures) == (32, 0)
            assert _same(dst, pub.src, model, 32)
            # the outsider, on the same prompt: nothing
            assert (await wc.lookup(model, prompt_a)).hit_tokens == 0
            nothing = zero_cache(model.geometry, NUM_BLOCKS)
            assert (await wc.retrieve(model, prompt_a, nothing)).loaded_tokens == 0
            assert all(not t.any() for t in nothing)
            # A stores its private suffix: the published chunks are skipped, the suffix is A's
            own_a = random_cache(model.geometry, NUM_BLOCKS, seed=77)
            stored = await wa.store(model, prompt_a, own_a)
            assert (stored.stored, stored.skipped) == (1, 2)
            assert (await wa.lookup(model, prompt_a)).hit_tokens == 48  # positive control: A's own suffix
            # B asks the prefix and A's suffix tokens: the prefix only, never A's suffix
            assert (await wb.lookup(model, prompt_a)).hit_tokens == 32
            dst_b = zero_cache(model.geometry, NUM_BLOCKS)
            got_b = await wb.retrieve(model, prompt_a, dst_b)
            assert got_b.loaded_tokens == 32 and _same(dst_b, pub.src, model, 32)
            assert not gathered(dst_b, model.geometry, BLOCKS[8:], 16).any()  # A's suffix: not loaded
            # negative control: the last token of the first chunk differs: nothing of the scope
            off = list(prompt_a)
            off[15] += 1
            assert (await wa.lookup(model, off)).hit_tokens == 0
            assert (await wa.retrieve(model, off, zero_cache(model.geometry, NUM_BLOCKS))).loaded_tokens == 0
            # ... and in the last token of the second: the first chunk only
            off2 = list(prompt_a)
            off2[31] += 1
            assert (await wb.lookup(model, off2)).hit_tokens == 16
            assert pub.hashes(off2) != pub.hashes()  # the chain differs from chunk 1 on
        finally:
            for w in (wa, wb, wc):
                await w.aclose()


def _forged(scope: str, ops: Sequence[str] = ("lookup", "put", "get", "pin")) -> str:
    """A capability for the scope's owner signed with a key the gateway never had."""
    return CapabilityAuthority({"k1": os.urandom(32)}, "k1").mint(scope_owner(scope), SCOPE_NAMESPACE, ops, 60)


async def _raw_attempts(live: LiveServer, http: httpx.AsyncClient, pub: Published, member: str, cap: str) -> list[int]:
    """Every data and admin route a member's client may try on the scope's chunks with ``cap``."""
    h0 = pub.hashes()[0]
    worker = live.headers(live.token(member, ("kv.worker", "kv.admin")), cap)
    statuses = []
    r = await http.post("/v1/keys/envelopes", json={"purpose": "seal", "hashes": pub.hashes()}, headers=worker)
    statuses.append(r.status_code)
    body = b"KVB1" + (1).to_bytes(4, "little") + bytes.fromhex(h0) + (64).to_bytes(8, "little") + b"\x00" * 64
    r = await http.put("/v1/chunks", content=body, headers={**worker, "Content-Type": "application/octet-stream"})
    statuses.append(r.status_code)
    r = await http.post("/v1/chunks/integrity-failures", json={"hash": h0, "envelope_sha256": "0" * 64}, headers=worker)
    statuses.append(r.status_code)
    r = await http.post("/v1/pins", json={"hash": h0}, headers=worker)
    statuses.append(r.status_code)
    r = await http.delete(f"/v1/pins/{h0}", headers=worker)
    statuses.append(r.status_code)
    r = await http.post(
        f"/v1/admin/prefixes/{pub.id}/chunks", json={"fingerprint": pub.model.fingerprint_digest, "hashes": pub.hashes()},
        headers=worker,
    )
    statuses.append(r.status_code)
    r = await http.delete(f"/v1/admin/prefixes/{pub.id}", headers=worker)
    statuses.append(r.status_code)
    return statuses


@pytest.mark.parametrize("mode", MODES)
async def test_published_chunks_cannot_be_poisoned_by_a_member(live: LiveServer, mode: str):
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model)
        await pub.setup(mode)
        a, b = pub.members
        wa, wb = _worker(mode, live, a), _worker(mode, live, b)
        try:
            copies = await pub.scope_copies()
            assert copies >= 2  # the warm-up's two chunks, in each tier that took them
            denied_before = len(await _audit(live, "authz.denied"))
            # A's own capability, every chunk stored again (no skipping), other KV: its own namespace
            poison = random_cache(model.geometry, NUM_BLOCKS, seed=4242)
            assert (await wa.store(model, pub.prefix[:32], poison, skip_existing=False)).stored == 2
            # a forged capability of the scope's owner, and the publisher's own in a member's hands
            for cap in (_forged(pub.scope), pub.capability):
                assert all(s == 403 for s in await _raw_attempts(live, http, pub, a, cap)), cap[:20]
            # the member's own capability on the admin routes of prefixes and on a clear of the scope
            own = await live.capability(http, a, ops=ALL_OPS)
            statuses = await _raw_attempts(live, http, pub, a, own)
            assert statuses[-2:] == [403, 403]  # warm report and revoke: operators only
            r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": scope_owner(pub.scope)},
                                headers=live.headers(live.admin_token(a)))
            assert r.status_code == 422  # a scope's owner is no tenant name
            # a member reporting a published chunk's true digest as an integrity failure (in
            # process: the session that read it from the scope): audited, never dropped
            rt = live.runtime

            async def report() -> bool:
                cap = await live.gateway.mint_capability(a, "default", ALL_OPS)
                opened = await rt.chunks.session(cap, "get", [bytes.fromhex(h) for h in pub.hashes()], shared=True)
                assert opened.shared_count == 2
                found = await opened.fetch(0)
                return await opened.integrity_failure(0, envelope_sha256=hashlib.sha256(found.chunk.data).digest())

            assert await live.call(report) is False
            rows = await _audit(live, "integrity.failure")
            assert rows[-1]["details"]["published"] is True and rows[-1]["details"]["dropped"] is False
            # refused and audited; the scope holds what the warm-up stored
            assert len(await _audit(live, "authz.denied")) >= denied_before + 10
            assert await pub.scope_copies() == copies
            for w in (wa, wb):
                dst = zero_cache(model.geometry, NUM_BLOCKS)
                got = await w.retrieve(model, pub.prompt(61_000), dst)
                assert got.loaded_tokens == 32 and _same(dst, pub.src, model, 32)
                assert not _same(dst, poison, model, 32)  # positive control: the poison differs
        finally:
            await wa.aclose()
            await wb.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_published_tenant_clear_leaves_the_scope_removed_and_disabled_members_miss(live: LiveServer, mode: str):
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model, members=3)
        await pub.setup(mode)
        a, b, c = pub.members
        prompt = pub.prompt(62_000)
        copies = await pub.scope_copies()
        # a tenant clear of A: A's keys are destroyed, the scope is untouched
        r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200, r.text
        assert await pub.scope_copies() == copies
        for t in (a, b, c):
            w = _worker(mode, live, t)
            try:
                assert (await w.lookup(model, prompt)).hit_tokens == 32
            finally:
                await w.aclose()
        # B removed from the scope: a capability minted before still names the scope, and misses
        wb = Embedded(live, b, await live.call(live.gateway.mint_capability, b, "default", ALL_OPS, 600))
        assert pub.scope in read_unverified(await wb.cap()).scopes
        assert (await wb.lookup(model, prompt)).hit_tokens == 32  # positive control
        r = await http.delete(f"/v1/admin/scopes/{pub.scope}/members/{b}", headers=pub.op)
        assert r.status_code == 200 and r.json()["changed"] is True
        assert (await wb.lookup(model, prompt)).hit_tokens == 0
        rb = _worker(mode, live, b)
        try:
            assert (await rb.lookup(model, prompt)).hit_tokens == 0
        finally:
            await rb.aclose()
        # C disabled: refused outright, with the capability it held before
        wc: Embedded | Remote
        if mode == "embedded":
            wc = Embedded(live, c, await live.call(live.gateway.mint_capability, c, "default", ALL_OPS, 600))
        else:
            wc = Remote(live, c)
            await wc.client.capability()
        try:
            assert (await wc.lookup(model, prompt)).hit_tokens == 32  # positive control
            r = await http.delete(f"/v1/admin/tenants/{c}", headers=pub.op)
            assert r.status_code == 200
            with pytest.raises(AccessDenied):
                await wc.lookup(model, prompt)
        finally:
            await wc.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_published_revoke_shreds_deletes_and_every_member_misses(live: LiveServer, mode: str):
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model)
        await pub.setup(mode)
        prompt = pub.prompt(63_000)
        workers = [_worker(mode, live, t) for t in pub.members]
        try:
            for w in workers:
                assert (await w.lookup(model, prompt)).hit_tokens == 32  # positive control
            assert await pub.scope_copies() >= 2
            r = await http.delete(f"/v1/admin/prefixes/{pub.id}", headers=pub.op)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["scope_shredded"] is True and got["destroyed_key_versions"]
            for w in workers:
                assert (await w.lookup(model, prompt)).hit_tokens == 0
                assert (await w.retrieve(model, prompt, zero_cache(model.geometry, NUM_BLOCKS))).loaded_tokens == 0
            assert await pub.scope_copies() == 0  # no ciphertext of the scope in any tier
            listed = (await http.get("/v1/admin/prefixes", params={"scope": pub.scope}, headers=pub.op)).json()
            assert [p["state"] for p in listed] == ["revoked"]
            r = await http.delete(f"/v1/admin/prefixes/{pub.id}", headers=pub.op)
            assert r.status_code == 409  # once
            for action in ("prefix.publish", "prefix.warm", "prefix.revoke"):
                rows = [e for e in await _audit(live, action) if e["details"].get("prefix_id") == pub.id]
                assert len(rows) == 1, action
            publish = next(e for e in await _audit(live, "prefix.publish") if e["details"]["prefix_id"] == pub.id)
            assert publish["details"]["scope"] == pub.scope and publish["details"]["model"] == model.name
            assert publish["details"]["digest"] == base64.b16encode(
                hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in pub.prefix)).digest()).decode().lower()
        finally:
            for w in workers:
                await w.aclose()


async def test_published_warm_report_must_chain_from_the_published_tokens(live: LiveServer):
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model)
        await pub.setup("embedded")
        hdr = live.headers(live.operator_token(), pub.capability)
        other = pub.hashes([t + 1 for t in pub.prefix])
        r = await http.post(f"/v1/admin/prefixes/{pub.id}/chunks", json={"fingerprint": model.fingerprint_digest, "hashes": other}, headers=hdr)
        assert r.status_code == 422
        # the write capability stores nothing but the recorded chunks
        warm = Embedded(live, scope_owner(pub.scope), pub.capability)
        with pytest.raises(AccessDenied):
            await warm.store(model, [t + 1 for t in pub.prefix[:32]], pub.src)
        # and a publish for a scope that does not exist, or a prefix shorter than one chunk
        r = await http.post("/v1/admin/prefixes", json={"scope": "no-such-scope", "model": "m", "token_ids": pub.prefix}, headers=pub.op)
        assert r.status_code == 422
        r = await http.post("/v1/admin/prefixes", json={"scope": pub.scope, "model": "m", "token_ids": pub.prefix[:15]}, headers=pub.op)
        assert r.status_code == 422
        # a tenant admin is not an operator: publishing reaches other tenants
        r = await http.post("/v1/admin/prefixes", json={"scope": pub.scope, "model": "m", "token_ids": pub.prefix},
                            headers=live.headers(live.admin_token(pub.members[0])))
        assert r.status_code == 403


async def test_published_reads_only_for_a_client_that_asks(live: LiveServer):
    """A remote client that does not send X-KV-Shared-Reads (one built before published prefixes)
    is served its own namespace only, so it never meets an envelope whose context it does not
    know; with the header, the same capability reads the prefix and is told where it came from."""
    model = model_for(small_geometry())
    async with live.client() as http:
        pub = Published(live, http, model)
        await pub.setup("remote")
        a = pub.members[0]
        cap = await live.capability(http, a)
        hdr = live.headers(live.worker_token(a), cap)
        hashes = pub.hashes(pub.prompt(64_000))  # the two published chunks, then a suffix of A's
        r = await http.post("/v1/lookup", json={"hashes": hashes[:2]}, headers=hdr)
        assert r.status_code == 200 and r.json()["hit_chunks"] == 0
        r = await http.post("/v1/lookup", json={"hashes": hashes[:2]}, headers={**hdr, "X-KV-Shared-Reads": "1"})
        assert r.status_code == 200 and r.json()["hit_chunks"] == 2
        r = await http.post("/v1/chunks/fetch", json={"hashes": hashes[:2], "keys": True}, headers=hdr)
        assert r.status_code == 200 and "x-kv-shared" not in r.headers
        r = await http.post("/v1/chunks/fetch", json={"hashes": hashes[:2], "keys": True}, headers={**hdr, "X-KV-Shared-Reads": "1"})
        assert r.status_code == 200 and r.headers["x-kv-shared"] == f"2 {scope_owner(pub.scope)} {SCOPE_NAMESPACE}"
        # an outsider asking the same way is told nothing of the scope
        out = live.headers(live.worker_token(pub.outsider), await live.capability(http, pub.outsider))
        r = await http.post("/v1/chunks/fetch", json={"hashes": hashes[:2], "keys": True}, headers={**out, "X-KV-Shared-Reads": "1"})
        assert r.status_code == 200 and "x-kv-shared" not in r.headers
