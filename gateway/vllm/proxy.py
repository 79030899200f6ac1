"""A standalone tenant proxy in front of a vLLM OpenAI server (for deployments that cannot add
``--middleware``): the same checks as ``KvgateMiddleware``, then the request is forwarded with
httpx and the answer streamed back (server-sent events included).

    uvicorn --factory gateway.vllm.proxy:app_from_env   # KVGATE_VLLM_UPSTREAM=http://127.0.0.1:8000

The upstream must be reachable only through the proxy, or clients could bypass it.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.vllm.config import MiddlewareSettings
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.guard import GuardConfig, TenantGuard
from gateway.vllm.middleware import KvgateMiddleware
from gateway.vllm.relay import end_to_end, read_body, relay, target

__all__ = ["app_from_env", "create_proxy"]


def create_proxy(upstream: str, guard: TenantGuard | None = None, *, timeout: float = 600.0) -> Any:
    """An ASGI app: KvgateMiddleware around a forwarder to ``upstream``."""
    base = upstream.rstrip("/")
    client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)

    async def forward(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = await read_body(receive)
        headers = [(k, v) for k, v in end_to_end(scope["headers"]) if k.lower() != b"authorization"]
        req = client.build_request(scope["method"], base + target(scope), headers=headers, content=body)
        if not await relay(client, req, send):
            await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"upstream unavailable"})

    return KvgateMiddleware(forward, guard)


def app_from_env() -> Any:
    settings = MiddlewareSettings.from_env()
    if not settings.upstream:
        raise ConnectorConfigError("KVGATE_VLLM_UPSTREAM (the vLLM server URL) is required")
    return create_proxy(settings.upstream, TenantGuard(GuardConfig.from_settings(settings)))
