"""Issue 18, the batched data plane under a live server: ``PUT /v1/chunks`` (a frame, all or
nothing) and ``POST /v1/chunks/fetch`` (the stored prefix, streamed).

Written as a misbehaving client would act: malformed and torn frames, a client that hangs up
mid-upload, a reader that stops reading, capabilities narrowed to other chunks or tenants --
each beside the positive control that the same request, done right, works."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.protocol import frames
from tenancy.capabilities import attenuate
from tests.support import server_fixture
from tests.support.chunks import BATCH, frame, parse_fetch, post_fetch, stored
from tests.support.chunks import fetch as fetch_items
from tests.support.server_fixture import LiveServer, assert_problem, fake_envelope, random_hash

live_server = server_fixture.live_server  # a fixture, registered in this module


async def put_batch(http: httpx.AsyncClient, hdr: dict[str, str], body: bytes) -> httpx.Response:
    return await http.put("/v1/chunks", content=body, headers={**hdr, "Content-Type": BATCH})


async def fetch(http: httpx.AsyncClient, hdr: dict[str, str], hashes: list[str]) -> list[tuple[str, int, bytes]]:
    """Every item of a fetch response: (hash, status, envelope)."""
    got = await fetch_items(http, hdr, hashes)
    return [(item.chained_hash.hex(), item.status, body) for item, body in got.items]


def reservations(live: LiveServer) -> int:
    return live.runtime.tiers.tiers[0].stats().reservations  # the memory tier's extents not yet committed


async def _setup(live: LiveServer, http: httpx.AsyncClient) -> tuple[str, dict[str, str]]:
    tenant = await live.create_tenant(http)
    return tenant, live.headers(live.worker_token(tenant), await live.capability(http, tenant))


async def test_round_trip_and_the_prefix_walk(live_server: LiveServer):
    live = live_server
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(n)) for n in (300, 5000, 70_000)]
        r = await put_batch(http, hdr, frame(items))
        assert r.status_code == 204, r.text
        hashes = [h for h, _e in items]
        assert await stored(http, hdr, hashes) == [True] * 3
        got = await fetch(http, hdr, hashes)
        assert got == [(h, frames.OK, e) for h, e in items]  # bit-identical, in order
        # a chunk missing in the middle ends the response there, with one "missing" item
        gap = random_hash()
        got = await fetch(http, hdr, [hashes[0], hashes[1], gap, hashes[2]])
        assert got == [(hashes[0], 0, items[0][1]), (hashes[1], 0, items[1][1]), (gap, frames.MISSING, b"")]


def _malformed(items: list[tuple[str, bytes]]) -> dict[str, bytes]:
    good = frame(items)
    idx = frames.HEAD + len(items) * frames.INDEX_ITEM
    h0, e0 = items[0]
    bad_header = bytearray(good)
    bad_header[idx + len(e0) + len(items[1][1]) : idx + len(e0) + len(items[1][1]) + 4] = b"XXXX"  # item 2's header
    return {
        "magic": b"NOPE" + good[4:],
        "count zero": frames.encode_head(0) + good[frames.HEAD :],
        "count beyond the index": frames.encode_head(4) + good[frames.HEAD :],
        "truncated bodies": good[:-10],
        "trailing bytes": good + b"tail",
        "a hash twice": frame([items[0], (h0, e0)]),
        "an empty item": frames.encode_index([(bytes.fromhex(h0), 0)]),
        "a bad envelope header": bytes(bad_header),
        "head only": good[:6],
    }


@pytest.mark.parametrize("case", list(_malformed([(random_hash(), b"x")] * 3)))
async def test_a_malformed_frame_is_a_400_and_stores_nothing(live_server: LiveServer, case: str):
    live = live_server
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(1000 + i)) for i in range(3)]
        hashes = [h for h, _e in items]
        r = await put_batch(http, hdr, _malformed(items)[case])
        body = assert_problem(r, 400)
        assert body.get("detail")  # says what is wrong with the frame
        assert await stored(http, hdr, hashes) == [False] * 3
        assert reservations(live) == 0
        # positive control: the well-formed frame of the same items is stored whole
        assert (await put_batch(http, hdr, frame(items))).status_code == 204
        assert await stored(http, hdr, hashes) == [True] * 3


async def test_size_limits(live_server: LiveServer):
    live = live_server
    s = live.settings
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        h = random_hash()
        # an item over max_chunk_bytes, named in the index: refused before a body byte is read
        over = frames.encode_index([(bytes.fromhex(h), s.max_chunk_bytes + 1)])
        r = await http.put("/v1/chunks", content=over, headers={**hdr, "Content-Type": BATCH})
        assert_problem(r, 400)
        # more items than max_batch_items
        many = frames.encode_head(s.max_batch_items + 1)
        assert_problem(await put_batch(http, hdr, many), 400)
        # a body over the batch limit: 413 from its Content-Length alone
        limit = max(s.max_batch_bytes, s.max_chunk_bytes + frames.HEAD + frames.SEALED_INDEX_ITEM)
        u = urlsplit(live.base_url)
        assert u.hostname is not None and u.port is not None
        rd, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(_request_head(live, "PUT", "/v1/chunks", hdr, limit + 1, BATCH))
        await w.drain()
        status = await asyncio.wait_for(rd.readline(), 10)
        w.close()
        assert status.startswith(b"HTTP/1.1 413"), status
        assert await stored(http, hdr, [h]) == [False]


async def test_every_item_is_capability_checked(live_server: LiveServer):
    live = live_server
    async with live.client() as http:
        a, hdr = await _setup(live, http)
        b, hdr_b = await _setup(live, http)
        items = [(random_hash(), fake_envelope(500)) for _ in range(3)]
        hashes = [h for h, _e in items]
        cap = hdr["X-KV-Capability"]
        narrowed = live.headers(live.worker_token(a), attenuate(cap, chunks=hashes[:2]))
        # one item outside the capability's chunk allowlist: 403, and nothing of the batch stored
        assert_problem(await put_batch(http, narrowed, frame(items)), 403)
        assert await stored(http, hdr, hashes) == [False] * 3
        # positive control: the items it names are stored
        assert (await put_batch(http, narrowed, frame(items[:2]))).status_code == 204
        assert await stored(http, hdr, hashes) == [True, True, False]
        # the same for fetch: one hash outside the allowlist refuses the whole request
        assert (await put_batch(http, hdr, frame(items[2:]))).status_code == 204
        assert_problem(await post_fetch(http, narrowed, hashes), 403)
        assert [s for _h, s, _e in await fetch(http, narrowed, hashes[:2])] == [frames.OK] * 2
        # operations: a get-only capability cannot upload, a put-only one cannot fetch
        get_only = live.headers(live.worker_token(a), attenuate(cap, ops=["get"]))
        put_only = live.headers(live.worker_token(a), attenuate(cap, ops=["put"]))
        assert_problem(await put_batch(http, get_only, frame([(random_hash(), fake_envelope(10))])), 403)
        assert_problem(await post_fetch(http, put_only, hashes), 403)
        # another tenant: its own capability sees nothing of A's (namespaced keys) ...
        assert await fetch(http, hdr_b, hashes) == [(hashes[0], frames.MISSING, b"")]
        # ... and A's capability under B's bearer token is refused
        stolen = live.headers(live.worker_token(b), cap)
        assert_problem(await post_fetch(http, stolen, hashes), 403)
        assert_problem(await put_batch(http, stolen, frame([(random_hash(), fake_envelope(10))])), 403)
        # no capability at all
        no_cap = live.headers(live.worker_token(a))
        assert (await post_fetch(http, no_cap, hashes)).status_code in (401, 403)


def _request_head(live: LiveServer, method: str, path: str, hdr: dict[str, str], length: int, ctype: str) -> bytes:
    host = urlsplit(live.base_url).netloc
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Type: {ctype}", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in hdr.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_a_client_gone_mid_upload_leaves_nothing(live_server: LiveServer):
    live = live_server
    u = urlsplit(live.base_url)
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(200_000)) for _ in range(3)]
        hashes = [h for h, _e in items]
        body = frame(items)
        head = _request_head(live, "PUT", "/v1/chunks", hdr, len(body), BATCH)
        assert u.hostname is not None and u.port is not None
        # the client sends the index, the first envelope and half the second, then hangs up
        _r, w = await asyncio.open_connection(u.hostname, u.port)
        cut = frames.HEAD + 3 * frames.INDEX_ITEM + len(items[0][1]) + len(items[1][1]) // 2
        w.write(head + body[:cut])
        await w.drain()
        assert await _until(lambda: reservations(live) > 0)  # the server is reading into the tier's extents
        w.close()
        assert await _until(lambda: reservations(live) == 0)  # every extent given back
        assert await stored(http, hdr, hashes) == [False] * 3  # in no tier, not even the first envelope
        # positive control: the same bytes, sent whole over a raw connection, are stored
        rd, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(head + body)
        await w.drain()
        status = await asyncio.wait_for(rd.readline(), 10)
        w.close()
        assert status.startswith(b"HTTP/1.1 204"), status
        assert await stored(http, hdr, hashes) == [True] * 3


async def test_a_slow_reader_holds_the_server_to_a_few_envelopes(live_server: LiveServer):
    """A reader that stops reading a big streamed fetch: the server takes the next envelope from
    its tier only when the previous one went out, so it holds a few envelopes, not the response."""
    live = live_server
    u = urlsplit(live.base_url)
    assert u.hostname is not None and u.port is not None
    n, env = 24, fake_envelope(2 << 20)
    async with live.client(timeout=60) as http:
        _a, hdr = await _setup(live, http)
        hashes = [random_hash() for _ in range(n)]
        assert (await put_batch(http, hdr, frame([(h, env) for h in hashes]))).status_code == 204
        metrics = live.runtime.metrics
        before = metrics.chunks_loaded
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        sock.connect((u.hostname, u.port))
        sock.setblocking(False)
        rd, w = await asyncio.open_connection(sock=sock)
        req = json.dumps({"hashes": hashes, "keys": True}).encode()
        w.write(_request_head(live, "POST", "/v1/chunks/fetch", hdr, len(req), "application/json") + req)
        await w.drain()
        await rd.readexactly(64 << 10)  # a little of the response, then the reader stalls
        last, still = -1, 0
        deadline = time.monotonic() + 15
        while still < 10 and time.monotonic() < deadline:  # until the server stops taking envelopes
            await asyncio.sleep(0.1)
            now = metrics.chunks_loaded - before
            still = still + 1 if now == last else 0
            last = now
        taken = metrics.chunks_loaded - before
        assert 1 <= taken <= 8, taken  # socket buffers and one envelope in flight, not 24
        # positive control: reading on, the whole response arrives
        rest = await asyncio.wait_for(_read_all(rd), 60)
        w.close()
        assert metrics.chunks_loaded - before == n
        assert (64 << 10) + len(rest) > n * len(env)


async def _read_all(rd: asyncio.StreamReader) -> bytes:
    """The rest of a chunked response, read until its last chunk (the connection stays open)."""
    out = bytearray()
    while not out.endswith(b"\r\n0\r\n\r\n"):
        part = await rd.read(1 << 20)
        if not part:
            break
        out += part
    return bytes(out)


async def test_a_keyed_fetch_sends_an_unparsable_envelope_without_a_key_and_stops(live_server: LiveServer):
    """A tier that holds bytes whose header does not parse (written behind the server's back):
    the keyed fetch hands them over with status unkeyed and no key (the worker fails to open them
    and counts an integrity failure), ends there, and issues no key for them."""
    live = live_server
    async with live.client() as http:
        _tenant, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(300)) for _ in range(3)]
        assert (await put_batch(http, hdr, frame(items))).status_code == 204
        hashes = [h for h, _e in items]
        got = (await fetch_items(http, hdr, hashes)).items  # positive control: three keyed envelopes
        assert [(it.status, env, it.key != bytes(32)) for it, env in got] == [(frames.OK, e, True) for _h, e in items]
        cap = hdr["X-KV-Capability"]
        _cap, keys = await live.call(live.state.plane.keys_for, cap, "get", [hashes[1]])
        junk = b"not an envelope" * 20
        await live.call(live.runtime.tiers.put, keys[0], memoryview(junk))
        issued = live.runtime.metrics.envelope_keys_issued.total()
        got = (await fetch_items(http, hdr, hashes)).items
        assert [(it.status, env, it.key == bytes(32)) for it, env in got] == [
            (frames.OK, items[0][1], False), (frames.UNKEYED, junk, True),
        ]
        assert live.runtime.metrics.envelope_keys_issued.total() == issued + 1


async def test_the_fetch_stream_goes_to_the_connection_raw_and_through_asgi_alike(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch):
    """Under uvicorn's h11 protocol the fetch items are written straight to the connection
    (gateway.server.rawchunks); an HTTP/1.0 client (no chunked framing) gets the same bytes
    through ASGI. Both carry every envelope exactly as stored."""
    from gateway.server import rawchunks

    writes: list[int] = []
    real = rawchunks.RawChunks.write

    async def counted(self, parts):
        writes.append(len(parts))
        return await real(self, parts)

    monkeypatch.setattr(rawchunks.RawChunks, "write", counted)
    live = live_server
    u = urlsplit(live.base_url)
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(300_000 + k)) for k in range(3)]
        assert (await put_batch(http, hdr, frame(items))).status_code == 204
        hashes = [h for h, _e in items]
        r = await post_fetch(http, hdr, hashes)
        assert r.status_code == 200
        got = parse_fetch(r.content).items
        assert [(it.chained_hash.hex(), it.status, body) for it, body in got] == [(h, frames.OK, e) for h, e in items]
        assert len(writes) == 3  # one chunk per item (the head rides with the first)
        # HTTP/1.0: the response is framed by the connection's end, through ASGI
        writes.clear()
        req = json.dumps({"hashes": hashes, "keys": True}).encode()
        head = _request_head(live, "POST", "/v1/chunks/fetch", hdr, len(req), "application/json").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        rd, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(head + req)
        await w.drain()
        raw = await asyncio.wait_for(rd.read(-1), 10)
        w.close()
        status_line, _, rest = raw.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 200"), status_line
        body = rest.partition(b"\r\n\r\n")[2]
        assert writes == []
        assert body == r.content  # the same frame, byte for byte (each envelope's key included)


async def test_an_upload_is_received_straight_into_the_tiers_buffers(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch):
    """The envelopes of ``PUT /v1/chunks`` are read by the kernel straight into the memory tier's
    extents (``gateway.server.rawbody``), not through h11 and ASGI: every envelope goes through
    ``RawBody.readinto`` and most bytes arrive by ``recv_into`` (counted); they come back bit for
    bit. A request pipelined behind the upload on the same connection (sent in the same write)
    is answered after it, right: the raw reads never take a byte past the body."""
    from gateway.server import rawbody

    live = live_server
    calls, direct = [0], [0]
    readinto, updated = rawbody.RawBody.readinto, rawbody._Sink.buffer_updated

    async def counted(self, view):
        calls[0] += 1
        await readinto(self, view)

    def received(self, nbytes):
        direct[0] += nbytes
        updated(self, nbytes)

    monkeypatch.setattr(rawbody.RawBody, "readinto", counted)
    monkeypatch.setattr(rawbody._Sink, "buffer_updated", received)
    u = urlsplit(live.base_url)
    assert u.hostname is not None and u.port is not None
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        items = [(random_hash(), fake_envelope(n)) for n in (3 << 20, 100, 1 << 20)]
        hashes = [h for h, _e in items]
        body = frame(items)
        assert (await put_batch(http, hdr, body)).status_code == 204
        assert calls[0] == 5 and direct[0] > (3 << 20)  # the frame's head, its index, three envelopes
        assert await fetch(http, hdr, hashes) == [(h, frames.OK, e) for h, e in items]
        # pipelined: an upload and a lookup of what it stores, in one write on one connection
        more = [(random_hash(), fake_envelope(2 << 20)) for _ in range(2)]
        body = frame(more)
        look = json.dumps({"hashes": [h for h, _e in more]}).encode()
        rd, w = await asyncio.open_connection(u.hostname, u.port)
        w.write(_request_head(live, "PUT", "/v1/chunks", hdr, len(body), BATCH) + body
                + _request_head(live, "POST", "/v1/lookup", hdr, len(look), "application/json") + look)
        await w.drain()
        first = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 30)
        assert first.startswith(b"HTTP/1.1 204"), first
        second = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 30)
        assert second.startswith(b"HTTP/1.1 200"), second
        length = int(next(line.split(b":")[1] for line in second.split(b"\r\n") if line.lower().startswith(b"content-length")))
        assert json.loads(await rd.readexactly(length))["hit_chunks"] == 2
        # a client that asks to be told to go on (Expect: 100-continue) is told, then sends
        last = [(random_hash(), fake_envelope(1 << 20))]
        body = frame(last)
        head = _request_head(live, "PUT", "/v1/chunks", {**hdr, "Expect": "100-continue"}, len(body), BATCH)
        w.write(head)
        await w.drain()
        go_on = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 10)
        assert go_on.startswith(b"HTTP/1.1 100"), go_on
        w.write(body)
        await w.drain()
        done = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 30)
        assert done.startswith(b"HTTP/1.1 204"), done
        w.close()
        stored_now = more + last
        assert await fetch(http, hdr, [h for h, _e in stored_now]) == [(h, frames.OK, e) for h, e in stored_now]


async def test_a_tier_failing_mid_batch_refuses_it_whole_and_removes_what_it_stored(tmp_path):
    """A disk tier that cannot write the batch's second envelope (a file stands where its
    directory must go): 503, and the first envelope, stored before the failure, is gone from
    every tier. The same batch once the obstacle is gone is stored (the positive control)."""
    with server_fixture.running_server(tmp_path / "state", tiers=["disk"]) as live:
        async with live.client() as http:
            _a, hdr = await _setup(live, http)
            cap = hdr["X-KV-Capability"]
            while True:  # three chunks in three directories of the tier, so only the second is blocked
                items = [(random_hash(), fake_envelope(n)) for n in (3000, 5000, 7000)]
                hashes = [h for h, _e in items]
                _cap, keys = await live.call(live.state.plane.keys_for, cap, "put", hashes)
                if len({k.digest[:2] for k in keys}) == 3:
                    break
            disk = live.runtime.tiers.tiers[0]
            blocker = disk._path(keys[1]).parent  # type: ignore[attr-defined]
            blocker.parent.mkdir(parents=True, exist_ok=True)
            blocker.write_bytes(b"not a directory")
            r = await put_batch(http, hdr, frame(items))
            assert r.status_code == 503, r.text
            assert await stored(http, hdr, hashes) == [False] * 3  # the first, stored before the failure, is gone
            metrics = live.runtime.metrics
            # the first removed; the failed one counted as left, since its tier could not be asked
            assert (metrics.store_rollback_removed, metrics.store_rollback_left) == (1, 1)
            blocker.unlink()
            r = await put_batch(http, hdr, frame(items))
            assert r.status_code == 204, r.text
            assert await stored(http, hdr, hashes) == [True] * 3
            assert await fetch(http, hdr, hashes) == [(h, frames.OK, e) for h, e in items]



async def _answer(rd: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response off a raw connection: its head and its (Content-Length) body."""
    head = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 30)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head, await asyncio.wait_for(rd.readexactly(length), 30)


