"""The HTTP forwarding that the tenant proxy (``proxy``) and the prefill/decode proxy (``disagg``)
share: an ASGI request's body and target, and an upstream answer streamed back to the caller
(server-sent events included) without the hop-by-hop headers of either connection."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

__all__ = ["HOP_BY_HOP", "BodyTooLarge", "end_to_end", "read_body", "relay", "target"]

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-authorization",
                        b"host", b"content-length"})


class BodyTooLarge(Exception):
    """The request body is longer than the ``limit`` given to ``read_body``."""


async def read_body(receive: Any, limit: int | None = None) -> bytes:
    """The whole request body (what came before a disconnect); ``BodyTooLarge`` past ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


def target(scope: dict[str, Any]) -> str:
    """The request's path with its query string, as sent on upstream."""
    path: str = scope["path"]
    query = scope.get("query_string")
    return path + ("?" + query.decode("latin-1") if query else "")


def end_to_end(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop-by-hop ones (``HOP_BY_HOP``)."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


async def relay(client: httpx.AsyncClient, request: httpx.Request, send: Any) -> bool:
    """Send ``request`` and stream its answer to ``send`` as it arrives; False, with nothing sent,
    where the upstream could not be reached (the caller answers that in its own words)."""
    try:
        resp = await client.send(request, stream=True)
    except httpx.HTTPError:
        return False
    try:
        await send({"type": "http.response.start", "status": resp.status_code, "headers": end_to_end(resp.headers.raw)})
        async for chunk in resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        await resp.aclose()
    return True
