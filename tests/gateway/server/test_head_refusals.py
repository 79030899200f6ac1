"""Refused request heads under a live server: each is answered with its status and counted by
status in ``/metrics`` (``kvgate_http_heads_refused_total``), and none is logged, as a scanner
sending malformed heads would otherwise fill the log with a warning each. The positive controls:
a request broken inside its body (a request being served) is still uvicorn's logged 400, and a
well-formed request after the refusals is served."""

from __future__ import annotations

import asyncio
import logging
import re
from urllib.parse import urlsplit

from tests.support.server_fixture import LiveServer, running_server

_INVALID = "Invalid HTTP request received."


async def _exchange(live: LiveServer, data: bytes, then: bytes = b"") -> bytes:
    """``data`` sent on a fresh connection (``then`` a moment later); everything the server
    answers until it closes."""
    u = urlsplit(live.base_url)
    assert u.hostname is not None and u.port is not None
    rd, w = await asyncio.open_connection(u.hostname, u.port)
    try:
        w.write(data)
        await w.drain()
        if then:
            await asyncio.sleep(0.2)
            w.write(then)
            await w.drain()
        return await asyncio.wait_for(rd.read(), 10)
    finally:
        w.close()


def _refused(scrape: str) -> dict[str, float]:
    """``kvgate_http_heads_refused_total`` by status, from a Prometheus scrape."""
    found = re.findall(r'^kvgate_http_heads_refused_total\{[^}]*status="(\d+)"[^}]*\} (\S+)$', scrape, re.M)
    return {status: float(n) for status, n in found}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_refused_heads_are_counted_not_logged(tmp_path):
    log = _Records()
    with running_server(tmp_path / "s", header_timeout_s=1.0) as live:
        logging.getLogger("uvicorn.error").addHandler(log)  # where uvicorn's protocol logs (set up by the server)
        heads = {
            b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n": b"400",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (live.settings.max_header_bytes + 1) + b"\r\n\r\n": b"431",
            b"not http at all\r\n\r\n": b"400",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n": b"408",  # a head that never ends
        }
        for data, status in heads.items():
            answer = await _exchange(live, data)
            assert answer.startswith(b"HTTP/1.1 " + status), (data[:40], answer[:80])
        assert _INVALID not in log.messages
        async with live.client() as http:
            # positive control: a chunked body broken while its route reads it is uvicorn's 400, logged
            tenant = await live.create_tenant(http)
            auth = "".join(f"{k}: {v}\r\n" for k, v in live.headers(live.worker_token(tenant), await live.capability(http, tenant)).items())
            head = f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n{auth}\r\n"
            assert (await _exchange(live, head.encode(), then=b"zz\r\n")).startswith(b"HTTP/1.1 400")
            assert log.messages.count(_INVALID) == 1
            assert (await http.get("/healthz")).status_code == 200
            r = await http.get("/metrics", headers=live.headers(live.operator_token()))
            assert r.status_code == 200
            assert _refused(r.text) == {"400": 2.0, "408": 1.0, "431": 1.0}
        logging.getLogger("uvicorn.error").removeHandler(log)
