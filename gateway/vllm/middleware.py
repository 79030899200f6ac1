"""``KvgateMiddleware``: tenant checks inside vLLM's OpenAI server (``--middleware``).

vLLM builds it as ``KvgateMiddleware(app)``; its configuration comes from ``KVGATE_VLLM_*``
(``guard.GuardConfig.from_env``), read at the first request, never at import. Every request to a
path under ``/v1`` needs a valid bearer token (401 otherwise, before any of the body is read); a
POST to an inference path
(``guard.GUARDED_PATHS``) also gets a capability and the tenant's cache_salt in its body (403 if
no capability can be minted, 400 for a body that is not a JSON object, 413 past the size limit).
Other paths (``/health``, ``/metrics``) pass untouched. Answers are problem+json. The tenant
and namespace may come from a trusted gateway's headers (``TenantGuard.identify``); a tenant
header from any other peer is a 403, audited. A published prefix's warm-up (headers X-KV-Warm-Up and
X-KV-Capability, ``TenantGuard.warm_up``) passes with the scope's capability from a trusted peer or
with an operator's token, and is a 403, audited, from anyone else; a capability or warm-up field in
any other request's body is replaced, as ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from gateway.vllm.errors import TenantRequestError
from gateway.vllm.guard import GUARDED_PATHS, GuardConfig, TenantGuard, problem
from gateway.vllm.peers import peer_of
from gateway.vllm.relay import BodyTooLarge, read_body

__all__ = ["KvgateMiddleware"]

Scope = dict[str, Any]


class KvgateMiddleware:
    def __init__(self, app: Any, guard: TenantGuard | None = None, *, env: Mapping[str, str] | None = None) -> None:
        self.app = app
        self._guard = guard
        self._env = env  # where the settings are read from (default: the process environment)
        self._lock = asyncio.Lock()

    async def guard(self) -> TenantGuard:
        if self._guard is None:
            async with self._lock:
                if self._guard is None:
                    self._guard = await TenantGuard.open(GuardConfig.from_env(self._env))
        return self._guard

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1") and scope["path"] not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        guard = await self.guard()
        headers = dict(scope.get("headers") or [])
        try:
            # the identity first: no body is read for a caller who is not authenticated
            peer = peer_of(scope)
            warm = await guard.warm_up(peer, headers, scope["method"], scope["path"])
            who = await guard.identify(peer, headers) if warm is None else None
            if scope["method"] == "POST" and scope["path"] in GUARDED_PATHS:
                body = await read_body(receive, guard.config.max_body_bytes)
                if warm is not None:
                    body = guard.rewrite_warm_up(warm, body)
                else:
                    assert who is not None
                    body = await guard.rewrite(who.principal, who.token, body, who.namespace)
                scope = dict(scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"transfer-encoding")]
                scope["headers"].append((b"content-length", str(len(body)).encode()))
                receive = _replay(body)
        except TenantRequestError as exc:
            await _answer(send, exc.status, exc.title, exc.detail)
            return
        except BodyTooLarge:
            await _answer(send, 413, "Content Too Large", "the request body is too large")
            return
        await self.app(scope, receive, send)


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # like a client that stays connected
        return {"type": "http.disconnect"}

    return receive


async def _answer(send: Any, status: int, title: str, detail: str) -> None:
    headers, body = problem(status, title, detail)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
