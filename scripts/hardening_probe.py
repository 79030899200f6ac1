"""An attacker's requests against a live server of this tree, one line per probe.

    PYTHONPATH=<repo> python scripts/hardening_probe.py

Starts the test suite's live server (SQLite, memory and disk tiers, the development issuer) and
prints what each probe sent and what came back, labelled by area: [1] a misspelled admin body,
[2] tenant and namespace names (NUL, zero-width, case), [3] unauthenticated, oversized and slow
requests, [8] the file modes of the state. Run it against two checkouts to compare them. Outages
and vLLM need a stopped Postgres and a real engine: see tests/e2e/test_hardening_outage.py and
tests/engine/test_http.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())

from tests.support import chunks
from tests.support.server_fixture import fake_envelope, random_hash, running_server


def _raw(port: int, data: bytes, wait: float = 3.0) -> str:
    """Send ``data`` on a fresh connection; the status line that comes back (or what happened)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    t0 = time.monotonic()
    try:
        try:
            s.sendall(data)
        except OSError as exc:
            return f"{type(exc).__name__} while sending after {time.monotonic() - t0:.1f} s"
        got = b""
        while b"\r\n" not in got:
            part = s.recv(4096)
            if not part:
                break
            got += part
        return (got.split(b"\r\n", 1)[0].decode(errors="replace") or "closed, no answer") + f" after {time.monotonic() - t0:.1f} s"
    except TimeoutError:
        return f"no answer within {wait:.0f} s"
    except OSError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s"
    finally:
        s.close()


def _unsigned(tenant: str) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
    return f"{enc({'alg': 'RS256', 'typ': 'at+jwt'})}.{enc({'tenant': tenant, 'sub': 'm'})}.c2ln"


async def probes(live) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    port = int(live.base_url.rsplit(":", 1)[1])
    async with live.client() as http:
        a = await live.create_tenant(http)
        admin, op = live.admin_token(a), live.operator_token()
        cap = await live.capability(http, a)
        h = random_hash()
        await chunks.store(http, live.headers(live.worker_token(a), cap), [(h, fake_envelope())])

        r = await http.post("/v1/admin/clear", json={"namespce": "scratch"}, headers=live.headers(admin))
        after = await http.post("/v1/lookup", json={"hashes": [h]}, headers=live.headers(live.worker_token(a), cap))
        out.append(("1", 'POST /v1/admin/clear {"namespce": "scratch"} (tenant admin)',
                    f"{r.status_code} {r.text[:90]}; the tenant's capability afterwards: {after.status_code}"))
        for name, body in (("NUL", "acme\x00"), ("zero-width", "ac\u200bme"), ("upper case", "Acme")):
            r = await http.post("/v1/admin/tenants", json={"tenant": body}, headers=live.headers(op))
            out.append(("2", f"POST /v1/admin/tenants {{tenant: {ascii(body)}}} ({name})", f"{r.status_code}"))
        r = await http.post("/v1/admin/tenants", json={"tenant": "ac\u200bme"}, headers=live.headers(op))
        out.append(("2", "the same zero-width tenant again", f"{r.status_code}"))
        move = {"tenant": a, "namespace": "de\x00fault", "hashes": [h], "from": "memory", "to": "disk"}
        r = await http.post("/v1/admin/move", json=move, headers=live.headers(admin))
        out.append(("2", "POST /v1/admin/move with a NUL namespace", f"{r.status_code}"))

    out.append(("3", "POST /v1/admin/clear, no token, Content-Length 16 MB, headers only",
                _raw(port, b"POST /v1/admin/clear HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 16777216\r\n\r\n")))
    forged = cap[:-4] + ("AAAA" if not cap.endswith("AAAA") else "BBBB")
    tok = live.worker_token(a)
    out.append(("3", "PUT /v1/chunks, forged capability, Content-Length 60 MB, headers only",
                _raw(port, f"PUT /v1/chunks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tok}\r\nX-KV-Capability: {forged}\r\nContent-Length: 62914560\r\n\r\n".encode())))
    body = chunks.frame([(random_hash(), fake_envelope(1500))])
    out.append(("3", f"PUT /v1/chunks, valid capability, Content-Length {len(body)}, all but 500 bytes sent",
                _raw(port, f"PUT /v1/chunks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tok}\r\nX-KV-Capability: {cap}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-500], wait=15)))
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    t0, cut = time.monotonic(), None
    s.setblocking(False)
    while time.monotonic() - t0 < 25 and cut is None:
        try:
            s.sendall(b"X")
            if s.recv(4096) == b"":
                cut = time.monotonic() - t0
        except BlockingIOError:
            pass
        except OSError:
            cut = time.monotonic() - t0
        time.sleep(0.5)
    s.close()
    out.append(("3", "slow header: half a request head, then 1 byte every 0.5 s",
                f"cut after {cut:.1f} s" if cut is not None else "still open after 25 s"))
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n"
    out.append(("3", "GET /healthz with a 4 MB header line", _raw(port, big)))
    async with live.client() as http:
        live.set_auth_failure_limit(20)
        for _ in range(25):
            await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=live.headers(_unsigned(a)))
        r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=live.headers(live.worker_token(a)))
        out.append(("3", "25 unsigned tokens claiming tenant A, then A's valid worker (same address)", f"valid worker gets {r.status_code}"))
        live.set_auth_failure_limit(10_000)
    db = Path(live.settings.state_dir) / "kvgate.db"
    out.append(("8", "mode of the SQLite database and the state directory",
                f"{stat.S_IMODE(db.stat().st_mode):04o}, {stat.S_IMODE(db.parent.stat().st_mode):04o}"))
    return out


def report(probes: Callable[[Any], Awaitable[list[tuple[str, str, str]]]]) -> None:
    """Run ``probes`` against a fresh live server of this tree and print what each request got."""
    old = os.umask(0o022)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with running_server(Path(tmp) / "state") as live:
                rows = asyncio.run(probes(live))
    finally:
        os.umask(old)
    for point, sent, got in rows:
        print(f"[{point}] {sent}\n      -> {got}")


def main() -> None:
    report(probes)


if __name__ == "__main__":
    main()