async def _lookup_on(live: LiveServer, rd: asyncio.StreamReader, w: asyncio.StreamWriter, hdr: dict[str, str], hashes: list[str]) -> int:
    """``POST /v1/lookup`` on a connection kept open: the hit count (the answer must be a 200)."""
    look = json.dumps({"hashes": hashes}).encode()
    w.write(_request_head(live, "POST", "/v1/lookup", hdr, len(look), "application/json") + look)
    await w.drain()
    head, body = await _answer(rd)
    assert head.startswith(b"HTTP/1.1 200"), head
    return int(json.loads(body)["hit_chunks"])


async def test_an_upload_to_a_namespace_the_mint_did_not_make_arrives_whole(live_server: LiveServer):
    """A capability minted without its namespace made (``access.mint`` alone, as the mint answers
    during a KEK outage): the upload makes it, between reading the frame's index and reading the
    envelopes, and the envelopes, sent just after the index as a worker sends them, arrive
    meanwhile. Every upload is stored bit for bit, and the connection serves the next request."""
    live = live_server
    u = urlsplit(live.base_url)
    assert u.hostname is not None and u.port is not None
    async with live.client() as http:
        tenant = await live.create_tenant(http)
        token = live.worker_token(tenant)
        for k in range(5):
            cap = await live.call(live.runtime.access.mint, tenant, f"fresh{k}", ["lookup", "get", "put"], 600)
            hdr = live.headers(token, cap)
            items = [(random_hash(), fake_envelope(n)) for n in (20_000, 9_000)]
            hashes = [h for h, _e in items]
            body = frame(items)
            cut = frames.HEAD + len(items) * frames.INDEX_ITEM
            rd, w = await asyncio.open_connection(u.hostname, u.port)
            try:
                w.write(_request_head(live, "PUT", "/v1/chunks", hdr, len(body), BATCH) + body[:cut])
                await w.drain()
                await asyncio.sleep(0.001)
                w.write(body[cut:])
                await w.drain()
                head, _body = await _answer(rd)
                assert head.startswith(b"HTTP/1.1 204"), head
                assert await _lookup_on(live, rd, w, hdr, hashes) == 2
            finally:
                w.close()
            assert await fetch(http, hdr, hashes) == [(h, frames.OK, e) for h, e in items]


