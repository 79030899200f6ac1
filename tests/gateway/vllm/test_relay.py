"""The forwarding the tenant proxy and the P/D proxy share (gateway/vllm/relay.py), through
``create_proxy`` over real uvicorn servers: an upstream that records what reached it and streams
its answer in parts, the proxy in front on a TCP port. Paths outside ``/v1`` pass the tenant
middleware unguarded, so no gateway is needed to see the forwarding itself."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.vllm.proxy import create_proxy
from gateway.vllm.relay import BodyTooLarge, read_body, relay, target
from tests.gateway.vllm.test_tenant_header import serve


def _upstream(seen: list[dict[str, Any]]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        seen.append({"path": target(scope), "method": scope["method"], "body": body, "headers": dict(scope["headers"])})
        await send({"type": "http.response.start", "status": 207, "headers": [
            (b"content-type", b"text/event-stream"), (b"x-upstream", b"yes"), (b"proxy-authorization", b"Basic leak")]})
        for part in (b"data: one\n\n", b"data: two\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


async def test_the_proxy_forwards_path_query_and_body_and_streams_the_answer_back_without_hop_headers():
    seen: list[dict[str, Any]] = []
    with serve(_upstream(seen)) as up, serve(create_proxy(up.tcp), lifespan="on") as proxy:
        async with proxy.client(over_socket=False) as c:
            body = json.dumps({"x": "y" * 100_000}).encode()
            r = await c.post("/stats/x?a=1&b=%20", content=body, headers={
                "Authorization": "Bearer secret", "Proxy-Authorization": "Basic p", "x-request-id": "r-1"})
    assert r.status_code == 207 and r.text == "data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert r.headers["x-upstream"] == "yes" and "proxy-authorization" not in r.headers
    (got,) = seen
    assert (got["method"], got["path"], got["body"]) == ("POST", "/stats/x?a=1&b=%20", body)
    assert got["headers"][b"x-request-id"] == b"r-1"
    assert b"authorization" not in got["headers"] and b"proxy-authorization" not in got["headers"]


async def test_an_unreachable_upstream_is_a_502_from_the_proxy():
    seen: list[dict[str, Any]] = []
    with serve(_upstream(seen)) as up:
        gone = up.tcp
    with serve(create_proxy(gone, timeout=5), lifespan="on") as proxy:
        async with proxy.client(over_socket=False) as c:
            r = await c.get("/health")
    assert (r.status_code, r.text) == (502, "upstream unavailable")
    # positive control: the same proxy to a live upstream answers with the upstream's status
    with serve(_upstream(seen)) as up, serve(create_proxy(up.tcp), lifespan="on") as proxy:
        async with proxy.client(over_socket=False) as c:
            assert (await c.get("/health")).status_code == 207


def _receiver(*msgs: dict[str, Any]) -> Any:
    queue = list(msgs)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


async def test_read_body_joins_the_parts_stops_at_a_disconnect_and_refuses_past_its_limit():
    parts = ({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"cd"})
    assert await read_body(_receiver(*parts)) == b"abcd"
    assert await read_body(_receiver(*parts), limit=4) == b"abcd"
    with pytest.raises(BodyTooLarge):
        await read_body(_receiver(*parts), limit=3)
    cut = ({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})
    assert await read_body(_receiver(*cut)) == b"ab"


def test_target_keeps_the_query_string():
    assert target({"path": "/v1/models", "query_string": b""}) == "/v1/models"
    assert target({"path": "/v1/models", "query_string": b"a=1"}) == "/v1/models?a=1"


async def test_relay_reports_an_unreachable_upstream_and_sends_nothing():
    sent: list[Any] = []

    async def send(msg: Any) -> None:
        sent.append(msg)

    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds="/nonexistent/kvgate.sock")) as client:
        assert await relay(client, client.build_request("GET", "http://x/"), send) is False
    assert sent == []
