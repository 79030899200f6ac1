"""Two gateway server processes sharing one Postgres and one Redis (issue 6, scale-out)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from audit import create_audit_engine, verify_database
from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext
from gateway.protocol import frames
from gateway.services import dbschema
from tenancy.devissuer import DevIssuer
from tests.support import chunks
from tests.support.services import free_port

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


def _start(port: int, env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not come up")


def _envelope() -> bytes:
    ctx = EnvelopeContext("acme", "default", "ab" * 32, "cd" * 32, 1)
    return bytes(ChunkCipher(segment_bytes=4096).seal(DataKey(os.urandom(32), os.urandom(32)), ctx, os.urandom(10_000)))


def test_two_servers_share_chunks_and_clears(tmp_path, fresh_pg_url, redis_url, redis_prefix):
    dbschema.upgrade(fresh_pg_url)
    pa, pb = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    env = {
        **os.environ,
        "KVGATE_STATE_DIR": str(tmp_path),  # shared KEK file and development issuer key
        "KVGATE_DATABASE_URL": fresh_pg_url,
        "KVGATE_REDIS_URL": redis_url,
        "KVGATE_REDIS_PREFIX": redis_prefix,
        "KVGATE_TIERS": '["memory", "redis"]',
        "KVGATE_PUBLIC_URL": url_a,  # one development issuer for both (same key, served by A)
    }
    log = open(tmp_path / "servers.log", "wb")
    procs = [_start(pa, env, log)]
    try:
        _wait_up(url_a, procs[0])
        procs.append(_start(pb, env, log))
        _wait_up(url_b, procs[1])
        dev = DevIssuer(tmp_path, issuer_url=url_a + "/dev-issuer")
        op = {"Authorization": "Bearer " + dev.mint("ops", ["kv.operator"])}
        user = {"Authorization": "Bearer " + dev.mint("acme", ["kv.worker", "kv.admin"])}
        with httpx.Client(timeout=10.0) as http:
            assert http.post(url_a + "/v1/admin/tenants", json={"tenant": "acme"}, headers=op).status_code == 201
            r = http.post(url_a + "/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get", "put"]}, headers=user)
            assert r.status_code == 201, r.text
            hdr = {**user, "X-KV-Capability": r.json()["capability"]}
            h = "12" * 32
            body = _envelope()

            def store(url: str) -> int:
                return http.put(f"{url}/v1/chunks", content=chunks.frame([(h, body)]), headers={**hdr, "Content-Type": chunks.BATCH}).status_code

            def fetch(url: str) -> tuple[int, chunks.Fetched | None]:
                r = http.post(f"{url}/v1/chunks/fetch", json={"hashes": [h], "keys": True}, headers=hdr)
                return r.status_code, chunks.parse_fetch(r.content) if r.status_code == 200 else None

            def statuses(url: str) -> list[int]:
                code, got = fetch(url)
                assert code == 200 and got is not None, code
                return got.statuses

            assert store(url_a) == 204
            code, got_b = fetch(url_b)  # the capability works on B too
            assert code == 200 and got_b is not None and got_b.envelopes() == [body]
            r = http.post(f"{url_a}/v1/lookup", json={"hashes": [h]}, headers=hdr)
            assert r.status_code == 200 and "memory" in r.json()["locations"][0], r.text
            # a namespace clear through B: A's memory tier stops serving within 1 s
            r = http.post(url_b + "/v1/admin/clear", json={"scope": "namespace", "tenant": "acme", "namespace": "default"}, headers=user)
            assert r.status_code == 200, r.text
            t0 = time.monotonic()
            while statuses(url_a) != [frames.MISSING]:
                assert time.monotonic() - t0 < 1.0, "A still serves the chunk a second after B's clear"
                time.sleep(0.05)
            assert statuses(url_b) == [frames.MISSING]
            # a tenant clear through A revokes the capability on B as well
            assert store(url_b) == 204
            assert http.post(url_a + "/v1/admin/clear", json={"scope": "tenant", "tenant": "acme"}, headers=user).status_code == 200
            t0 = time.monotonic()
            while fetch(url_b)[0] != 403:
                assert time.monotonic() - t0 < 1.0, "B still honours a capability revoked through A"
                time.sleep(0.05)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    # both processes wrote to one audit chain, and it is linear
    async def check() -> None:
        engine = create_audit_engine(fresh_pg_url)
        try:
            report = await verify_database(engine)
            assert report.ok, report.problems
            assert report.rows >= 8
        finally:
            await engine.dispose()

    asyncio.run(check())
