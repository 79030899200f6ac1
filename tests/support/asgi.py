"""A plain ASGI app for middleware tests: it answers 200 with the request body it was given."""

from __future__ import annotations

from typing import Any

from gateway.vllm.relay import read_body


async def echo_body(scope: Any, receive: Any, send: Any) -> None:
    body = await read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
