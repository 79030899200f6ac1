"""Issue 15, point 4 for Redis: a throwaway redis-server of this test's own (stopped by its pid) is
killed under a live server whose tiers are memory and Redis. Every answer during the outage is a
success the memory tier could give or a problem+json 503 with Retry-After -- never a 500 -- and
the one keep-alive connection survives throughout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from gateway.protocol import frames
from tests.support import chunks
from tests.support.server_fixture import fake_envelope, random_hash, running_server
from tests.support.services import free_port, missing

pytestmark = [pytest.mark.slow]


@pytest.fixture
def redis_proc(tmp_path: Path):
    exe = shutil.which("redis-server")
    if exe is None:
        missing("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    import socket

    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        yield proc, f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _port_of(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


async def test_redis_outage_is_never_a_500_and_keeps_the_connection(redis_proc, tmp_path: Path):
    proc, url = redis_proc
    with running_server(tmp_path / "state", tiers=["memory", "redis"], redis_url=url) as live:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with live.client(limits=limits, timeout=60) as http:
            a = await live.create_tenant(http)
            tok = live.token(a, ("kv.worker", "kv.admin"))
            cap = await live.capability(http, a, ops=("lookup", "get", "put", "pin"), token=tok)
            h = random_hash()
            r = await chunks.store(http, live.headers(tok, cap), [(h, fake_envelope())])
            assert r.status_code == 204
            port = _port_of(r)

            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            calls = {
                "put": lambda: chunks.store(http, live.headers(tok, cap), [(random_hash(), fake_envelope())]),
                "get": lambda: chunks.post_fetch(http, live.headers(tok, cap), [h]),
                "lookup": lambda: http.post("/v1/lookup", json={"hashes": [h]}, headers=live.headers(tok, cap)),
                "pin": lambda: http.post("/v1/pins", json={"hash": h}, headers=live.headers(tok, cap)),
                "mint": lambda: http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=live.headers(tok)),
                "clear": lambda: http.post("/v1/admin/clear", json={"scope": "namespace", "tenant": a, "namespace": "other"}, headers=live.headers(tok)),
            }
            seen, fetched = {}, []
            for name, call in calls.items():
                for _ in range(2):
                    r = await call()
                    seen[name] = r.status_code
                    if name == "get" and r.status_code == 200:
                        fetched.append(chunks.parse_fetch(r.content).statuses)
                    assert r.status_code < 500 or r.status_code == 503, (name, r.status_code, r.text)
                    if r.status_code == 503:
                        assert r.headers["content-type"].startswith("application/problem+json")
                        assert int(r.headers["retry-after"]) > 0
                    assert _port_of(r) == port, f"{name}: the keep-alive connection was dropped"
            # positive control: the memory tier still serves what it holds, and minting needs no Redis
            assert seen["get"] == 200 and seen["mint"] == 201, seen
            assert fetched == [[frames.OK], [frames.OK]], fetched
