"""Issue 5, operations: secure clear under concurrent load, the failed-authentication rate limit,
/metrics values that move, and the audit flush on graceful shutdown -- all on a live server."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from audit import AuditEvent, AuditStore, create_audit_engine, verify_database
from gateway.protocol import frames
from tests.support import chunks, server_fixture
from tests.support.gw import model_for, random_cache, small_geometry, zero_cache
from tests.support.server_fixture import (
    ALL_OPS,
    LiveServer,
    assert_problem,
    fake_envelope,
    random_hash,
    running_server,
    scratch_pg_database,
)

live_server = server_fixture.live_server  # a fixture, registered in this module


# -- secure clear under load ----------------------------------------------------------------------
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
async def test_secure_clear_under_concurrent_reads(tmp_path, database):
    """While A's and B's clients read in a loop, A is cleared: once the clear returned no read of
    A's data succeeds (with the old capability or a new one); B's reads all succeed throughout."""
    with scratch_pg_database() if database == "postgres" else _nothing() as url, running_server(tmp_path / "s", url) as live:
        async with live.client(limits=httpx.Limits(max_connections=16)) as http:
            a, b = await live.create_tenant(http), await live.create_tenant(http)
            caps = {t: await live.capability(http, t) for t in (a, b)}
            hdrs = {t: live.headers(live.worker_token(t), caps[t]) for t in (a, b)}
            hashes = {t: [random_hash() for _ in range(6)] for t in (a, b)}
            for t in (a, b):
                items = [(h, fake_envelope(2048)) for h in hashes[t]]
                assert (await chunks.store(http, hdrs[t], items)).status_code == 204
            log: dict[str, list[tuple[float, float, str]]] = {a: [], b: []}
            stop = asyncio.Event()

            async def read(h: str, headers: dict[str, str]) -> str:
                """What a fetch of ``h`` got: "ok", "missing", another item status, or the HTTP status."""
                r = await chunks.post_fetch(http, headers, [h])
                if r.status_code != 200:
                    return str(r.status_code)
                (status,) = chunks.parse_fetch(r.content).statuses
                return {frames.OK: "ok", frames.MISSING: "missing"}.get(status, f"item status {status}")

            async def reader(t: str, k: int) -> None:
                i = k
                while not stop.is_set():
                    h = hashes[t][i % len(hashes[t])]
                    i += 1
                    t0 = time.monotonic()
                    got = await read(h, hdrs[t])
                    log[t].append((t0, time.monotonic(), got))

            readers = [asyncio.create_task(reader(t, k)) for t in (a, b) for k in range(3)]
            await asyncio.sleep(0.4)
            r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
            cleared_at = time.monotonic()
            assert r.status_code == 200 and r.json()["deleted_chunk_copies"] >= len(hashes[a])
            await asyncio.sleep(0.4)
            stop.set()
            await asyncio.gather(*readers)

            before = [s for t0, _, s in log[a] if t0 < cleared_at]
            after = [s for t0, _, s in log[a] if t0 >= cleared_at]
            assert before.count("ok") > 0 and len(after) > 5  # A was read before, and tried after
            assert all(s in ("403", "missing") for s in after), after
            assert log[b] and all(s == "ok" for _, _, s in log[b]), {s for _, _, s in log[b]}
            # a capability minted after the clear finds nothing either (new epoch, unrelated keys)
            fresh = live.headers(live.worker_token(a), await live.capability(http, a))
            for h in hashes[a]:
                assert await read(h, fresh) == "missing"
            # and nothing of A is left in any tier
            assert await live.call(_owner_chunks, live, a) == 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


async def _owner_chunks(live: LiveServer, tenant: str) -> int:
    rt = live.runtime
    owner = rt.deriver.owner_label(tenant)
    n = 0
    for tier in rt.tiers.tiers:
        n += sum(1 for k in await tier.list_keys() if k.owner == owner)
    return n


# -- rate limit -----------------------------------------------------------------------------------
def _forged(tenant: str) -> str:
    """A JWT-shaped token claiming ``tenant``, signed by nobody."""
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
    return f"{enc({'alg': 'EdDSA', 'typ': 'at+jwt'})}.{enc({'tenant': tenant, 'sub': 'x'})}.c2ln"


def _from(live: LiveServer, address: str) -> httpx.AsyncClient:
    return live.client(transport=httpx.AsyncHTTPTransport(local_address=address))


async def test_repeated_bad_tokens_get_429(live_server: LiveServer):
    live = live_server
    live.set_auth_failure_limit(5)
    async with live.client() as http:
        a = await live.create_tenant(http)
    body = {"namespace": "default", "ops": ["get"]}
    async with _from(live, "127.0.0.2") as attacker, _from(live, "127.0.0.1") as worker:
        for _ in range(5):
            assert_problem(await attacker.post("/v1/capabilities", json=body, headers=live.headers(_forged(a))), 401)
        limited_r = await attacker.post("/v1/capabilities", json=body, headers=live.headers(_forged(a)))
        limited = assert_problem(limited_r, 429)
        assert limited["title"]
        assert int(limited_r.headers["retry-after"]) > 0
        # a token that verifies is never turned away, even from a flooded address
        r = await attacker.post("/v1/capabilities", json=body, headers=live.headers(live.worker_token(a)))
        assert r.status_code == 201, r.text
        # the forged claims did not lock tenant A's real worker (another address) out
        assert (await worker.post("/v1/capabilities", json=body, headers=live.headers(live.worker_token(a)))).status_code == 201
        # garbage without any claim, and no token at all: limited per address too
        for _ in range(5):
            assert_problem(await worker.get("/metrics", headers=live.headers("garbage")), 401)
        assert_problem(await worker.get("/metrics"), 429)
    # a client rotating made-up claims is stopped by its address's bucket (claims are not keys)
    async with _from(live, "127.0.0.3") as rotator:
        codes = [(await rotator.get("/metrics", headers=live.headers(_forged(f"t{i}")))).status_code for i in range(30)]
        assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}


# -- metrics --------------------------------------------------------------------------------------
def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope"))
            out[(s.name, labels)] = s.value
    return out


def _total(samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def _scrape(live: LiveServer, http: httpx.AsyncClient):
    r = await http.get("/metrics", headers=live.headers(live.operator_token()))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return _samples(r.text)


async def test_metrics_move(live_server: LiveServer):
    live = live_server
    g = small_geometry()
    model = model_for(g)
    async with live.client() as http:
        a = await live.create_tenant(http)
        cap = await live.capability(http, a)
        hdr = live.headers(live.worker_token(a), cap)
        s0 = await _scrape(live, http)
        h1, h2 = random_hash(), random_hash()
        env = fake_envelope(1000)
        for h in (h1, h2):
            assert (await chunks.store(http, hdr, [(h, env)])).status_code == 204
        assert await chunks.envelope(http, hdr, h1) == env
        assert await chunks.envelope(http, hdr, random_hash()) is None
        assert (await http.post("/v1/lookup", json={"hashes": [h1]}, headers=hdr)).json()["hit_chunks"] == 1
        assert (await http.post("/v1/lookup", json={"hashes": [random_hash()]}, headers=hdr)).json()["hit_chunks"] == 0
        assert (await http.post("/v1/lookup", json={"hashes": [h1]}, headers=live.headers("bad"))).status_code == 401
        assert (await http.post("/v1/lookup", json={"hashes": [h1]}, headers=live.headers(live.worker_token(a), "x"))).status_code == 403
        # an envelope moved to another chunk's place fails authentication in the core
        core_cap = await live.call(live.gateway.mint_capability, a, "default", ALL_OPS, 600)
        src = random_cache(g, 8)
        t1, t2 = list(range(16)), list(range(100, 116))
        await live.call(live.gateway.store, core_cap, model, t1, src, block_ids=[0, 1, 2, 3])
        (k1,) = await live.call(live.gateway.keys_for, a, "default", model, t1)
        (k2,) = await live.call(live.gateway.keys_for, a, "default", model, t2)
        blob = (await live.call(live.runtime.tiers.get, k1)).data
        await live.call(live.runtime.tiers.put, k2, bytes(blob))
        got = await live.call(live.gateway.retrieve, core_cap, model, t2, zero_cache(g, 8), block_ids=[0, 1, 2, 3])
        assert got.integrity_failures == 1
        await live.call(live.runtime.tiers.flush)  # write-behind: the disk copies land now
        s1 = await _scrape(live, http)

    def grew(name: str, by: float = 1, **labels: str) -> None:
        before, after = _total(s0, name, **labels), _total(s1, name, **labels)
        assert after - before >= by, (name, labels, before, after)

    grew("kvgate_http_requests_total", 8)
    grew("kvgate_http_requests_total", 2, route="/v1/chunks", method="PUT", status="204")
    grew("kvgate_http_requests_total", 1, status="401")
    grew("kvgate_http_request_duration_seconds_count", 8)
    grew("kvgate_http_request_duration_seconds_bucket", 1, route="/v1/lookup", le="+Inf")
    grew("kvgate_lookups_total", 1, result="hit")
    grew("kvgate_lookups_total", 1, result="miss")
    grew("kvgate_loads_total", 1, result="hit")
    grew("kvgate_loads_total", 2, result="miss")  # the fetch's missing chunk and the core's failed retrieve
    # bytes in count the tiers that acknowledged the PUT: the fastest one (write-behind is the
    # default); the disk copies land behind it and show in the disk tier's used bytes
    grew("kvgate_chunk_bytes_total", 2 * len(env), direction="in", tier="memory")
    for tier in ("memory", "disk"):
        grew("kvgate_tier_used_bytes", 2 * len(env), tier=tier)
    grew("kvgate_write_behind_copies_total", 2, tier="disk", outcome="written")
    grew("kvgate_chunk_bytes_total", len(env), direction="out", tier="memory")
    grew("kvgate_core_bytes_total", 2 * len(env), direction="in")
    grew("kvgate_auth_denials_total", 1, kind="authentication")
    grew("kvgate_capability_denials_total", 1)
    grew("kvgate_integrity_failures_total", 1)

    # the audit queue: a burst of events is visible at the next scrape (taken on the server's loop
    # in the same step), then drains
    def burst() -> bytes:
        for i in range(300):
            live.runtime.audit.emit(AuditEvent("test.burst", details={"i": i}))
        return live.state.telemetry.scrape()

    async def burst_async() -> bytes:
        return burst()

    during = _samples((await live.call(burst_async)).decode())
    assert _total(during, "kvgate_audit_queue_depth") >= 300
    await live.call(live.runtime.audit.flush, 10)
    async with live.client() as http:
        after = await _scrape(live, http)
    assert _total(after, "kvgate_audit_queue_depth") < 300


async def test_audit_spool_metric_moves_during_a_database_outage(tmp_path):
    """Postgres refuses connections: audit events go to the spool (its size shows in /metrics),
    and are replayed into the table once it is back."""
    import asyncpg

    from tests.support.services import PG_ADMIN_URL

    plain = PG_ADMIN_URL.replace("postgresql+asyncpg://", "postgresql://")
    with scratch_pg_database() as url, running_server(tmp_path / "s", url) as live:
        dbname = url.rsplit("/", 1)[1]

        async def admin(sql: str) -> None:
            conn = await asyncpg.connect(plain)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        async with live.client() as http:
            s0 = await _scrape(live, http)
            assert _total(s0, "kvgate_audit_spool_bytes") == 0
            await admin(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS false')
            await admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{dbname}'")
            try:
                spooled = 0.0
                for _ in range(100):
                    await http.get("/metrics", headers=live.headers("bad"))  # an authn.failed event each
                    spooled = _total(await _scrape(live, http), "kvgate_audit_spool_bytes")
                    if spooled > 0:
                        break
                    await asyncio.sleep(0.1)
                assert spooled > 0
            finally:
                await admin(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS true')
            for _ in range(150):
                if _total(await _scrape(live, http), "kvgate_audit_spool_bytes") == 0:
                    break
                await asyncio.sleep(0.1)
            assert _total(await _scrape(live, http), "kvgate_audit_spool_bytes") == 0
            # the server still works once the database is back
            assert (await http.get("/readyz")).status_code == 200


# -- graceful shutdown ----------------------------------------------------------------------------
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
async def test_graceful_shutdown_flushes_the_audit_queue(tmp_path, database):
    with scratch_pg_database() if database == "postgres" else _nothing() as pg:
        with running_server(tmp_path / "s", pg) as live:
            url = live.settings.db_url
            async with live.client() as http:
                a = await live.create_tenant(http)
                await live.capability(http, a)
                assert (await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(live.admin_token(a)))).status_code == 200
                assert (await http.get("/metrics", headers=live.headers("bad"))).status_code == 401

            async def burst() -> int:
                for i in range(2000):
                    live.runtime.audit.emit(AuditEvent("test.burst", details={"i": i}))
                return live.runtime.audit.queue_depth

            assert await live.call(burst) > 0  # still queued when the shutdown starts
            live.stop()
        engine = create_audit_engine(url)
        try:
            store = AuditStore(engine)
            actions: dict[str, int] = {}
            async for rec in store.iter_records():
                actions[rec.event.action] = actions.get(rec.event.action, 0) + 1
            assert actions.get("test.burst") == 2000
            for action in ("tenant.create", "capability.mint", "key.rotate", "authn.failed"):
                assert actions.get(action), (action, actions)
            report = await verify_database(store)
            assert report.ok, report
        finally:
            await engine.dispose()
