"""Request limits: deep JSON bodies, oversized request heads, Transfer-Encoding with Content-Length.

    PYTHONPATH=<repo> python scripts/request_limits_probe.py

Starts the test suite's live server (the real app under uvicorn with the protocol and limits
``kvgate serve`` runs with: ``gateway.server.gatekeeper.uvicorn_options``; SQLite, memory and
disk tiers, the development issuer) and prints one line per probe: what was sent (with httpx,
as a client library sends it, or over a raw socket) and what came back. Run it on the code
before the change and after, and compare.
"""

from __future__ import annotations

import os
import sys

import httpx

sys.path.insert(0, os.getcwd())

from hardening_probe import _raw, report

from tests.support import chunks
from tests.support.server_fixture import fake_envelope, random_hash


async def _status(coro) -> str:
    try:
        r = await coro
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:120]
    return f"{r.status_code} {r.text[:100]}"


async def probes(live) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    port = int(live.base_url.rsplit(":", 1)[1])
    json_h = {"Content-Type": "application/json"}
    async with live.client() as http:
        a = await live.create_tenant(http)
        tok, admin, op = live.worker_token(a), live.admin_token(a), live.operator_token()
        cap = await live.capability(http, a)
        hdr = {**live.headers(tok, cap), **json_h}

        # -- point 4: nested JSON --------------------------------------------------------------
        deep_list = b"[" * 5000 + b"]" * 5000
        deep_obj = b'{"a":' * 3000 + b"1" + b"}" * 3000
        for route, headers in (
            ("/v1/lookup", hdr), ("/v1/chunks/fetch", hdr), ("/v1/keys/envelopes", hdr),
            ("/v1/capabilities", {**live.headers(tok), **json_h}), ("/v1/pins", hdr),
            ("/v1/admin/clear", {**live.headers(admin), **json_h}), ("/v1/admin/move", {**live.headers(admin), **json_h}),
            ("/v1/admin/tenants", {**live.headers(op), **json_h}), ("/v1/shm/regions", hdr),
        ):
            for name, body in (("5,000 [ then 5,000 ]", deep_list), ('{"a": nested 3,000 deep', deep_obj)):
                out.append(("4", f"POST {route}, {name}", await _status(http.post(route, content=body, headers=headers))))
        out.append(("4", "control: POST /v1/lookup {hashes: [h]}",
                    await _status(http.post("/v1/lookup", json={"hashes": [random_hash()]}, headers=hdr))))

        # -- point 5: oversized request heads ---------------------------------------------------
        body = {"namespace": "default", "ops": ["get"]}
        for size in (20_000, 267_000):
            big = "A" * size
            out.append(("5", f"POST /v1/capabilities, {size // 1000} KB bearer token (httpx)",
                        await _status(http.post("/v1/capabilities", json=body, headers={"Authorization": f"Bearer {big}"}))))
            out.append(("5", f"POST /v1/admin/tenants, {size // 1000} KB bearer token (httpx)",
                        await _status(http.post("/v1/admin/tenants", json={"tenant": "x"}, headers={"Authorization": f"Bearer {big}"}))))
            out.append(("5", f"GET /healthz, {size // 1000} KB header (raw socket)",
                        _raw(port, f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {big}\r\n\r\n".encode())))
        out.append(("5", "control: POST /v1/capabilities, a real token and 8 KB of other headers (httpx)",
                    await _status(http.post("/v1/capabilities", json=body, headers={**live.headers(tok), "X-Pad": "a" * 8192}))))

        # -- point 6: Transfer-Encoding with Content-Length --------------------------------------
        env = fake_envelope()
        h = random_hash()
        body = chunks.frame([(h, env)])
        chunked = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        head = (
            f"PUT /v1/chunks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tok}\r\nX-KV-Capability: {cap}\r\n"
            f"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        got = _raw(port, head + chunked)
        stored = await chunks.stored(http, live.headers(tok, cap), [h])
        out.append(("6", "PUT /v1/chunks (one envelope), Transfer-Encoding: chunked and Content-Length (raw socket)",
                    f"{got}; stored afterwards (POST /v1/lookup): {stored[0]}"))
        h2 = random_hash()
        r = await chunks.store(http, live.headers(tok, cap), [(h2, env)])
        stored = await chunks.stored(http, live.headers(tok, cap), [h2])
        out.append(("6", "control: PUT /v1/chunks (one envelope), Content-Length only (httpx)",
                    f"{r.status_code}; stored afterwards: {stored[0]}"))
    return out


def main() -> None:
    report(probes)


if __name__ == "__main__":
    main()