@pytest.mark.parametrize("case", ["ended", "paused", "split"])
async def test_envelopes_that_arrive_while_the_upload_is_opened_are_all_read(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, case: str,
):
    """The server is held between reading the frame's index and reading its envelopes (opening
    the upload, as a namespace made on first use or a slow dependency holds it) while the client
    sends the envelopes: ``ended``, all of them arrive (the body ends with nobody reading it);
    ``paused``, more than the server buffers (it stops reading the socket); ``split``, half of
    them, the rest after. Each upload is stored bit for bit and the connection serves the next
    request; the positive control is the same upload with no hold."""
    from gateway.chunks import batches

    live = live_server
    entered, release = threading.Event(), threading.Event()
    real = batches.open_upload

    async def held(*args, **kw):
        entered.set()
        while not release.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # what the client sent meanwhile is received before the upload goes on
        return await real(*args, **kw)

    u = urlsplit(live.base_url)
    assert u.hostname is not None and u.port is not None
    sizes = {"ended": (20_000, 9_000), "paused": (3 << 20, 100), "split": (200_000, 50_000)}[case]
    async with live.client() as http:
        _a, hdr = await _setup(live, http)
        for hold in (False, True):
            monkeypatch.setattr(batches, "open_upload", held if hold else real)
            entered.clear()
            release.clear()
            items = [(random_hash(), fake_envelope(n)) for n in sizes]
            hashes = [h for h, _e in items]
            body = frame(items)
            cut = frames.HEAD + len(items) * frames.INDEX_ITEM
            now = len(body) if case != "split" else cut + (len(body) - cut) // 2
            rd, w = await asyncio.open_connection(u.hostname, u.port)
            try:
                w.write(_request_head(live, "PUT", "/v1/chunks", hdr, len(body), BATCH) + body[:cut])
                await w.drain()
                if hold:
                    assert await _until(entered.is_set)  # the index is read; the envelopes are not
                w.write(body[cut:now])  # not drained: a held server may not take all of it yet
                await asyncio.sleep(0.05)
                release.set()
                w.write(body[now:])
                await w.drain()
                head, _body = await _answer(rd)
                assert head.startswith(b"HTTP/1.1 204"), (hold, head)
                assert await _lookup_on(live, rd, w, hdr, hashes) == 2
            finally:
                w.close()
            assert await fetch(http, hdr, hashes) == [(h, frames.OK, e) for h, e in items]
